"""A download ahead hands its own process's reader the blocks it reaches from memory (not read
back from the partial file), within a byte bound; the rest comes from the file, and the entry
and every byte read are the same either way."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import fakes
import pytest

import cloudshards as wds
from cloudshards.cache.follow import FollowStream
from cloudshards.cache.handoff import Handoff
from cloudshards.cache.tee import TeeStream
from cloudshards.source import OpenOptions


def test_blocks_are_taken_in_order_and_dropped_once_passed() -> None:
    handoff = Handoff(keep_bytes=10)
    handoff.publish(b"abcd")
    handoff.publish(b"efgh")
    assert handoff.take(0, 100) == b"abcd"
    assert bytes(handoff.take(1, 2) or b"") == b"bc"  # a piece of a block is a view of it
    handoff.publish(b"ijkl")  # 4 + 4 + 4 > 10: not held (the reader reads it from the file)
    assert handoff.take(6, 4) == memoryview(b"efgh")[2:]  # passing a block drops those before
    assert handoff.take(0, 4) is None
    assert handoff.take(8, 4) is None
    assert handoff.take(12, 4) is None  # not published yet
    handoff.publish(b"mn")  # room again: held
    assert handoff.take(12, 2) == b"mn"


def test_the_held_bytes_never_exceed_the_bound() -> None:
    handoff = Handoff(keep_bytes=1000)
    for _ in range(50):
        handoff.publish(bytes(300))
        assert handoff._held <= 1000
    assert handoff.take(0, 300) == bytes(300)
    assert handoff.take(900, 300) is None  # the fourth block was never held


def test_wait_returns_when_a_block_arrives_or_the_download_ends() -> None:
    handoff = Handoff(keep_bytes=100)
    threading.Timer(0.05, handoff.publish, args=(b"x",)).start()
    start = time.monotonic()
    handoff.wait(0, 10)
    assert time.monotonic() - start < 5
    threading.Timer(0.05, handoff.finish).start()
    start = time.monotonic()
    handoff.wait(1, 10)
    assert time.monotonic() - start < 5


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)


def _cache_with_one_entry(tmp_path: Path, url: str) -> wds.ShardCache:
    cache = wds.ShardCache(tmp_path / "cache")
    with cache.open(url) as stream:  # downloads ahead start once this process cached one
        while stream.read(1 << 20):
            pass
    return cache


@pytest.mark.parametrize("keep_kib", [0, 96, 4096], ids=["none-held", "some-held", "all-held"])
def test_the_own_reader_takes_held_blocks_and_reads_the_rest_from_the_file(
    make_shards: Any,
    store: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    keep_kib: int,
) -> None:
    shards = make_shards([3, 20], payload_bytes=20_000)
    urls = [fakes.url_of(p) for p in shards.paths]
    cache = _cache_with_one_entry(tmp_path, urls[0])
    monkeypatch.setenv(fakes.CHUNK_ENV, str(32 << 10))  # many blocks per shard
    # A slow store: the download ahead is still running when the reader opens the shard.
    monkeypatch.setenv(fakes.DELAY_ENV, "0.02")
    preads: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, size: int, offset: int) -> bytes:
        data = real_pread(fd, size, offset)
        preads.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", counting_pread)
    thread = cache.download_ahead(urls[1], OpenOptions(), keep_bytes=keep_kib << 10)
    assert thread is not None
    stream = cache.open(urls[1])
    try:
        assert isinstance(stream, FollowStream)
        thread.join(30)  # read once the download is done: what was kept is still held
        assert not thread.is_alive()
        got = []
        while block := stream.read_view(1 << 20):
            got.append(bytes(block))
    finally:
        stream.close()
    expected = shards.paths[1].read_bytes()
    assert b"".join(got) == expected
    size = len(expected)
    from_file = sum(preads)
    if keep_kib == 0:
        assert from_file == size
    elif keep_kib == 96:
        assert 0 < from_file < size  # what was held came from memory, the rest from the file
    else:
        assert from_file == 0
    data = tmp_path / "cache" / "data"
    entries = {name: (data / name).read_bytes() for name in os.listdir(data)}
    assert sorted(entries.values()) == sorted(p.read_bytes() for p in shards.paths)
    assert (cache.stats.misses, cache.stats.hits, cache.stats.waits) == (2, 0, 0)


def test_the_own_reader_hands_its_table_to_the_download_which_saves_it_as_it_commits(
    make_shards: Any, store: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader parses a shard to its end-of-archive marker before the download ahead has
    committed the entry (padding, verification, rename). A commit later than the reader waits
    for must still save the reader's table, for the next epoch."""
    from cloudshards.cache import lock as cachelock
    from cloudshards.cache.membertable import load_table

    shards = make_shards([3, 5])
    urls = [fakes.url_of(p) for p in shards.paths]
    cache = _cache_with_one_entry(tmp_path, urls[0])
    monkeypatch.setattr(FollowStream, "COMMIT_WAIT_S", 0.2)  # the reader stops waiting
    release = threading.Event()

    def held_commit(point: str) -> None:
        if point == "before_rename" and threading.current_thread() is not threading.main_thread():
            release.wait(30)

    monkeypatch.setattr(cachelock, "_checkpoint", held_commit)
    thread = cache.download_ahead(urls[1], OpenOptions(), keep_bytes=1 << 20)
    assert thread is not None
    size = shards.paths[1].stat().st_size
    table = fakes.member_table(("k.cls", 512, 1), ("k.txt", 1536, 5))
    stream = cache.open(urls[1])
    try:
        assert isinstance(stream, FollowStream)
        fakes.read_exactly(stream, size)
        stream.save_member_table(table)
        assert thread.is_alive()  # the commit is still held: the table goes with it
    finally:
        release.set()
        thread.join(30)
        stream.close()
    (saved,) = (tmp_path / "cache" / "meta").glob("*-000001.tar.members.json")
    loaded = load_table(str(saved), size)
    assert loaded is not None
    assert loaded.names == ["k.cls", "k.txt"]


