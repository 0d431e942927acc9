"""The probe that tells connections sharing one bottleneck from connections capped one by one
(:mod:`cloudshards.source.adapt`): the host's first shard sends one part with no other large
GET of the host in flight, shards that wait for it lose nothing, and it is sent only where the
store answers fast."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_prefetch import expected, spec, upload
from test_prefetch import faultmem as faultmem  # the fixture

import cloudshards as wds
from cloudshards.errors import ShardOpenError
from cloudshards.source import FetchOptions, IOStats, adapt, parts

HOST = "faultmem://bucket/shard-000000.tar"
#: Shards of ~3 MiB: the default adaptive parts (2 MiB) leave a part after the first.
SIZES, PAYLOAD = [150] * 4, 20_000


@pytest.fixture(autouse=True)
def fresh_links() -> Iterator[None]:
    adapt.forget()
    yield
    adapt.forget()


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shards whose probe part was sent and came back."""
    came_back: list[str] = []
    end = parts.PartStream._end_probe

    def spy(stream: parts.PartStream, returned: Any = None, **kw: Any) -> None:
        if returned is not None:
            came_back.append(stream.url)
        end(stream, returned, **kw)

    monkeypatch.setattr(parts.PartStream, "_end_probe", spy)
    return came_back


def read(shards: Any) -> list[tuple[str, bytes]]:
    # Adaptive settings (no part_bytes or concurrency given), as users get them.
    dataset = wds.WebDataset(spec(shards), shardshuffle=False, prefetch=2)
    return [(sample["__key__"], sample["bin"]) for sample in dataset]


