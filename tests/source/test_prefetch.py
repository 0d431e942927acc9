"""Prefetch and ranged reads: correctness, retries, stalls, servers ignoring Range, memory bound,
thread cleanup. The store is fsspec's memory filesystem with fault knobs (a fake at the fsspec
seam: every byte still goes through fsspec's cat_file/info calls)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import cloudshards as wds
from cloudshards.errors import ShardOpenError
from cloudshards.source import FetchOptions, IOStats, OpenOptions, ShardPrefetcher, parts, prefetch


class FaultyMemoryFileSystem(MemoryFileSystem):
    """``faultmem://``: memory objects with injectable failures, delays and ignored ranges."""

    protocol = "faultmem"
    store: ClassVar[dict[str, Any]] = {}  # separate from memory://'s objects
    pseudo_dirs: ClassVar[list[str]] = [""]
    fail_every = 0  # every Nth cat_file raises ConnectionResetError
    fail_all = False
    delay_s = 0.0
    ignore_range = False
    no_size = False  # info() without a size, like some HTTP servers
    info_gate: threading.Event | None = None  # info() waits for this (bounded)
    log: ClassVar[list[tuple[str, str, int | None]]] = []
    calls = 0
    in_flight = 0
    peak_in_flight = 0
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if path.startswith("faultmem://"):
            path = path[len("faultmem://") :]
        return "/" + path.lstrip("/")

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> bytes:
        cls = type(self)
        with cls.lock:
            cls.calls += 1
            call = cls.calls
            cls.in_flight += 1
            cls.peak_in_flight = max(cls.peak_in_flight, cls.in_flight)
        try:
            if cls.delay_s:
                time.sleep(cls.delay_s)
            if cls.fail_all or (cls.fail_every and call % cls.fail_every == 0):
                raise ConnectionResetError("connection reset by peer (injected)")
            if cls.ignore_range:
                start = end = None
            data: bytes = super().cat_file(path, start=start, end=end, **kw)
            if cls.info_gate is not None:
                cls.log.append(("got", path, start))
            return data
        finally:
            with cls.lock:
                cls.in_flight -= 1

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        cls = type(self)
        if cls.info_gate is not None:
            cls.log.append(("info", path, None))
            cls.info_gate.wait(10)
            cls.log.append(("info returned", path, None))
        details: dict[str, Any] = super().info(path, **kw)
        if cls.no_size:
            details = {**details, "size": None}
        return details


@pytest.fixture
def faultmem() -> Iterator[type[FaultyMemoryFileSystem]]:
    fsspec.register_implementation("faultmem", FaultyMemoryFileSystem, clobber=True)
    cls = FaultyMemoryFileSystem
    cls.store.clear()
    cls.fail_every, cls.fail_all, cls.delay_s, cls.ignore_range = 0, False, 0.0, False
    cls.no_size, cls.info_gate = False, None
    cls.log.clear()
    cls.calls = cls.in_flight = cls.peak_in_flight = 0
    parts._UNRANGED_HOSTS.clear()
    yield cls
    cls.store.clear()
    parts._UNRANGED_HOSTS.clear()


def upload(make_shards: Any, sizes: list[int], payload_bytes: int = 20_000) -> Any:
    shards = make_shards(sizes, payload_bytes=payload_bytes)
    fs = fsspec.filesystem("faultmem", skip_instance_cache=True)
    for path in shards.paths:
        fs.pipe(f"/bucket/{path.name}", path.read_bytes())
    return shards


def spec(shards: Any) -> str:
    return f"faultmem://bucket/shard-{{000000..{len(shards.paths) - 1:06d}}}.tar"


SMALL = {"part_bytes": 1 << 16, "concurrency": 3, "prefetch": 2}


def read_all(shards: Any, **kw: Any) -> list[tuple[str, bytes]]:
    ds = wds.WebDataset(spec(shards), shardshuffle=False, **{**SMALL, **kw})
    return [(s["__key__"], s["bin"]) for s in ds]


