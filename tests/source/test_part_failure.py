"""A shard given up on (a part failed for good, or the reader closed it) stops the retries of
its other parts in flight: they would hold the pool's threads and the node's request slots,
with backoff, for bytes nobody reads."""

from __future__ import annotations

import concurrent.futures as cf
import io
import threading
import time
from collections import Counter

import pytest

from cloudshards.errors import ShardOpenError
from cloudshards.source import FetchOptions, IOStats
from cloudshards.source.parts import PartStream

PART = 64 << 10
DATA = bytes(4 * PART)


class DeadStore:
    """Every GET fails with a reset; a part after the first takes ``slow_s`` to fail."""

    url = "mem://bucket/dead.tar"

    def __init__(self, slow_s: float) -> None:
        self.slow_s = slow_s
        self.calls: Counter[int] = Counter()
        self._lock = threading.Lock()

    def info(self, timeout: float | None = None) -> dict[str, int]:
        return {"size": len(DATA)}

    def cat_range(self, start: int, end: int, timeout: float | None = None) -> bytes:
        with self._lock:
            self.calls[start] += 1
        if start:
            time.sleep(self.slow_s)
        raise ConnectionError("connection reset by peer")

    def cat(self) -> bytes:
        raise ConnectionError("connection reset by peer")

    def open(self, block_bytes: int) -> io.BytesIO:
        raise ConnectionError("connection reset by peer")


@pytest.mark.parametrize("how", ["first part fails for good", "reader closes the shard"])
def test_a_shard_given_up_on_stops_its_parts_retrying(how: str) -> None:
    store = DeadStore(slow_s=0.4)
    options = FetchOptions(
        part_bytes=PART, concurrency=4, retries=3, backoff_s=0.01, max_backoff_s=0.01
    )
    with cf.ThreadPoolExecutor(4, thread_name_prefix="cloudshards-test") as pool:
        stream = PartStream(store, store.info(), executor=pool, options=options, stats=IOStats())
        stream.start()
        if how == "reader closes the shard":
            time.sleep(0.1)  # the parts are in flight
            stream.close()
        else:
            with pytest.raises(ShardOpenError, match="gave up after 4 attempts"):
                stream.read()
            stream.close()
    assert store.calls[0] in (1, 4)  # the first part: its own tries (none more once closed)
    later = {start: n for start, n in store.calls.items() if start}
    assert later == {PART: 1, 2 * PART: 1, 3 * PART: 1}  # each stopped after its try in flight