def test_the_probe_part_is_measured_alone(
    make_shards: Any, faultmem: Any, probes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every GET takes 10 ms: without holding the other shards back, the probe part would
    # share its time with their parts and measure no connection alone.
    monkeypatch.setattr(adapt, "PROBE_FIRST_BYTE_S", 1.0)  # the gate is the next test's
    shards = upload(make_shards, SIZES, PAYLOAD)
    faultmem.delay_s = 0.01
    assert read(shards) == expected(shards)
    assert probes == [HOST]  # once per host and process
    assert adapt._link(HOST).alone is not None


def test_a_shard_too_small_to_probe_leaves_the_probe_to_the_next(
    make_shards: Any, faultmem: Any, probes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first shard (~230 KB) has no part of 512 KiB after its first: a probe part there
    # would measure nothing. A shard opened after it, of ~3 MiB, sends the probe instead
    # (shard 1 or 2: shards 1 and 2 are opened while shard 0's size is on its way).
    monkeypatch.setattr(adapt, "PROBE_FIRST_BYTE_S", 1.0)
    shards = upload(make_shards, [10, *SIZES], PAYLOAD)
    faultmem.delay_s = 0.01
    assert read(shards) == expected(shards)
    assert len(probes) == 1
    assert probes[0] != HOST
    assert adapt._link(HOST).alone is not None


def test_tiny_shards_spare_the_probe_a_few_times_only() -> None:
    url = "fake://host/tiny.tar"
    for _ in range(adapt._PROBE_SPARES):
        assert adapt.claim_probe(url)
        adapt.probe_done(url, spare=True)
    assert adapt.claim_probe(url)
    adapt.probe_done(url, spare=True)
    assert not adapt.claim_probe(url)  # no shard of the host is claimed any more
    assert not adapt.wait_for_probe(url, lambda: None)  # and none holds the others back


def test_no_probe_where_the_first_answer_is_slow(
    make_shards: Any, faultmem: Any, probes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store behind a cloud's latency: each size comes after 30 ms.
    shards = upload(make_shards, SIZES, PAYLOAD)
    info = faultmem.info

    def slow_info(fs: Any, path: str, **kw: Any) -> dict[str, Any]:
        time.sleep(2 * adapt.PROBE_FIRST_BYTE_S)
        return info(fs, path, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(faultmem, "info", slow_info)
    assert read(shards) == expected(shards)
    assert probes == []
    assert not adapt.wait_for_probe(HOST, lambda: None)  # over: nobody waits


@pytest.mark.parametrize("ends", ["done", "never"])
def test_readers_held_back_by_another_shards_probe_lose_nothing(
    make_shards: Any, faultmem: Any, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    # Another shard of the host (a cache download ahead, say) holds the probe: every shard
    # read here waits for it, its reader included, and then reads all of its samples.
    monkeypatch.setattr(adapt, "_PROBE_WAIT_S", 0.5)
    shards = upload(make_shards, SIZES, PAYLOAD)
    assert adapt.claim_probe(HOST)
    adapt.probe_sent(HOST)  # its part is out
    if ends == "done":
        timer = threading.Timer(0.2, adapt.probe_done, args=(HOST,))
        timer.start()
    began = time.perf_counter()
    assert read(shards) == expected(shards)
    assert time.perf_counter() - began >= 0.2  # it did wait
    if ends == "done":
        timer.join()


# ------------------------------------------------ one stream, a store object in memory
class _Object:
    """A store object of ``size`` bytes in memory."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size = url, size
        self.data = bytes(i % 251 for i in range(size))

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        return {"size": self.size}

    def cat_range(self, start: int, end: int, timeout: float | None = None, **kw: Any) -> bytes:
        return self.data[start:end]


def _stream(obj: _Object, pool: cf.ThreadPoolExecutor, *, probe: bool) -> parts.PartStream:
    first: cf.Future[bytes] = cf.Future()
    first.set_result(obj.data[: 64 << 10])
    plan = adapt.PartPlan(64 << 10, 1 << 20, 2, probe=probe)
    return parts.PartStream(
        obj,  # type: ignore[arg-type]  # what PartStream uses of a store object
        {"size": obj.size},
        executor=pool,
        options=FetchOptions(),
        stats=IOStats(),
        plan=plan,
        first_part=None if probe else first,
    )


def test_a_probe_ending_between_a_readers_two_looks_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The reader's fill is held back; the other shard's probe comes back just before the
    # reader asks whether to wait for it: it must look again, not end the shard there.
    url = "fake://host/a.tar"
    obj = _Object(url, 3 << 20)
    waited = adapt.await_probe

    def probe_back_now(at: str) -> bool:
        adapt.probe_done(at)
        return waited(at)

    monkeypatch.setattr(adapt, "await_probe", probe_back_now)
    assert adapt.claim_probe(url)
    adapt.probe_sent(url)
    with cf.ThreadPoolExecutor(4) as pool:
        stream = _stream(obj, pool, probe=False)
        stream.start()
        got = bytearray()
        while chunk := stream.read():
            got += chunk
        stream.close()
    assert bytes(got) == obj.data


def test_closing_a_stream_whose_probe_part_waits_in_the_pool_does_not_deadlock() -> None:
    # Cancelling the pending probe part runs its callback at once, in the closing thread.
    obj = _Object("fake://host/b.tar", 3 << 20)
    with cf.ThreadPoolExecutor(1) as pool:
        busy = threading.Event()
        pool.submit(busy.wait, 10)  # the probe part stays queued behind this
        assert adapt.claim_probe(obj.url)
        stream = _stream(obj, pool, probe=True)
        stream.start()  # sends the probe part
        closing = threading.Thread(target=stream.close, daemon=True)
        closing.start()
        closing.join(5)
        busy.set()
        assert not closing.is_alive(), "close() deadlocked"
    assert not adapt.wait_for_probe(obj.url, lambda: None)  # the probe is over


def test_a_stream_whose_parts_cannot_be_requested_fails_naming_the_shard() -> None:
    # Its pool shut down under a reader that still reads: an error, never an early end.
    obj = _Object("fake://host/c.tar", 3 << 20)
    pool = cf.ThreadPoolExecutor(2)
    stream = _stream(obj, pool, probe=False)  # the first part is in, the rest not asked yet
    pool.shutdown()
    assert len(stream.read()) == 64 << 10
    with pytest.raises(ShardOpenError, match="no ranged GET could be started") as error:
        stream.read()
    assert obj.url in str(error.value)
    assert "byte offset 65536" in str(error.value)
    stream.close()
