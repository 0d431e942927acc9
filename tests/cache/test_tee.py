"""The downloader's stream (:class:`TeeStream`) on its own: what its consumer is served, what is
written and committed, and when. A real partial file on disk; the store is an in-memory stream
whose reads are counted, so "how much was fetched" is observable.

The pipeline-level behaviour (hits, followers, a full disk, checksums of real stores) is in
test_cache.py, test_cache_safety.py and the integration tests; these pin the stream's own
promises, which the mutation check (``integration/mutation.py``, area ``cache``) showed no
other test held down: the byte counts, checksums without a size, the
held-back end of a large object, bounded reads from a store that sends too much, and close().
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import fakes
import google_crc32c
import pytest

from cloudshards.cache.facts import Checksum
from cloudshards.cache.stats import CacheStats
from cloudshards.cache.tee import TeeStream
from cloudshards.errors import CacheError, ShardOpenError

DATA = bytes(range(256)) * 40  # 10,240 bytes
#: Reads of 700 bytes, so that they never line up with the 1,000-byte parts written or served.
read_all = partial(fakes.read_all, size=700)
read_exactly = partial(fakes.read_exactly, size=700)
URL = "gs://bucket/shard-000.tar"


class Store:
    """An object in a store, read as one stream: at most ``chunk`` bytes per read; ``flip``
    is an offset served with its bits inverted; ``extra`` bytes follow the object (a store
    that sends more than it said)."""

    def __init__(
        self, data: bytes = DATA, *, chunk: int = 1000, flip: int | None = None, extra: int = 0
    ) -> None:
        body = bytearray(data + bytes(extra))
        if flip is not None:
            body[flip] ^= 0xFF
        self.data = bytes(body)
        self.chunk = chunk
        self.url = URL
        self.pos = 0
        self.closed = False

    def read(self, size: int = -1) -> bytes:
        count = self.chunk if size < 0 else min(size, self.chunk)
        out = self.data[self.pos : self.pos + count]
        self.pos += len(out)
        return out

    def close(self) -> None:
        self.closed = True


@dataclass
class Entry:
    """The callbacks a TeeStream gets from the cache, recording what it was told."""

    directory: Path
    commits: list[int] = field(default_factory=list)
    abandoned: int = 0
    closes: int = 0
    distrusted: int = 0
    refetches: list[Store] = field(default_factory=list)

    @property
    def partial(self) -> Path:
        return self.directory / "entry.partial"

    @property
    def final(self) -> Path:
        return self.directory / "entry"

    def commit(self, nbytes: int) -> bool:
        self.commits.append(nbytes)
        os.replace(self.partial, self.final)
        return True

    def abandon(self) -> None:
        self.abandoned += 1
        self.partial.unlink(missing_ok=True)

    def on_close(self) -> None:
        self.closes += 1

    def distrust(self) -> None:
        self.distrusted += 1


def tee(
    entry: Entry,
    store: Store,
    *,
    size: int | None = len(DATA),
    checksum: Checksum | None = None,
    refetch: Callable[[], Store] | None = None,
) -> TeeStream:
    def counted_refetch() -> Any:
        assert refetch is not None
        again = refetch()
        entry.refetches.append(again)
        return again

    return TeeStream(
        store,  # type: ignore[arg-type]
        str(entry.partial),
        commit=entry.commit,
        abandon=entry.abandon,
        on_close=entry.on_close,
        stats=CacheStats(),
        expected_size=size,
        checksum=checksum,
        refetch=counted_refetch if refetch is not None else None,
        distrust=entry.distrust,
    )


@pytest.fixture(params=["md5", "crc32c"])
def sum_of(request: pytest.FixtureRequest) -> Callable[[bytes], Checksum]:
    """The store's checksum of some bytes: an MD5 (S3 ETags, GCS md5Hash) or a CRC32C (GCS)."""

    def checksum(data: bytes) -> Checksum:
        if request.param == "md5":
            return Checksum("md5", hashlib.md5(data).hexdigest())
        return Checksum("crc32c", google_crc32c.value(data).to_bytes(4, "big").hex())

    return checksum