def expected(shards: Any) -> list[tuple[str, bytes]]:
    return [(key, fields["bin"]) for key, fields in shards.samples]


def test_ranged_parts_reassemble_exactly(make_shards: Any, faultmem: Any) -> None:
    shards = upload(make_shards, [7, 3, 12])
    assert read_all(shards) == expected(shards)
    # Several ranged GETs per shard (parts of 64 KiB) plus one info per shard.
    assert faultmem.calls > 3 * 2


def test_transient_failures_are_retried_and_counted(make_shards: Any, faultmem: Any) -> None:
    shards = upload(make_shards, [6, 6])
    faultmem.fail_every = 2
    before = wds.WebDataset(spec(shards), shardshuffle=False).stats()["io"]["retries"]
    got = read_all(shards, retries=5)
    assert got == expected(shards)
    after = wds.WebDataset(spec(shards), shardshuffle=False).stats()["io"]["retries"]
    assert after - before >= faultmem.calls // 2 - 1


def test_persistent_failure_gives_up_within_bound(make_shards: Any, faultmem: Any) -> None:
    shards = upload(make_shards, [3])
    faultmem.fail_all = True
    start = time.perf_counter()
    with pytest.raises(ShardOpenError, match="gave up after 3 attempts") as info:
        read_all(shards, retries=2)
    assert time.perf_counter() - start < 30
    assert "faultmem://bucket/shard-000000.tar" in str(info.value)
    assert info.value.offset is not None


def test_failure_goes_to_the_handler(make_shards: Any, faultmem: Any) -> None:
    shards = upload(make_shards, [3])
    faultmem.fail_all = True
    ds = wds.WebDataset(
        spec(shards), shardshuffle=False, handler="skip", retries=0, empty_check=False, **SMALL
    )
    assert list(ds) == []


def test_stall_is_an_error_not_a_hang(make_shards: Any, faultmem: Any) -> None:
    """A backend whose reads cannot be bounded (a synchronous fsspec filesystem) that hangs:
    the reader gives up once the part's tries would all have timed out (2 x 0.2 s, a second
    each beyond it, and a backoff), before the read would have come back, and does not hang
    on it."""
    shards = upload(make_shards, [2])
    faultmem.delay_s = 4.0
    start = time.perf_counter()
    with pytest.raises(ShardOpenError, match="stalled"):
        read_all(shards, stall_timeout_s=0.2, retries=1, prefetch=0)
    assert time.perf_counter() - start < 15  # closing waits for the hung read (4 s)