def own_download(cache: Any, url: str, cancel: threading.Event) -> FollowStream:
    """A reader of its own download of ``url`` (run in the background, as a dataset's is)."""
    reader = cache.open_entry(
        url,
        OpenOptions(),
        shard_index=0,
        wait_s=10,
        open_store=None,
        cancel=cancel,
        keep_bytes=1 << 20,
    )
    assert isinstance(reader, FollowStream)
    return reader


def parsed(stream: Any) -> Any:
    """The complete member table of the shard ``stream`` reads, parsed to its end."""
    from cloudshards.cache.membertable import MemberTable
    from cloudshards.tar.members import iter_members

    table = MemberTable()
    for _ in iter_members(stream, url=getattr(stream, "url", None), record=table):
        pass
    assert table.complete
    return table


@pytest.mark.parametrize("reader_kind", ["own download", "consumer-driven"])
def test_a_reader_never_saves_its_table_beside_an_entry_replaced_since(
    store: None, tmp_path: Path, reader_kind: str
) -> None:
    """The reader's download commits as soon as it has the shard, maybe long before the
    reader parses the last sample. If the entry is evicted meanwhile and another process
    caches a new version of the object of the same size, the reader's table describes the
    old file: saved beside the new one, warm epochs would slice it at the old offsets. The
    same holds whether the download runs in the background (a loader's) or is the reader's
    own stream (``ShardCache.open`` without a cancel event)."""
    import shutil
    import tarfile

    from conftest import write_tar

    old, new = tmp_path / "v1.tar", tmp_path / "v2.tar"
    write_tar(old, [("s0", {"txt": b"A" * 1000, "cls": b"1"})], tarfile.USTAR_FORMAT)
    write_tar(new, [("s0", {"txt": b"B" * 10, "cls": b"2" * 1000})], tarfile.USTAR_FORMAT)
    assert old.stat().st_size == new.stat().st_size
    obj = tmp_path / "shard.tar"
    shutil.copy(old, obj)
    url = fakes.url_of(obj)

    cache = wds.ShardCache(tmp_path / "cache")
    cancel = threading.Event()
    if reader_kind == "own download":
        reader = own_download(cache, url, cancel)
        stale = parsed(reader)
        cache.join_downloads(cancel, 30)  # the entry is in place, the reader not done with it
    else:
        reader = cache.open(url)
        assert isinstance(reader, TeeStream)
        stale = parsed(reader)
        fakes.read_all(reader)  # the padding after the end-of-archive marker: committed
        assert reader.committed
    (entry,) = (tmp_path / "cache" / "data").iterdir()
    cache._remove_entry(entry.name)  # evicted (another process's budget, `cache clear`)
    shutil.copy(new, obj)  # the object replaced, and cached by another process
    other = wds.ShardCache(tmp_path / "cache").open(url)
    other.save_member_table(parsed(other))
    other.close()
    reader.save_member_table(stale)  # the first reader's last sample is done only now
    reader.close()
    with wds.ShardCache(tmp_path / "cache").open(url) as hit:
        table = hit.member_table()
    assert table is not None
    assert list(table.rows()) == [("s0.txt", 512, 10), ("s0.cls", 1536, 1000)]


def test_under_a_budget_for_one_shard_each_shard_read_through_its_own_download_is_cached(
    make_shards: Any, store: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader done with its shard before its download committed it moves on only once the
    entry is in place: the next shard's room is that entry's, evicted then. Moving on at once
    found the budget held by an entry still being committed, and streamed the next shard
    uncached."""
    import time

    from cloudshards.cache import lock as cachelock

    shards = make_shards([10, 10], payload_bytes=20_000)
    size = max(path.stat().st_size for path in shards.paths)

    def slow_commit(point: str) -> None:
        if point == "before_rename" and threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)

    monkeypatch.setattr(cachelock, "_checkpoint", slow_commit)
    cache = wds.ShardCache(tmp_path / "cache", max_bytes=size * 3 // 2)
    cancel = threading.Event()
    for path in shards.paths:
        reader = own_download(cache, fakes.url_of(path), cancel)
        reader.save_member_table(parsed(reader))
        reader.close()  # and the next shard opens at once
    cache.join_downloads(cancel, 30)
    assert (cache.stats.misses, cache.stats.uncached, cache.stats.evictions) == (2, 0, 1)