@pytest.fixture
def entry(tmp_path: Path) -> Entry:
    return Entry(tmp_path)


@pytest.fixture
def small_hold(monkeypatch: pytest.MonkeyPatch) -> int:
    """Hold back only the last 2,000 bytes of a verified download (the object is 10,240)."""
    monkeypatch.setattr(TeeStream, "HOLD_BYTES", 2000)
    return 2000


# --- serving and committing --------------------------------------------------------------


def test_a_checksum_without_a_size_is_still_verified(
    entry: Entry, sum_of: Callable[[bytes], Checksum]
) -> None:
    stream = tee(entry, Store(), size=None, checksum=sum_of(DATA))
    assert read_all(stream) == DATA
    stream.close()
    assert entry.commits == [len(DATA)]


def test_a_wrong_checksum_without_a_size_fails_the_shard(
    entry: Entry, sum_of: Callable[[bytes], Checksum]
) -> None:
    stream = tee(entry, Store(flip=5), size=None, checksum=sum_of(DATA), refetch=Store)
    with pytest.raises(ShardOpenError, match="checksum"):
        read_all(stream)
    stream.close()
    assert entry.commits == []
    assert entry.abandoned == 1
    assert not entry.partial.exists()


def test_the_error_is_raised_again_on_every_later_read(
    entry: Entry, sum_of: Callable[[bytes], Checksum]
) -> None:
    stream = tee(entry, Store(extra=10), checksum=sum_of(DATA))
    with pytest.raises(ShardOpenError) as first:
        read_all(stream)
    with pytest.raises(ShardOpenError) as again:
        stream.read(100)
    assert again.value is first.value
    stream.close()
    assert entry.commits == []


def test_a_store_that_sends_more_than_it_said_is_stopped_at_once(
    entry: Entry, small_hold: int, sum_of: Callable[[bytes], Checksum]
) -> None:
    """Held-back bytes are kept in memory: a store that goes on sending must fail the read
    that passes the size it reported, not fill memory until it stops."""
    store = Store(extra=50 * len(DATA))
    stream = tee(entry, store, checksum=sum_of(DATA))
    with pytest.raises(ShardOpenError, match="more than"):
        read_all(stream)
    assert store.pos <= len(DATA) + store.chunk
    stream.close()
    assert entry.commits == []


def test_a_small_verified_object_is_served_only_once_all_of_it_is_in(
    entry: Entry, sum_of: Callable[[bytes], Checksum]
) -> None:
    """Smaller than the held-back end: not one byte is served before the checksum matched."""
    store = Store()
    stream = tee(entry, store, checksum=sum_of(DATA))
    first = stream.read(100)
    assert first == DATA[:100]
    assert store.pos == len(DATA)
    assert entry.commits == [len(DATA)]  # verified and committed before serving
    assert read_all(stream) == DATA[100:]


