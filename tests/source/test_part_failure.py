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
from cloudshards.source.retries import LinkedEvent

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


def test_a_shards_own_cancel_counts_its_readers_and_says_which_was_set() -> None:
    """A shard's reading ends with the reader's close (its parent event) or on its own (a
    failed part): either stops the shard's retries, and an error says which it was."""
    reader = threading.Event()
    shard = LinkedEvent(reader)
    assert not shard.is_set()
    assert not shard.wait(0.05)
    shard.set()
    assert shard.is_set()
    assert not reader.is_set()  # a shard given up leaves the reader's other shards be
    assert "given up" in shard.why()
    other = LinkedEvent(reader)
    closer = threading.Timer(0.2, reader.set)
    closer.start()
    assert other.wait(5.0)  # the reader's close is seen by a wait already under way
    closer.join()
    assert other.why() == "the reader was closed"
