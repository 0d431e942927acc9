"""Node cache behaviour that no other test pinned down, found by the mutation check
(``integration/mutation.py``, area ``cache``): a take-over after someone else claimed the
download, locks released when the store fails, the reservation record, commit failures and
stale tables, least-recently-used order and descriptors of entries that are not used.

Shards are served by the ``slowfile://`` fake store (tests/fakes.py)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import fakes
import pytest

import cloudshards as wds
from cloudshards.cache import ShardCache
from cloudshards.cache.follow import FollowStream
from cloudshards.cache.keys import entry_name
from cloudshards.cache.lock import DownloadLock, is_locked


@pytest.fixture(autouse=True)
def slowfile(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)


def shard(make_shards: Any, sizes: list[int] | None = None) -> tuple[list[str], list[bytes]]:
    shards = make_shards(sizes or [3])
    return [fakes.url_of(p) for p in shards.paths], [p.read_bytes() for p in shards.paths]


def lock_path(cache: ShardCache, url: str) -> str:
    return cache._path("locks", entry_name(url) + ".lock")


def follow_a_dead_download(cache: ShardCache, url: str, content: bytes) -> tuple[Any, bytes]:
    """A partial file whose downloader held the lock, wrote 1000 bytes and died: a reader
    follows it, reads those bytes, and is about to take the download over."""
    cache._ensure_ready()
    lock = DownloadLock(lock_path(cache, url))
    assert lock.try_acquire()
    Path(cache._path("data", entry_name(url) + ".partial")).write_bytes(content[:1000])
    stream = cache.open(url)
    assert isinstance(stream, FollowStream)
    first = stream.read(1000)
    assert first == content[:1000]
    lock.release()  # the downloader dies
    return stream, first


def test_a_take_over_that_another_reader_won_skips_what_was_read(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (url,), (content,) = shard(make_shards)
    cache = ShardCache(tmp_path / "cache")
    stream, first = follow_a_dead_download(cache, url, content)
    monkeypatch.setattr(cache, "_claim", lambda name: None)  # someone else claimed it first
    try:
        assert first + fakes.read_all(stream) == content  # from the store, past what was read
    finally:
        stream.close()


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EACCES])
def test_a_take_over_on_a_disk_that_fails(
    make_shards: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: int,
) -> None:
    (url,), (content,) = shard(make_shards)
    cache = ShardCache(tmp_path / "cache")
    stream, first = follow_a_dead_download(cache, url, content)

    def claim(name: str) -> None:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(cache, "_claim", claim)
    try:
        if error == errno.ENOSPC:  # full: the rest comes from the store, with a warning
            with caplog.at_level(logging.WARNING):
                assert first + fakes.read_all(stream) == content
            assert "cache disk full" in caplog.text
        else:  # anything else is not the disk's state: it is raised
            with pytest.raises(OSError, match=os.strerror(error)):
                fakes.read_all(stream)
    finally:
        stream.close()


def test_a_store_that_fails_to_open_leaves_the_lock_free(make_shards: Any, tmp_path: Path) -> None:
    (url,), (content,) = shard(make_shards)
    cache = ShardCache(tmp_path / "cache")

    def store_down() -> Any:
        raise ConnectionResetError(errno.ECONNRESET, "store down")

    with pytest.raises(ConnectionResetError, match="store down"):
        cache.open(url, open_store=store_down)
    assert not is_locked(lock_path(cache, url))
    stream = cache.open(url)  # the next reader downloads it
    try:
        assert fakes.read_all(stream) == content
    finally:
        stream.close()


def test_the_lock_file_records_the_size_being_downloaded(make_shards: Any, tmp_path: Path) -> None:
    (url,), (content,) = shard(make_shards)
    cache = ShardCache(tmp_path / "cache", max_bytes=10 * len(content))
    cache._ensure_ready()
    Path(lock_path(cache, url)).write_bytes(b"9" * 20)  # left by an earlier, larger download
    stream = cache.open(url)
    try:
        # Other downloaders read it to count this download against the budget.
        assert Path(lock_path(cache, url)).read_bytes() == str(len(content)).encode()
        assert fakes.read_all(stream) == content
    finally:
        stream.close()


def test_a_failed_commit_leaves_no_metadata_or_table(
    make_shards: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shards = make_shards([3])
    url = fakes.url_of(shards.paths[0])
    cache_dir = tmp_path / "cache"
    real_replace = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if str(src).endswith(".partial"):
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
    with caplog.at_level(logging.WARNING):
        assert [s["__key__"] for s in ds] == shards.keys  # parsed whole: a table was made
    assert "cannot commit" in caplog.text
    assert sorted(os.listdir(cache_dir / "meta")) == []
    assert sorted(os.listdir(cache_dir / "data")) == []
    assert not is_locked(lock_path(ShardCache(cache_dir), url))


def test_a_new_entry_without_a_table_removes_an_older_table(
    make_shards: Any, tmp_path: Path
) -> None:
    (url,), (content,) = shard(make_shards)
    cache = ShardCache(tmp_path / "cache")
    cache._ensure_ready()
    table = Path(cache._table_path(entry_name(url)))
    table.write_text("{}")  # an older entry's table, for other bytes
    stream = cache.open(url)
    try:
        assert fakes.read_all(stream) == content  # read as bytes: no parse, no table
    finally:
        stream.close()
    assert os.path.exists(cache._path("data", entry_name(url)))
    assert not table.exists()


def test_a_hit_makes_an_entry_the_most_recently_used(make_shards: Any, tmp_path: Path) -> None:
    urls, contents = shard(make_shards, [3, 3, 3])
    assert len(set(map(len, contents))) == 1
    cache = ShardCache(tmp_path / "cache", max_bytes=2 * len(contents[0]))

    def read(url: str) -> None:
        stream = cache.open(url)
        try:
            fakes.read_all(stream)
        finally:
            stream.close()

    read(urls[0])
    read(urls[1])
    read(urls[0])  # a hit: now the most recently used
    read(urls[2])  # room for it: the least recently used goes
    present = [os.path.exists(cache._path("data", entry_name(u))) for u in urls]
    assert present == [True, False, True]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_corrupt_entry_leaves_no_descriptor_open(make_shards: Any, tmp_path: Path) -> None:
    (url,), (content,) = shard(make_shards)
    cache = ShardCache(tmp_path / "cache")
    stream = cache.open(url)
    fakes.read_all(stream)
    stream.close()
    entry = Path(cache._path("data", entry_name(url)))
    entry.write_bytes(content[:-512])  # truncated: its size no longer matches its metadata
    before = len(os.listdir("/proc/self/fd"))
    assert cache._open_hit(entry_name(url), url, None) is None
    assert len(os.listdir("/proc/self/fd")) == before
    assert not entry.exists()  # removed, to be fetched again


def test_an_entry_evicted_while_it_was_opened_is_a_miss(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (url,), _ = shard(make_shards)
    cache = ShardCache(tmp_path / "cache")
    stream = cache.open(url)
    fakes.read_all(stream)
    stream.close()
    entry = cache._path("data", entry_name(url))
    real_stat = os.stat

    def evicted_after_the_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) == entry:  # gone by the time the shared lock is held
            raise FileNotFoundError(errno.ENOENT, "evicted", entry)
        return real_stat(path, *args, **kwargs)

    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    monkeypatch.setattr(os, "stat", evicted_after_the_open)
    assert cache._open_hit(entry_name(url), url, None) is None
    monkeypatch.undo()
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds  # its descriptor was closed


def test_a_take_over_with_the_budget_full_streams_past_what_was_read(
    make_shards: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    urls, contents = shard(make_shards, [3, 3])
    assert len(contents[0]) == len(contents[1])
    cache_dir = tmp_path / "cache"
    cache = ShardCache(cache_dir, max_bytes=len(contents[0]))
    in_use = cache.open(urls[0])
    fakes.read_all(in_use)
    in_use.close()
    assert os.path.exists(cache._path("data", entry_name(urls[0])))  # exactly the budget: kept
    in_use = cache.open(urls[0])  # a hit held open: it cannot be evicted
    try:
        stream, first = follow_a_dead_download(cache, urls[1], contents[1])
        try:
            with caplog.at_level(logging.WARNING):
                assert first + fakes.read_all(stream) == contents[1]
            assert "budget full of entries in use" in caplog.text
            # Counted and saved at once (no close of a cache file will save it later).
            assert wds.cache_info(cache_dir)["counters"]["uncached"] == 1
        finally:
            stream.close()
    finally:
        in_use.close()


def test_a_verified_download_saves_the_table_of_a_parse_that_ends_after_the_commit(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an MD5 to verify, the entry commits as soon as the store's last byte is in, before
    the reader has parsed the held-back end: its table is saved after the commit."""
    import hashlib

    from cloudshards.cache import shardcache as cache_module
    from cloudshards.cache.facts import Checksum

    shards = make_shards([3])
    url = fakes.url_of(shards.paths[0])
    content = shards.paths[0].read_bytes()
    md5 = Checksum("md5", hashlib.md5(content, usedforsecurity=False).hexdigest())
    monkeypatch.setattr(cache_module, "remote_facts", lambda *args: (len(content), md5))
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
    assert [s["__key__"] for s in ds] == shards.keys
    assert os.path.exists(ShardCache(cache_dir)._table_path(entry_name(url)))


