"""Downloads ahead into the node cache: the shards after the next one are written by background
threads at the store's speed, each still fetched once, counted once, and cancelled cleanly when
the reader stops early."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fakes
import pytest
from fsspec.registry import _registry as fsspec_registry

import cloudshards as wds
import cloudshards.urls
from cloudshards.cache import entry_name
from cloudshards.cache.lock import is_locked
from cloudshards.process import PerProcess
from cloudshards.source import OpenOptions, prefetch


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    log = tmp_path / "opens.log"
    monkeypatch.setenv(fakes.OPEN_LOG_ENV, str(log))
    return log


def opens(log: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        counts[line] = counts.get(line, 0) + 1
    return counts


def test_later_shards_are_downloaded_ahead_once_each(
    make_shards: Any, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3] * 8, payload_bytes=4000)
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    started: list[str] = []
    original = wds.ShardCache.download_ahead

    def spy(self: Any, url: str, *args: Any, **kw: Any) -> Any:
        thread = original(self, url, *args, **kw)
        if thread is not None:
            started.append(url)
        return thread

    monkeypatch.setattr(wds.ShardCache, "download_ahead", spy)
    monkeypatch.setenv(fakes.OPEN_DELAY_ENV, "0.02")  # a store with first-byte latency
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), prefetch=2)
    got = [(s["__key__"], s["bin"]) for s in ds]
    assert got == [(key, fields["bin"]) for key, fields in shards.samples]
    assert started  # from the shard after the first committed entry on
    assert set(started) <= set(urls[1:])
    assert opens(store) == {str(p): 1 for p in shards.paths}
    for url, path in zip(urls, shards.paths, strict=True):
        assert (cache_dir / "data" / entry_name(url)).read_bytes() == path.read_bytes()
    stats = ds.cache.stats  # type: ignore[union-attr]
    # Shards read back after downloading them ahead are misses, not hits.
    assert (stats.misses, stats.hits, stats.waits) == (8, 0, 0)
    assert prefetch.current_thread_count() == 0


class StallingFile(fakes.SlowFile):
    """A streamed body whose reads after the first wait for ``StallingStore.release``."""

    def readinto(self, buffer: Any) -> int:
        if self.tell():
            StallingStore.waiting.set()
            StallingStore.release.wait(30)
        return super().readinto(buffer)


class StallingStore(fakes.SlowFileSystem):
    """``stallfile:///abs/path``: ``slowfile://`` whose objects in ``stalled`` stop after their
    first part (a ranged GET from offset 0, or the first read of a streamed GET) until
    ``release`` is set: downloads of them are mid-way, their later parts not even requested.
    """

    protocol = "stallfile"
    stalled: ClassVar[set[str]] = set()
    release: ClassVar[threading.Event] = threading.Event()
    waiting: ClassVar[threading.Event] = threading.Event()  # set when a read starts to wait

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        if start and self._strip_protocol(path) in self.stalled:
            self.waiting.set()
            self.release.wait(30)
        return super().cat_file(path, start, end, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> fakes.SlowFile:
        file = super()._open(path, mode, **kwargs)
        if self._strip_protocol(path) not in self.stalled:
            return file
        file.close()
        return StallingFile(self._strip_protocol(path))


@pytest.fixture
def stalling_store(store: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[StallingStore]]:
    monkeypatch.setitem(fsspec_registry, "stallfile", StallingStore)
    monkeypatch.setattr(cloudshards.urls, "_fs_cache", PerProcess(dict))
    monkeypatch.setattr(StallingStore, "stalled", set())
    monkeypatch.setattr(StallingStore, "release", threading.Event())
    monkeypatch.setattr(StallingStore, "waiting", threading.Event())
    yield StallingStore
    StallingStore.clear_instance_cache()


def test_a_cancelled_download_ahead_fetches_nothing_more(
    make_shards: Any,
    stalling_store: type[StallingStore],
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled mid-way, a download ahead stops where it is, however little is left (closing
    a consumer's stream completes a small remainder; nobody wants this one): no more bytes
    from the store, no entry, no partial file, no lock held, no miss and no uncached shard."""
    shards = make_shards([3, 3], payload_bytes=100_000)
    urls = [f"stallfile://{p}" for p in shards.paths]
    cache_dir = tmp_path / "cache"
    cache = wds.ShardCache(cache_dir)
    with cache.open(urls[0]) as stream:  # downloads ahead start once this process cached one
        while stream.read(1 << 20):
            pass
    monkeypatch.setenv(fakes.CHUNK_ENV, str(64 << 10))
    stalling_store.stalled.add(str(shards.paths[1]))
    network_before = cache.stats.bytes_network
    cancel = threading.Event()
    thread = cache.download_ahead(urls[1], OpenOptions(), cancel=cancel)
    assert thread is not None
    partial = cache_dir / "data" / f"{entry_name(urls[1])}.partial"
    deadline = time.monotonic() + 30
    # The first part is written and the second read is in flight (waiting at the store).
    while not (partial.exists() and partial.stat().st_size == 64 << 10):
        assert time.monotonic() < deadline, "the download ahead did not start"
        time.sleep(0.01)
    assert stalling_store.waiting.wait(30), "the second read was never made"
    cancel.set()
    stalling_store.release.set()  # the read in flight returns; nothing is read after it
    thread.join(30)
    assert not thread.is_alive()
    assert sorted(os.listdir(cache_dir / "data")) == [entry_name(urls[0])]
    assert [
        n for n in os.listdir(cache_dir / "locks") if is_locked(str(cache_dir / "locks" / n))
    ] == []
    assert cache.stats.bytes_network - network_before == 2 * (64 << 10)
    assert (cache.stats.misses, cache.stats.uncached) == (1, 0)
    with cache.open(urls[1]) as stream:  # a later read downloads it, and counts it
        assert stream.read() == shards.paths[1].read_bytes()
    assert (cache.stats.misses, cache.stats.hits, cache.stats.uncached) == (2, 0, 0)


