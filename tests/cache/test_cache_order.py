"""The node cache's commit path: a download becomes an entry only once verified, and the rename,
the unlock and a follower's last read happen in the order docs/caching.md relies on.

Orderings are made observable without timing: the cache calls ``_cachelock._checkpoint(point)``
(a no-op) at named points of the commit path, and these tests replace it to look at the cache
there, or to let another reader act at exactly that moment. "Another process" is a second
``ShardCache`` on the same directory: flock treats its lock descriptors like another process's.
Shards are served by the ``slowfile://`` fake store (tests/fakes.py), whose open log counts
every fetch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import fakes
import pytest
from fsspec.registry import _registry as fsspec_registry

import cloudshards.urls
from cloudshards.cache import ShardCache, entry_name
from cloudshards.cache import lock as _cachelock
from cloudshards.cache.follow import FollowStream
from cloudshards.cache.lock import is_locked
from cloudshards.errors import ShardOpenError
from cloudshards.process import PerProcess


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``slowfile://`` registered, its knobs cleared; returns the open log."""
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    log = tmp_path / "opens.log"
    monkeypatch.setenv(fakes.OPEN_LOG_ENV, str(log))
    return log


def fetches(log: Path) -> dict[str, int]:
    return dict(fakes.opens(log))


def files_in(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def held_locks(cache_dir: Path) -> list[str]:
    return [
        name for name in files_in(cache_dir / "locks") if is_locked(str(cache_dir / "locks" / name))
    ]


def at_checkpoints(monkeypatch: pytest.MonkeyPatch, action: Callable[[str], None]) -> None:
    """Run ``action(point)`` at every checkpoint of the cache from now on (not re-entered:
    what ``action`` does through the cache passes its checkpoints by)."""
    busy = False

    def checkpoint(point: str) -> None:
        nonlocal busy
        if busy:
            return
        busy = True
        try:
            action(point)
        finally:
            busy = False

    monkeypatch.setattr(_cachelock, "_checkpoint", checkpoint)


# --- verified, then atomic: a download shorter than the store said -------------------------


class ShortFile(fakes.SlowFile):
    """A body that ends cleanly ``missing`` bytes before the size the store reports."""

    def __init__(self, path: str, missing: int) -> None:
        super().__init__(path)
        self._end = os.path.getsize(path) - missing

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self._end - self.tell())]
        return super().readinto(view) if view else 0


class ShortStore(fakes.SlowFileSystem):
    """``shortfile:///abs/path``: ``info()`` reports the file's size, but a download ends (with
    no error) ``missing_bytes`` early, as a proxy that closes the connection cleanly would."""

    protocol = "shortfile"
    missing_bytes: ClassVar[int] = 0

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> ShortFile:
        super()._open(path, mode, **kwargs).close()  # delays, the open log
        return ShortFile(self._strip_protocol(path), self.missing_bytes)


@pytest.fixture
def short_store(store: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[ShortStore]]:
    monkeypatch.setitem(fsspec_registry, "shortfile", ShortStore)
    monkeypatch.setattr(cloudshards.urls, "_fs_cache", PerProcess(dict))
    monkeypatch.setattr(ShortStore, "missing_bytes", 0)
    yield ShortStore
    ShortStore.clear_instance_cache()


@pytest.mark.parametrize("reader", ["reads to the end", "closes early"])
def test_a_download_shorter_than_the_store_said_is_never_committed(
    make_shards: Any, short_store: type[ShortStore], store: Path, tmp_path: Path, reader: str
) -> None:
    """The length is checked before the rename: a store that reports N bytes and ends early
    fails the read (or, when the reader closes early and the cache completes the rest, is
    simply not cached), and the next open downloads again instead of serving a short hit."""
    shards = make_shards([4], payload_bytes=20_000)
    path = shards.paths[0]
    url = f"shortfile://{path}"
    cache_dir = tmp_path / "cache"
    cache = ShardCache(cache_dir)
    short_store.missing_bytes = 3000
    with cache.open(url) as stream:
        if reader == "reads to the end":
            with pytest.raises(ShardOpenError, match="incomplete download"):
                fakes.read_all(stream)
        else:
            assert stream.read(1000) == path.read_bytes()[:1000]
    assert files_in(cache_dir / "data") == []  # neither an entry nor a partial file
    assert files_in(cache_dir / "meta") == []
    assert held_locks(cache_dir) == []
    assert (cache.stats.misses, cache.stats.hits) == (0, 0)

    short_store.missing_bytes = 0  # the store serves the whole object again
    for _ in range(2):  # downloaded again, then a hit of the whole shard
        with cache.open(url) as stream:
            assert fakes.read_all(stream) == path.read_bytes()
    assert fetches(store) == {str(path): 2}
    assert (cache.stats.misses, cache.stats.hits) == (1, 1)
    assert files_in(cache_dir / "data") == [entry_name(url)]