def test_a_shard_of_unknown_size_is_streamed_under_a_budget(
    make_shards: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from cloudshards.cache import shardcache as cache_module

    (url,), (content,) = shard(make_shards)
    monkeypatch.setattr(cache_module, "remote_facts", lambda *args: (None, None))
    cache = ShardCache(tmp_path / "cache", max_bytes=10 * len(content))
    with caplog.at_level(logging.WARNING):
        stream = cache.open(url)
        try:
            assert fakes.read_all(stream) == content
        finally:
            stream.close()
    assert "size is unknown" in caplog.text
    assert os.listdir(cache._path("data")) == []


def test_downloads_in_flight_count_against_the_budget(
    make_shards: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    urls, contents = shard(make_shards, [3, 3])
    size = len(contents[1])
    cache = ShardCache(tmp_path / "cache", max_bytes=size + 1000 + size - 1)
    cache._ensure_ready()
    # Another process downloads shard 0: it holds the lock and reserved 1000 + size bytes.
    other = DownloadLock(lock_path(cache, urls[0]))
    assert other.try_acquire()
    try:
        os.pwrite(other.fd, str(1000 + size).encode(), 0)
        Path(cache._path("data", entry_name(urls[0]) + ".partial")).write_bytes(b"x" * 10)
        with caplog.at_level(logging.WARNING):
            stream = cache.open(urls[1])
            try:
                assert fakes.read_all(stream) == contents[1]
            finally:
                stream.close()
    finally:
        other.release()
    assert "budget full" in caplog.text
    assert not os.path.exists(cache._path("data", entry_name(urls[1])))  # streamed, not cached