@pytest.mark.parametrize("hold", ["all of it", "its end"])
@pytest.mark.parametrize("fail_at", [len(DATA) - 1240, len(DATA) - 500])
def test_a_store_that_fails_in_a_verified_download_serves_the_bytes_before_but_its_end(
    entry: Entry,
    hold: str,
    fail_at: int,
    sum_of: Callable[[bytes], Checksum],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bytes held back for verification are the store's up to the failure: served, then
    the error, as a reader without a cache gets them (a GCS shard under 1 MiB, all of it held
    back, gave not one sample through the cache, 19 of 20 without it). Never the object's
    last END_BYTES: a reader given the end-of-archive blocks would end the shard on bytes
    never verified, without the error."""
    if hold == "its end":
        monkeypatch.setattr(TeeStream, "HOLD_BYTES", 2000)
    monkeypatch.setattr(TeeStream, "END_BYTES", 1024)
    store = FailingStore(fail_at=fail_at)
    stream = tee(entry, store, checksum=sum_of(DATA))
    got = bytearray()

    def read_to_the_error() -> None:
        while chunk := stream.read(700):
            got.extend(chunk)

    with pytest.raises(ShardOpenError, match="reset"):
        read_to_the_error()
    assert store.pos >= store.fail_at
    assert got == DATA[: min(store.pos, len(DATA) - 1024)]
    stream.close()
    assert entry.commits == []
    assert not entry.partial.exists()


def test_a_corrupted_end_of_a_large_object_is_fetched_again(
    entry: Entry,
    small_hold: int,
    caplog: pytest.LogCaptureFixture,
    sum_of: Callable[[bytes], Checksum],
) -> None:
    """Only held-back bytes were wrong: a second download that matches the checksum and
    agrees with every byte already served provides the end."""
    stream = tee(entry, Store(flip=len(DATA) - 10), checksum=sum_of(DATA), refetch=Store)
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        assert read_all(stream) == DATA
    stream.close()
    assert entry.commits == [len(DATA)]
    assert entry.final.read_bytes() == DATA
    (again,) = entry.refetches
    assert again.closed
    assert stream.stats.bytes_network == 2 * len(DATA)
    assert any("second download matched" in r.getMessage() for r in caplog.records)


def test_a_corrupted_byte_already_served_fails_the_shard(
    entry: Entry, small_hold: int, sum_of: Callable[[bytes], Checksum]
) -> None:
    stream = tee(entry, Store(flip=100), checksum=sum_of(DATA), refetch=Store)
    with pytest.raises(ShardOpenError, match="differs in bytes already read"):
        read_all(stream)
    stream.close()
    assert entry.commits == []
    assert not entry.partial.exists()


def test_a_second_download_longer_than_the_object_is_cut_short(
    entry: Entry, small_hold: int, sum_of: Callable[[bytes], Checksum]
) -> None:
    endless: list[Store] = []

    def refetch() -> Store:
        endless.append(Store(extra=100 * len(DATA)))
        return endless[-1]

    stream = tee(entry, Store(flip=len(DATA) - 10), checksum=sum_of(DATA), refetch=refetch)
    with pytest.raises(ShardOpenError, match="changed"):
        read_all(stream)
    assert endless[0].pos <= len(DATA) + endless[0].chunk
    assert endless[0].closed


def test_a_checksum_that_is_not_one_of_the_bytes_is_distrusted(
    entry: Entry, small_hold: int, sum_of: Callable[[bytes], Checksum]
) -> None:
    stream = tee(entry, Store(), checksum=sum_of(b"something else"), refetch=Store)
    assert read_all(stream) == DATA
    stream.close()
    assert entry.distrusted == 1
    assert entry.commits == []
    assert not entry.partial.exists()
    assert stream.stats.uncached == 1


# --- the disk -----------------------------------------------------------------------------


def swap_descriptor(stream: TeeStream, path: str, flags: int) -> None:
    """Make the partial file's descriptor point at ``path`` from now on."""
    fd = os.open(path, flags)
    try:
        assert stream._fd is not None
        os.dup2(fd, stream._fd)
    finally:
        os.close(fd)


def test_a_disk_that_fills_up_mid_download_still_serves_every_byte(
    entry: Entry,
    small_hold: int,
    caplog: pytest.LogCaptureFixture,
    sum_of: Callable[[bytes], Checksum],
) -> None:
    """ENOSPC in the middle of a verified download, with part of the end held back: the
    consumer gets every byte, held ones included, and no error; nothing is cached."""
    stream = tee(entry, Store(), checksum=sum_of(DATA), refetch=Store)
    got = stream.read(700)
    swap_descriptor(stream, "/dev/full", os.O_WRONLY)
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        got += read_all(stream)
        assert stream.partial_dropped
    assert got == DATA
    stream.close()
    assert not stream.partial_dropped
    assert entry.commits == []
    assert entry.abandoned == 1
    assert entry.refetches == []
    assert stream.stats.uncached == 1


def test_a_disk_that_fills_up_where_the_held_back_end_begins_still_serves_every_byte(
    entry: Entry, small_hold: int, sum_of: Callable[[bytes], Checksum]
) -> None:
    """The write that fails is the one of the chunk that reaches the held-back end: the bytes
    held from that chunk on are served with it, unverified, as the rest of the stream is."""
    hold_from = len(DATA) - small_hold
    stream = tee(entry, Store(), checksum=sum_of(DATA), refetch=Store)
    got = b""
    while len(got) < hold_from // 1000 * 1000:  # up to the chunk that crosses hold_from
        got += stream.read(1000)
    swap_descriptor(stream, "/dev/full", os.O_WRONLY)
    got += read_all(stream)
    assert got == DATA
    stream.close()
    assert entry.commits == []
    assert entry.refetches == []


def test_a_write_error_other_than_a_full_disk_names_the_partial_file(entry: Entry) -> None:
    stream = tee(entry, Store())
    stream.read(700)
    swap_descriptor(stream, os.devnull, os.O_RDONLY)  # writes fail with EBADF
    with pytest.raises(CacheError, match=str(entry.partial)):
        read_all(stream)
    assert entry.abandoned == 1
    assert not entry.partial.exists()
    stream.close()
    assert entry.abandoned == 1


def test_the_partial_file_is_readable_and_never_executable(entry: Entry) -> None:
    """The executable bit marks a download that failed verification (followers then fail):
    a fresh partial file must not have it, nor be writable by anyone but its owner."""
    umask = os.umask(0o022)
    try:
        stream = tee(entry, Store())
    finally:
        os.umask(umask)
    assert stat.S_IMODE(entry.partial.stat().st_mode) == 0o644
    stream.close()


def test_descriptors_are_closed_whatever_happens(
    entry: Entry, sum_of: Callable[[bytes], Checksum]
) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for make in (
        lambda: tee(entry, Store()),  # read to the end
        lambda: tee(entry, Store(extra=10), checksum=sum_of(DATA)),  # fails verification
    ):
        stream = make()
        with pytest.raises(ShardOpenError) if stream._checksum else _nothing():
            read_all(stream)
        stream.close()
    stream = tee(entry, Store())
    stream.read(10)
    stream.cancel()
    assert len(os.listdir("/proc/self/fd")) == before


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --- member tables --------------------------------------------------------------------------


def test_a_member_table_is_saved_only_once_the_entry_is_committed(entry: Entry) -> None:
    table = fakes.member_table()
    stream = tee(entry, Store())
    stream.table_path = str(entry.directory / "entry.members.json")
    stream.entry = str(entry.final)
    stream.read(100)
    stream.save_member_table(table)
    assert not Path(stream.table_path).exists()  # kept for the commit
    read_all(stream)
    assert entry.commits == [len(DATA)]
    assert Path(stream.table_path).exists()  # once the entry is in place (the test's commit
    Path(stream.table_path).unlink()  # does not save it with the entry, as the cache's does)
    stream.save_member_table(table)  # committed first: saved now
    assert Path(stream.table_path).exists()


def test_a_member_table_is_not_saved_beside_an_entry_replaced_since_its_commit(
    entry: Entry,
) -> None:
    """Between the commit and the reader's last sample the entry may be evicted and cached
    again by another process, from an object of the same size but other members: this
    reader's table would make warm epochs slice that file at the old offsets."""
    stream = tee(entry, Store())
    stream.table_path = str(entry.directory / "entry.members.json")
    stream.entry = str(entry.final)
    read_all(stream)
    assert entry.commits == [len(DATA)]
    assert not Path(stream.table_path).exists()  # none given before the commit
    replacement = entry.directory / "other"
    replacement.write_bytes(DATA[::-1])
    os.replace(replacement, entry.final)  # evicted and cached again: another file there
    stream.save_member_table(fakes.member_table())
    assert not Path(stream.table_path).exists()
    entry.final.unlink()  # evicted, not cached again: no table either
    stream.save_member_table(fakes.member_table())
    assert not Path(stream.table_path).exists()


def test_a_committed_stream_dropped_without_closing_holds_no_descriptor(entry: Entry) -> None:
    """The committed file is held open until the table is saved or the stream closes (so
    that its inode is not another file's); a stream the caller drops holds nothing."""
    import gc

    def held() -> int:
        """This process's descriptors open on the committed file (not a count of all, which
        the collector changes by closing what earlier tests dropped)."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}") == str(entry.final)
        return count

    stream = tee(entry, Store())
    stream.entry = str(entry.final)
    read_all(stream)
    assert entry.commits == [len(DATA)]
    assert held() == 1  # the committed file, held
    del stream
    gc.collect()
    assert held() == 0


# --- close and cancel -----------------------------------------------------------------------


def test_close_completes_a_remainder_of_up_to_the_drain_size(
    entry: Entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tar reader stops at the end-of-archive marker: closing with a small remainder left
    still downloads it and commits the entry, up to and including DRAIN_MAX_BYTES."""
    monkeypatch.setattr(TeeStream, "DRAIN_MAX_BYTES", 4000)
    stream = tee(entry, Store())
    assert read_exactly(stream, len(DATA) - 4000) == DATA[:-4000]
    stream.close()
    assert entry.commits == [len(DATA)]
    assert entry.final.read_bytes() == DATA


def test_close_gives_up_a_remainder_larger_than_the_drain_size(
    entry: Entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TeeStream, "DRAIN_MAX_BYTES", 4000)
    store = Store()
    stream = tee(entry, store)
    read_exactly(stream, len(DATA) - 4001)
    fetched = store.pos
    stream.close()
    stream.close()  # twice: counted and reported once
    assert store.pos == fetched  # nothing more was downloaded
    assert entry.commits == []
    assert not entry.partial.exists()
    assert store.closed
    assert stream.stats.uncached == 1
    assert entry.closes == 1


def test_close_of_an_object_of_unknown_size_downloads_at_most_the_drain_size(
    entry: Entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TeeStream, "DRAIN_MAX_BYTES", 4000)
    store = Store(DATA * 10)
    stream = tee(entry, store, size=None)
    stream.read(1000)
    stream.close()
    assert store.pos <= 1000 + 4000 + store.chunk
    assert entry.commits == []
    assert not entry.partial.exists()


class FailingStore(Store):
    """A store whose reads fail from ``fail_at`` on, as a stream does once its own retries
    are spent; each read after that is counted."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.failed_reads = 0

    def read(self, size: int = -1) -> bytes:
        if self.pos >= self.fail_at:
            self.failed_reads += 1
            raise ShardOpenError("GET failed: reset (gave up after 6 attempts)", url=URL)
        return super().read(size)


def test_close_after_the_store_failed_does_not_read_it_again(
    entry: Entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that failed had spent its retries: closing (however little is left) does not
    start another round of them to complete the entry; the shard is simply not cached."""
    monkeypatch.setattr(TeeStream, "DRAIN_MAX_BYTES", len(DATA))
    store = FailingStore(fail_at=3000)
    stream = tee(entry, store)
    with pytest.raises(ShardOpenError, match="gave up"):
        read_all(stream)
    stream.close()
    assert store.failed_reads == 1
    assert entry.commits == []
    assert not entry.partial.exists()
    assert stream.stats.uncached == 1


def test_close_never_downloads_the_object_again(
    entry: Entry,
    small_hold: int,
    caplog: pytest.LogCaptureFixture,
    sum_of: Callable[[bytes], Checksum],
) -> None:
    """A mismatch found while completing the entry at close is not rechecked (that would be a
    second full download after the consumer stopped): the shard is simply not cached."""
    stream = tee(entry, Store(flip=len(DATA) - 10), checksum=sum_of(DATA), refetch=Store)
    stream.read(100)
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        stream.close()
    assert entry.refetches == []
    assert entry.commits == []
    assert not entry.partial.exists()
    assert any("not cached" in r.getMessage() for r in caplog.records)


def test_cancel_says_whether_it_gave_up_a_download_in_progress(entry: Entry) -> None:
    running = tee(entry, Store())
    running.read(100)
    assert running.cancel() is True
    assert running.handed_back  # not counted: nobody read it
    assert entry.commits == []
    assert not entry.partial.exists()
    assert running.stats.uncached == 0

    finished = tee(Entry(entry.directory), Store())
    read_all(finished)
    assert finished.cancel() is False
    assert not finished.handed_back