def test_server_ignoring_range_is_detected(
    make_shards: Any, faultmem: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shards = upload(make_shards, [8, 8, 8])
    faultmem.ignore_range = True
    assert read_all(shards) == expected(shards)
    assert "faultmem://bucket" in parts._UNRANGED_HOSTS
    assert [r.getMessage() for r in caplog.records if "ignores Range" in r.getMessage()] == [
        "faultmem://bucket ignores Range requests; streaming its shards with one GET each"
    ]


@pytest.mark.parametrize("sizes", [[9, 4, 11], [1]])
def test_objects_without_a_size_are_read_whole(
    make_shards: Any, faultmem: Any, sizes: list[int]
) -> None:
    # After the first ranged part the rest is one resumable stream ([1]: smaller than a part).
    shards = upload(make_shards, sizes)
    faultmem.no_size = True
    assert read_all(shards) == expected(shards)


def test_the_streamed_rest_of_an_object_without_a_size_is_read_a_part_at_a_time(
    make_shards: Any, faultmem: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that gives no size and ignores Range may send an endless body (or a huge
    one): its rest is handed on a part at a time, never read whole into memory (the process
    grew by 130 MB/s and delivered nothing)."""
    from cloudshards.source.resumable import ResumableStream

    shards = upload(make_shards, [12, 12])  # 12 x 20 kB: four 64 KiB parts each
    faultmem.no_size = True
    asked: list[int] = []
    read = ResumableStream.read

    def recorded(self: ResumableStream, size: int = -1) -> bytes:
        asked.append(size)
        return read(self, size)

    monkeypatch.setattr(ResumableStream, "read", recorded)
    assert read_all(shards) == expected(shards)
    assert asked
    # A part, or what the tar reader asks for at once (4 MiB); never "all of it" (-1).
    assert all(0 < size <= 4 << 20 for size in asked), asked


def test_first_sample_does_not_wait_for_the_size_lookup(make_shards: Any, faultmem: Any) -> None:
    shards = upload(make_shards, [6, 6, 6])
    faultmem.info_gate = threading.Event()
    it = iter(wds.WebDataset(spec(shards), shardshuffle=False, **SMALL))
    first = next(it)  # the lookups are all still blocked
    # A reader that waited for a size lookup would get here only after the gate's timeout
    # let that lookup return.
    returned = [path for event, path, _ in faultmem.log if event == "info returned"]
    faultmem.info_gate.set()
    assert returned == []
    assert [(first["__key__"], first["bin"])] + [(s["__key__"], s["bin"]) for s in it] == (
        expected(shards)
    )
    # The second and third shards went out only after the first one's first bytes were in.
    events = list(faultmem.log)
    first_part = events.index(("got", "/bucket/shard-000000.tar", 0))
    later = [
        i
        for i, (event, path, _) in enumerate(events)
        if "shard-000000" not in path and event != "info returned"
    ]
    assert later
    assert min(later) > first_part


def test_with_a_cache_the_first_shard_also_goes_out_alone(
    make_shards: Any, faultmem: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the node cache too, the shards after the first start once its first answer is
    in: started with it, they slowed its first sample (by 0.05-0.17 s behind the cloud
    simulator, a cold epoch through the cache 5% slower than without)."""
    shards = upload(make_shards, [6, 6, 6])
    events: list[tuple[str, str]] = []
    cat_file = FaultyMemoryFileSystem.cat_file

    def logged(self: Any, path: str, *args: Any, **kw: Any) -> bytes:
        events.append(("asked", path))
        data: bytes = cat_file(self, path, *args, **kw)
        events.append(("got", path))
        return data

    monkeypatch.setattr(FaultyMemoryFileSystem, "cat_file", logged)
    faultmem.delay_s = 0.05  # every answer takes a while, as a store's do
    cache = tmp_path / "cache"
    assert read_all(shards, cache_dir=str(cache)) == expected(shards)
    first_answer = events.index(("got", "/bucket/shard-000000.tar"))
    later = [i for i, (kind, path) in enumerate(events) if "shard-000000" not in path]
    assert later
    assert min(later) > first_answer, events[: first_answer + 1]


def test_closing_before_the_first_bytes_starts_no_later_shard(
    make_shards: Any, faultmem: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards after the first wait for its first bytes; closing wakes them, and then
    they started their downloads anyway, for nobody."""
    from cloudshards.cache.shardcache import ShardCache

    shards = upload(make_shards, [6, 6, 6, 6])
    asked: list[tuple[float, str]] = []
    cat_file, info = FaultyMemoryFileSystem.cat_file, FaultyMemoryFileSystem.info

    def logged_cat(self: Any, path: str, *args: Any, **kw: Any) -> bytes:
        asked.append((time.monotonic(), path))
        return cat_file(self, path, *args, **kw)

    def logged_info(self: Any, path: str, **kw: Any) -> Any:
        asked.append((time.monotonic(), path))
        return info(self, path, **kw)

    monkeypatch.setattr(FaultyMemoryFileSystem, "cat_file", logged_cat)
    monkeypatch.setattr(FaultyMemoryFileSystem, "info", logged_info)
    faultmem.delay_s = 0.5  # the first shard's first answer takes a while
    for cache in (None, ShardCache(str(tmp_path / "cache"))):
        asked.clear()
        prefetcher = ShardPrefetcher(
            (
                {"url": f"faultmem://bucket/{path.name}", "shard_index": i}
                for i, path in enumerate(shards.paths)
            ),
            options=OpenOptions(),
            fetch=FetchOptions(prefetch=2, part_bytes=1 << 16, concurrency=2),
            cache=cache,
        )
        it = iter(prefetcher)
        _, stream = next(it)
        if not isinstance(stream, BaseException):
            stream.close()  # the consumer stops at once (a slice, a failed first sample)
        closed_at = time.monotonic()
        it.close()
        later = [path for at, path in asked if at >= closed_at and "shard-000000" not in path]
        assert later == [], (cache, later)


def test_memory_bound_and_threads_gone_after_close(make_shards: Any, faultmem: Any) -> None:
    shards = upload(make_shards, [20] * 6)
    options = FetchOptions(prefetch=1, part_bytes=1 << 16, concurrency=2)
    faultmem.delay_s = 0.01
    stats = IOStats()
    prefetcher = ShardPrefetcher(
        (
            {"url": f"faultmem://bucket/{p.name}", "shard_index": i}
            for i, p in enumerate(shards.paths)
        ),
        options=OpenOptions(),
        fetch=options,
        stats=stats,
    )
    it = iter(prefetcher)
    consumed = 0
    for _ in range(3):
        _, stream = next(it)
        assert stream is not None
        assert not isinstance(stream, BaseException)
        while True:
            data = stream.read(1 << 14)
            if not data:
                break
            consumed += len(data)
            # Everything received but not consumed is what prefetch holds in memory.
            held = stats.bytes - consumed
            assert held <= options.max_buffered_bytes
        stream.close()
    # Parts in flight never exceed (prefetch + 1) x concurrency requests.
    assert faultmem.peak_in_flight <= (options.prefetch + 1) * options.concurrency + 1
    it.close()  # type: ignore[attr-defined]
    assert prefetch.current_thread_count() == 0


def test_abandoned_iterator_cleans_up(make_shards: Any, faultmem: Any) -> None:
    shards = upload(make_shards, [10] * 5)
    ds = wds.WebDataset(spec(shards), shardshuffle=False, **SMALL)
    it = iter(ds)
    next(it)
    del it
    import gc

    gc.collect()
    deadline = time.monotonic() + 10
    while prefetch.current_thread_count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefetch.current_thread_count() == 0


def test_local_datasets_start_no_threads(make_shards: Any) -> None:
    shards = make_shards([3, 3])
    before = threading.active_count()
    ds = wds.WebDataset(shards.spec(), shardshuffle=False)
    it = iter(ds)
    next(it)
    assert threading.active_count() == before
    assert len(list(it)) == 5


def test_fetch_options_validate() -> None:
    from cloudshards.errors import ConfigError

    with pytest.raises(ConfigError):
        FetchOptions(concurrency=0)
    with pytest.raises(ConfigError):
        FetchOptions(part_bytes=10)
    assert (
        FetchOptions(prefetch=2, concurrency=4, part_bytes=1 << 20).max_buffered_bytes == 12 << 20
    )


def _fetched_ahead(make_shards: Any, faultmem: Any, fetch: FetchOptions) -> bool:
    """Whether the second shard is asked for while the first is being read."""
    shards = upload(make_shards, [10] * 4)
    faultmem.info_gate = threading.Event()
    faultmem.info_gate.set()  # log every request, hold none
    prefetcher = ShardPrefetcher(
        (
            {"url": f"faultmem://bucket/{p.name}", "shard_index": i}
            for i, p in enumerate(shards.paths)
        ),
        options=OpenOptions(),
        fetch=fetch,
    )
    it = iter(prefetcher)
    try:
        _, stream = next(it)
        assert not isinstance(stream, BaseException)
        assert stream.read(100)
        second = f"/bucket/{shards.paths[1].name}"
        deadline = time.monotonic() + 2  # a shard ahead is asked for at once, or never
        while time.monotonic() < deadline and not any(p == second for _, p, _ in faultmem.log):
            time.sleep(0.02)
        return any(path == second for _, path, _ in faultmem.log)
    finally:
        it.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("node_buffer", ["1", str(4 << 30)])
def test_the_node_buffer_budget_bounds_the_shards_ahead(
    make_shards: Any, faultmem: Any, monkeypatch: pytest.MonkeyPatch, node_buffer: str
) -> None:
    """With a node buffer budget that holds no shard ahead, the next shard is not fetched
    while the first is read; with room (the default), it is."""
    from cloudshards.source import budget

    monkeypatch.setenv("CLOUDSHARDS_NODE_BUFFER_BYTES", node_buffer)
    budget.forget()
    fetch = FetchOptions(prefetch=2, part_bytes=1 << 16, concurrency=2)
    assert _fetched_ahead(make_shards, faultmem, fetch) == (node_buffer != "1")


@pytest.mark.parametrize("measured", [False, True])
def test_a_slow_readers_shards_take_less_of_the_node_buffer(
    make_shards: Any, faultmem: Any, monkeypatch: pytest.MonkeyPatch, measured: bool
) -> None:
    """A share of the node's buffer budget that holds no shard ahead at the fixed bound (4
    parts of 64 KiB) holds one once the reader is measured slow (2 parts in flight)."""
    from cloudshards.source import adapt, budget

    monkeypatch.setenv("CLOUDSHARDS_NODE_BUFFER_BYTES", str(3 << 17))  # 384 KiB: 1.5 shards
    budget.forget()
    if measured:
        url = "faultmem://bucket/earlier.tar"
        for _ in range(3):
            adapt.record(url, 64 << 10, 0.03)  # 30 ms to first byte
            adapt.record(url, 1 << 20, 0.24)  # 5 MB/s a connection: parts stay 64 KiB
        adapt.record_reading(url, 26 << 20, 50.0)  # 0.5 MB/s: two parts in flight bring it
    fetch = FetchOptions(prefetch=2, part_bytes=1 << 16, concurrency=4, adaptive=True)
    assert _fetched_ahead(make_shards, faultmem, fetch) == measured


@pytest.mark.timeout(120)
def test_a_reader_abandoned_in_a_reference_cycle_never_deadlocks_its_collector(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop that raises, caught by the program, leaves its reader in a cycle (through the
    traceback). The garbage collector finalizes it later in whatever thread allocates, one of
    the reader's own pool threads or the main thread inside ``executor.submit``: closing it
    there once waited for threads that needed the locks that thread held (a hang)."""
    import gc

    import fakes

    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    shards = make_shards([20] * 4, payload_bytes=8000)
    urls = [fakes.url_of(p) for p in shards.paths]

    def boom(sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"].endswith("7"):
            raise ValueError("a sample the loop cannot use")
        return sample

    thresholds = gc.get_threshold()
    gc.set_threshold(20)  # collections everywhere, in every thread
    try:
        for _ in range(15):

            def step() -> None:
                dataset = wds.WebDataset(urls, shardshuffle=False, part_bytes=64 << 10).map(boom)
                try:
                    for _ in dataset:
                        pass
                except ValueError as exc:
                    kept = exc  # exception -> traceback -> this frame -> exception: a cycle
                    assert kept

            step()
            assert len(list(wds.WebDataset(urls, shardshuffle=False))) == 80
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
    deadline = time.monotonic() + 30
    while prefetch.current_thread_count() and time.monotonic() < deadline:
        time.sleep(0.05)  # the reaper closes what the collector found
    assert prefetch.current_thread_count() == 0