def _read_in_another_process(cache_dir: str, urls: list[str]) -> None:
    cache = wds.ShardCache(cache_dir)
    for url in urls:
        with cache.open(url) as stream:
            while stream.read(1 << 20):
                pass


def test_an_early_stop_cancels_the_downloads_ahead(
    make_shards: Any,
    stalling_store: type[StallingStore],
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Downloads ahead still in flight when the iterator closes are cancelled: they stop
    fetching, leave no partial file, entry or held lock, count neither as misses nor as
    uncached, and their threads are gone; later reads (here and in other processes) work
    and count as usual."""
    monkeypatch.setenv("CLOUDSHARDS_PART_BYTES", str(64 << 10))  # many parts per shard
    monkeypatch.setenv("CLOUDSHARDS_CONCURRENCY", "2")
    cancels: list[threading.Event] = []
    original = wds.ShardCache.download_ahead

    def spy(self: Any, url: str, *args: Any, cancel: threading.Event, **kw: Any) -> Any:
        cancels.append(cancel)
        monkeypatch.setattr(StallingStore, "release", cancel)
        return original(self, url, *args, cancel=cancel, **kw)

    monkeypatch.setattr(wds.ShardCache, "download_ahead", spy)
    shards = make_shards([3] * 4, payload_bytes=200_000)
    size = shards.paths[1].stat().st_size
    assert size > 8 * (64 << 10)
    urls = [f"stallfile://{p}" for p in shards.paths]
    names = [entry_name(u) for u in urls]
    cache_dir = tmp_path / "cache"
    data = cache_dir / "data"
    list(wds.WebDataset(urls[:1], shardshuffle=False, cache_dir=str(cache_dir)))
    # Shard 0 is cached (downloads ahead start once this process cached one); the next two
    # are downloaded ahead while it is read, and stall after their first part.
    stalling_store.stalled.update(str(p) for p in shards.paths[1:3])
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir))
    stats = ds.cache.stats  # type: ignore[union-attr]
    network_before = stats.bytes_network
    it = iter(ds)
    next(it)
    deadline = time.monotonic() + 30
    partials = [data / f"{name}.partial" for name in names[1:3]]
    while not all(p.exists() and p.stat().st_size >= 64 << 10 for p in partials):
        assert time.monotonic() < deadline, "the downloads ahead did not start"
        time.sleep(0.01)
    it.close()  # type: ignore[attr-defined]
    assert len(cancels) == 2
    assert all(c.is_set() for c in cancels)
    assert prefetch.current_thread_count() == 0
    assert sorted(os.listdir(data)) == [names[0]]  # no partial file, no entry
    assert [
        n for n in os.listdir(cache_dir / "locks") if is_locked(str(cache_dir / "locks" / n))
    ] == []
    assert stats.bytes_network - network_before < size  # most of each was never fetched
    assert (stats.hits, stats.misses, stats.waits, stats.uncached) == (1, 1, 0, 0)
    assert opens(store) == {str(p): 1 for p in shards.paths[:3]}  # shard 3 was never asked for

    # Later reads: another process caches shards 1 and 2, then this one reads everything.
    stalling_store.stalled.clear()
    child = multiprocessing.get_context("fork").Process(
        target=_read_in_another_process, args=(str(cache_dir), urls[1:3])
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    got = [
        (s["__key__"], s["bin"])
        for s in wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir))
    ]
    assert got == [(key, fields["bin"]) for key, fields in shards.samples]
    assert sorted(os.listdir(data)) == sorted(names)
    assert (stats.hits, stats.misses, stats.waits, stats.uncached) == (4, 2, 0, 0)
    assert prefetch.current_thread_count() == 0


def test_before_the_first_commit_the_next_shards_open_while_the_first_is_read(
    make_shards: Any, store: Path, tmp_path: Path
) -> None:
    """No download ahead starts before this process has committed an entry; the shards after
    the first are opened through the cache when they are prefetched, so their bytes are in
    flight while the first is read (as without a cache), each still fetched once."""
    shards = make_shards([3] * 4, payload_bytes=4000)
    urls = [fakes.url_of(p) for p in shards.paths]
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(tmp_path / "cache"), prefetch=2)
    seen_while_first: dict[str, int] = {}
    got = []
    for sample in ds:
        if not got:  # the first sample: shard 1 is being read, nothing committed yet
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(opens(store)) < 3:
                time.sleep(0.01)
            seen_while_first = opens(store)
        got.append((sample["__key__"], sample["bin"]))
    assert got == [(key, fields["bin"]) for key, fields in shards.samples]
    assert set(seen_while_first) == {str(p) for p in shards.paths[:3]}
    assert opens(store) == {str(p): 1 for p in shards.paths}
    assert ds.cache.stats.misses == 4  # type: ignore[union-attr]