# --- ordering rules of the commit path -----------------------------------------------------


def test_the_download_lock_is_held_until_the_entry_is_in_place(
    make_shards: Any, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rename, then unlock: whoever finds the lock free finds the entry. At each point of the
    commit another process opening the shard follows the download or hits the entry; it
    never takes the lock while the entry is missing (it would download again, truncating
    the partial file the commit is about to rename)."""
    shards = make_shards([3], payload_bytes=20_000)
    path = shards.paths[0]
    url = fakes.url_of(path)
    cache_dir = tmp_path / "cache"
    name = entry_name(url)
    lock, entry = cache_dir / "locks" / f"{name}.lock", cache_dir / "data" / name
    other = ShardCache(cache_dir)  # another process on the node
    seen: list[tuple[str, bool, bool, str]] = []

    def look(point: str) -> None:
        if point in ("before_rename", "after_rename", "after_unlock"):
            locked, in_place = is_locked(str(lock)), entry.exists()
            with other.open(url, wait_s=5) as stream:
                seen.append((point, locked, in_place, type(stream).__name__))

    downloader = ShardCache(cache_dir)
    with downloader.open(url) as stream:
        at_checkpoints(monkeypatch, look)
        assert fakes.read_all(stream) == path.read_bytes()
    assert seen == [
        ("before_rename", True, False, "FollowStream"),
        ("after_rename", True, True, "_CachedFile"),
        ("after_unlock", False, True, "_CachedFile"),
    ]
    assert fetches(store) == {str(path): 1}
    assert entry.read_bytes() == path.read_bytes()


def test_a_follower_reads_the_bytes_written_just_before_the_commit(
    make_shards: Any, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower that caught up with the partial file checks for the commit next; when the
    downloader wrote the rest and committed in between, one more read is due (the file it
    holds is the entry now), or the follower would lose the tail of the shard."""
    shards = make_shards([3], payload_bytes=50_000)
    path = shards.paths[0]
    url = fakes.url_of(path)
    cache_dir = tmp_path / "cache"
    downloader = ShardCache(cache_dir).open(url)
    head = downloader.read(10_000)
    follower = ShardCache(cache_dir).open(url, wait_s=5)
    assert isinstance(follower, FollowStream)
    rest: list[bytes] = []

    def finish_download(point: str) -> None:
        if point == "follower_caught_up" and not rest:
            rest.append(fakes.read_all(downloader))  # writes, verifies, renames, unlocks

    at_checkpoints(monkeypatch, finish_download)
    with follower, downloader:
        assert fakes.read_all(follower) == path.read_bytes()
    assert head + rest[0] == path.read_bytes()
    assert len(head) < len(path.read_bytes()) // 10  # the follower caught up early on
    assert fetches(store) == {str(path): 1}


def test_a_process_that_gets_the_lock_rechecks_for_a_finished_entry(
    make_shards: Any, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between finding no entry and taking the lock, the downloader may commit and unlock:
    the process that then gets the lock must see the entry and read it, not download the
    shard again."""
    shards = make_shards([3], payload_bytes=20_000)
    path = shards.paths[0]
    url = fakes.url_of(path)
    cache_dir = tmp_path / "cache"
    downloader = ShardCache(cache_dir).open(url)
    late = ShardCache(cache_dir)  # another process on the node
    finished: list[bytes] = []

    def finish_download(point: str) -> None:
        if point == "before_claim" and not finished:
            finished.append(fakes.read_all(downloader))
            downloader.close()

    at_checkpoints(monkeypatch, finish_download)
    with late.open(url, wait_s=5) as stream:
        assert type(stream).__name__ == "_CachedFile"
        assert fakes.read_all(stream) == path.read_bytes()
    assert finished == [path.read_bytes()]
    assert fetches(store) == {str(path): 1}
    # Both ShardCaches count in this process's counters: one download, one hit.
    assert (late.stats.misses, late.stats.hits) == (1, 1)
    assert held_locks(cache_dir) == []
