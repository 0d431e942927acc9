"""Following another process's download (:class:`FollowStream`), the download lock, and what
the cache trusts about an object (:mod:`cloudshards.cache.facts`), each on its own.

The downloader is played by the test: it holds the entry's lock (a second ``flock`` on the
same file conflicts even within one process), appends to the partial file and renames it into
place at the follower's checkpoints, so each ordering is reached without timing.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import fakes
import google_crc32c
import pytest

import cloudshards.cache.facts as facts
from cloudshards.cache import lock as cachelock
from cloudshards.cache.follow import FollowStream
from cloudshards.cache.lock import POISONED_MODE, DownloadLock, is_locked
from cloudshards.cache.membertable import MemberTable, load_table
from cloudshards.cache.stats import CacheStats
from cloudshards.errors import ShardOpenError
from cloudshards.source import OpenOptions

DATA = bytes(range(256)) * 40  # 10,240 bytes
#: Reads of 700 bytes, so that they never line up with the 1,000-byte parts written or served.
read_all = partial(fakes.read_all, size=700)
read_exactly = partial(fakes.read_exactly, size=700)
URL = "s3://bucket/shard-000.tar"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Download:
    """Another process's download of one entry, as the follower sees it on disk."""

    directory: Path
    lock: DownloadLock = field(init=False)
    takeovers: int = 0
    closes: int = 0
    store: bytes = DATA  # the object in the store, when a follower takes the download over

    def __post_init__(self) -> None:
        self.lock = DownloadLock(str(self.lock_path))
        assert self.lock.try_acquire()
        self.partial.write_bytes(b"")

    @property
    def partial(self) -> Path:
        return self.directory / "entry.partial"

    @property
    def entry(self) -> Path:
        return self.directory / "entry"

    @property
    def lock_path(self) -> Path:
        return self.directory / "entry.lock"

    def write(self, data: bytes) -> None:
        with open(self.partial, "ab") as f:
            f.write(data)

    def commit(self) -> None:
        os.replace(self.partial, self.entry)
        self.lock.release()

    def follow(self, stats: CacheStats | None = None) -> FollowStream:
        return FollowStream(
            os.open(self.partial, os.O_RDONLY),
            URL,
            entry=str(self.entry),
            lock_path=str(self.lock_path),
            stats=stats or CacheStats(),
            take_over=self.take_over,
            on_close=self.on_close,
        )

    def take_over(self) -> Any:
        self.takeovers += 1
        return _Rest(self.store)  # from its first byte: the follower checks what it read

    def on_close(self) -> None:
        self.closes += 1


class _Rest:
    def __init__(self, data: bytes) -> None:
        self.data, self.closed = data, False

    def read(self, size: int = -1) -> bytes:
        size = len(self.data) if size < 0 else size
        out, self.data = self.data[:size], self.data[size:]
        return out

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def download(tmp_path: Path) -> Iterator[Download]:
    d = Download(tmp_path)
    yield d
    d.lock.release()


def at_checkpoint(monkeypatch: pytest.MonkeyPatch, point: str, action: Any) -> None:
    """Run ``action`` (once) the first time the cache passes ``point``."""
    done = []

    def checkpoint(name: str) -> None:
        if name == point and not done:
            done.append(name)
            action()

    monkeypatch.setattr(cachelock, "_checkpoint", checkpoint)


# --- following ----------------------------------------------------------------------------


def test_the_bytes_written_between_the_last_read_and_the_commit_are_read(
    download: Download, monkeypatch: pytest.MonkeyPatch
) -> None:
    download.write(DATA[:4000])
    stats = CacheStats()
    follow = download.follow(stats)
    assert follow.read(0) == b""
    assert follow.read(1) == DATA[:1]

    def finish() -> None:  # the rest arrives and is committed while the follower looks
        download.write(DATA[4000:])
        download.commit()

    assert read_exactly(follow, 3999) == DATA[1:4000]
    at_checkpoint(monkeypatch, "follower_caught_up", finish)
    assert follow.read(1) == DATA[4000:4001]  # read after the commit: still what was asked
    assert read_all(follow) == DATA[4001:]
    assert follow.offset == len(DATA)
    assert stats.bytes_disk == len(DATA)
    assert download.takeovers == 0
    follow.close()


def test_a_follower_reads_a_growing_file_until_the_commit(download: Download) -> None:
    download.write(DATA[:1000])
    follow = download.follow()

    def downloader() -> None:
        for start in range(1000, len(DATA), 1000):
            time.sleep(0.01)
            download.write(DATA[start : start + 1000])
        download.commit()

    thread = threading.Thread(target=downloader)
    thread.start()
    try:
        assert read_all(follow, size=300) == DATA
    finally:
        thread.join()
    follow.close()


def test_an_abandoned_download_is_taken_over_at_the_offset_reached(
    download: Download,
) -> None:
    before = open_fds()
    download.write(DATA[:3000])
    follow = download.follow()
    number = follow.fd
    assert read_exactly(follow, 3000) == DATA[:3000]
    download.lock.release()  # the downloader died: its lock is free, nothing committed
    assert read_all(follow) == DATA[3000:]
    assert download.takeovers == 1
    # The partial file stays open until what was read is checked against it, then is closed
    # (its space goes back to the disk); once its number is reused, closing the follower
    # must leave that new file alone.
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(number)
    devnull = os.open(os.devnull, os.O_RDONLY)
    reused = os.dup2(devnull, number)
    os.close(devnull)
    try:
        table = MemberTable()
        table.complete = True
        follow.table_path = str(download.directory / "entry.members.json")
        follow.save_member_table(table)  # read from another stream: not this entry's table
        assert not Path(follow.table_path).exists()
        follow.close()
        os.fstat(reused)
    finally:
        os.close(reused)
    assert download.closes == 1
    assert open_fds() == before - 1  # the downloader's lock was released


def test_a_download_that_makes_no_progress_is_read_past_from_the_store(
    download: Download, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The downloader is alive (its lock held) but stopped: its consumer stopped reading and
    kept the iterator (a caught error's traceback holds it). The follower waits STALL_S, then
    reads the rest from the store itself (it once waited forever)."""
    monkeypatch.setattr(FollowStream, "STALL_S", 0.2)
    download.write(DATA[:3000])
    follow = download.follow()
    assert read_exactly(follow, 3000) == DATA[:3000]
    began = time.monotonic()
    assert read_all(follow) == DATA[3000:]  # the lock is still held, nothing committed
    assert 0.2 <= time.monotonic() - began < 5
    assert download.takeovers == 1
    assert "made no progress" in caplog.text
    follow.close()


def test_a_poisoned_download_fails_its_followers(download: Download) -> None:
    download.write(DATA[:3000])
    follow = download.follow()
    read_exactly(follow, 3000)
    os.chmod(download.partial, POISONED_MODE)
    download.lock.release()
    with pytest.raises(ShardOpenError, match="checksum"):
        follow.read(100)
    assert download.takeovers == 0
    follow.close()


def test_a_take_over_of_an_object_replaced_since_fails_naming_the_change(
    download: Download,
) -> None:
    """The downloader died, and the object was replaced before the follower took over: the
    new object's bytes must not continue the old one's (a sample made of both)."""
    download.write(DATA[:3000])
    follow = download.follow()
    assert read_exactly(follow, 3000) == DATA[:3000]
    download.lock.release()
    download.store = DATA[:2000] + bytes(len(DATA) - 2000)  # replaced, the same size
    with pytest.raises(ShardOpenError, match="changed while it was read") as info:
        follow.read(100)
    assert info.value.offset == 0  # the first piece read back differs (it holds byte 2000)
    follow.close()


def test_a_download_another_reader_took_over_into_a_new_file_is_left_at_once(
    download: Download,
) -> None:
    """Another follower took the dead download over: it writes a new file at the partial's
    name (the old one stays readable to those holding it). This follower notices at once,
    not after STALL_S, and takes over too, checked against what it read."""
    download.write(DATA[:3000])
    follow = download.follow()
    assert read_exactly(follow, 3000) == DATA[:3000]
    os.unlink(download.partial)
    download.partial.write_bytes(DATA[:100])  # the other reader's new file; its lock is held
    began = time.monotonic()
    assert read_all(follow) == DATA[3000:]
    assert time.monotonic() - began < FollowStream.STALL_S / 10
    assert download.takeovers == 1
    follow.close()


def test_closing_a_follower_closes_its_file_once(download: Download) -> None:
    before = open_fds()
    follow = download.follow()
    follow.close()
    follow.close()
    assert open_fds() == before
    assert download.closes == 1


# --- the member table of a followed entry -------------------------------------------------


def test_a_follower_saves_the_table_once_the_downloader_commits(download: Download) -> None:
    download.write(DATA)
    follow = download.follow()
    read_exactly(follow, len(DATA))
    follow.table_path = str(download.directory / "entry.members.json")
    committer = threading.Timer(0.2, download.commit)
    committer.start()
    try:
        follow.save_member_table(fakes.member_table())  # waits for the commit
    finally:
        committer.join()
    table = load_table(follow.table_path, len(DATA))
    assert table is not None
    assert table.names == ["a.cls"]
    follow.close()


def test_a_follower_does_not_wait_for_a_commit_for_ever(
    download: Download, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FollowStream, "COMMIT_WAIT_S", 0.3)
    download.write(DATA)
    follow = download.follow()
    read_exactly(follow, len(DATA))
    follow.table_path = str(download.directory / "entry.members.json")
    start = time.monotonic()
    follow.save_member_table(fakes.member_table())
    assert 0.3 <= time.monotonic() - start < 5
    assert not Path(follow.table_path).exists()  # no entry, no table
    follow.close()


def test_a_follower_of_a_download_that_stopped_saves_no_table(download: Download) -> None:
    download.write(DATA)
    follow = download.follow()
    read_exactly(follow, len(DATA))
    follow.table_path = str(download.directory / "entry.members.json")
    download.lock.release()  # stopped without committing
    start = time.monotonic()
    follow.save_member_table(fakes.member_table())
    assert time.monotonic() - start < FollowStream.COMMIT_WAIT_S / 2
    assert not Path(follow.table_path).exists()
    follow.close()


def test_without_a_table_path_nothing_is_saved(download: Download) -> None:
    download.write(DATA)
    follow = download.follow()
    read_exactly(follow, len(DATA))
    download.commit()
    follow.save_member_table(fakes.member_table())
    assert sorted(p.name for p in download.directory.iterdir()) == ["entry", "entry.lock"]
    follow.close()


# --- the download lock -----------------------------------------------------------------------


def test_a_busy_lock_is_refused_without_leaking_a_descriptor(tmp_path: Path) -> None:
    path = str(tmp_path / "x.lock")
    holder = DownloadLock(path)
    assert holder.try_acquire()
    before = open_fds()
    assert DownloadLock(path).try_acquire() is False
    assert open_fds() == before
    assert is_locked(path)
    holder.release()
    assert not is_locked(path)
    assert open_fds() == before - 1


def test_the_lock_file_is_not_executable_nor_writable_by_others(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        lock = DownloadLock(str(tmp_path / "x.lock"))
        assert lock.try_acquire()
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o644
    lock.release()


def test_entering_a_lock_waits_for_its_holder(tmp_path: Path) -> None:
    path = str(tmp_path / "x.lock")
    holder = DownloadLock(path)
    assert holder.try_acquire()
    entered = threading.Event()

    def waiter() -> None:
        with DownloadLock(path) as lock:
            assert lock.fd >= 0
            entered.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not entered.wait(0.3)
    holder.release()
    assert entered.wait(10)
    thread.join()
    assert not is_locked(path)


def test_a_lock_error_other_than_busy_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")

    before = open_fds()
    monkeypatch.setattr(cachelock.fcntl, "flock", no_locks)
    lock = DownloadLock(str(tmp_path / "x.lock"))
    with pytest.raises(OSError, match="no locks"):
        lock.try_acquire()
    monkeypatch.setattr(cachelock.fcntl, "flock", fcntl.flock)
    assert open_fds() == before
    assert lock.fd < 0


def test_releasing_never_touches_another_descriptor(tmp_path: Path) -> None:
    """Release is idempotent, also before any acquire; it must never close a descriptor it
    does not own (standard input included: run in a child whose stdin is a pipe)."""
    script = f"""
import os, sys
from cloudshards.cache.lock import DownloadLock
lock = DownloadLock({str(tmp_path / "x.lock")!r})
lock.release()                      # never acquired
assert lock.try_acquire()
lock.release()
lock.release()                      # twice
os.fstat(0)
assert DownloadLock({str(tmp_path / "x.lock")!r}).try_acquire()  # free again
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=b"",
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.strip() == b"ok"


# --- what the cache trusts about an object -------------------------------------------------


@pytest.fixture
def fresh_distrust(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(facts, "_DISTRUSTED", set())


def test_distrust_covers_the_store_and_bucket_in_every_spelling(fresh_distrust: None) -> None:
    facts.distrust_checksums("s3://key:secret@Bucket/a.tar", None)
    assert facts._distrusted("s3a://bucket/b.tar", None)
    assert facts._distrusted("s3://other:cred@bucket/c.tar", None)
    assert not facts._distrusted("s3://bucket2/a.tar", None)
    assert not facts._distrusted("s3://bucket/a.tar", "http://127.0.0.1:9000")
    assert not facts._distrusted("gs://bucket/a.tar", None)
    facts.distrust_checksums("gcs://bucket/a.tar", None)
    assert facts._distrusted("gs://bucket/z.tar", None)


def test_an_md5hash_that_is_not_strict_base64_is_not_trusted() -> None:
    digest = base64.b64encode(hashlib.md5(b"x").digest()).decode()
    assert facts.trusted_md5("gs://b/x", {"md5Hash": digest}, None) == hashlib.md5(b"x").hexdigest()
    junk = digest[:4] + "!" + digest[4:]
    assert facts.trusted_md5("gs://b/x", {"md5Hash": junk}, None) is None


def _gcs_crc32c(data: bytes) -> str:
    """GCS's ``crc32c`` field: base64 of the big-endian CRC32C."""
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def test_gcs_objects_are_verified_by_crc32c_where_it_is_fast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GCS gives every object a CRC32C (composite objects have no md5Hash), and google-crc32c
    computes it in hardware: it is preferred to the MD5. Without the C extension, or where the
    field is malformed, the MD5 is used; transcoded objects (contentEncoding) get neither."""
    crc = google_crc32c.value(b"x").to_bytes(4, "big").hex()
    md5 = hashlib.md5(b"x").hexdigest()
    both = {"crc32c": _gcs_crc32c(b"x"), "md5Hash": base64.b64encode(bytes.fromhex(md5)).decode()}
    assert facts.trusted_checksum("gs://b/x", both, None) == facts.Checksum("crc32c", crc)
    composite = {"crc32c": _gcs_crc32c(b"x"), "componentCount": 2}
    assert facts.trusted_checksum("gcs://b/x", composite, None) == facts.Checksum("crc32c", crc)
    malformed = {**both, "crc32c": "AAAA!"}
    assert facts.trusted_checksum("gs://b/x", malformed, None) == facts.Checksum("md5", md5)
    gzipped = {**both, "contentEncoding": "gzip"}
    assert facts.trusted_checksum("gs://b/x", gzipped, None) is None
    # Only GCS's field is trusted: an S3 or HTTP object with a crc32c key is not verified by it.
    assert facts.trusted_checksum("s3://b/x", composite, None) is None
    assert facts.trusted_checksum("https://h/x", composite, None) is None
    monkeypatch.setattr(facts, "_fast_crc32c", lambda: False)
    assert facts.trusted_checksum("gs://b/x", both, None) == facts.Checksum("md5", md5)
    assert facts.trusted_checksum("gs://b/x", composite, None) is None


def test_the_crc32c_hasher_takes_views_and_pieces_as_bytes() -> None:
    data = os.urandom(700_000)
    whole = facts.Checksum("crc32c", google_crc32c.value(data).to_bytes(4, "big").hex())
    hasher = whole.hasher()
    hasher.update(memoryview(data)[:300_001])  # a view larger than one piece
    prefix = hasher.copy()
    hasher.update(data[300_001:])
    assert hasher.hexdigest() == whole.hexdigest
    prefix.update(memoryview(data)[300_001:])
    assert prefix.digest() == hasher.digest()


def test_sse_s3_etags_are_trusted_on_aws_endpoints_only() -> None:
    etag = hashlib.md5(b"x").hexdigest()
    details = {"ETag": f'"{etag}"', "ServerSideEncryption": "AES256"}
    for endpoint in (
        None,
        "https://s3.us-east-1.amazonaws.com",
        "https://s3.cn-north-1.amazonaws.com.cn",
    ):
        assert facts.trusted_md5("s3://b/x", details, endpoint) == etag, endpoint
    for endpoint in ("http://127.0.0.1:9000", "https://minio.example.com", "file:///tmp"):
        assert facts.trusted_md5("s3://b/x", details, endpoint) is None, endpoint


class _Stream:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def test_size_and_checksum_come_from_the_open_stream_without_another_request(
    monkeypatch: pytest.MonkeyPatch, fresh_distrust: None
) -> None:
    """One metadata request per shard is what opening it already cost: the facts must not
    add another when the stream (or the file under it) carries them."""
    asked: list[str] = []

    def object_info(url: str, options: OpenOptions) -> dict[str, Any]:
        asked.append(url)
        return {"size": 99}

    monkeypatch.setattr(facts, "object_info", object_info)
    digest = base64.b64encode(hashlib.md5(b"x").digest()).decode()
    details = {"size": 10, "md5Hash": digest}
    options = OpenOptions()
    on_stream = _Stream(details=details, size=10)
    under = _Stream(_raw=_Stream(details=details, size=10), details=None, size=None)
    for stream in (on_stream, under):
        assert facts.remote_facts(stream, "gs://b/x", options, None) == (
            10,
            facts.Checksum("md5", hashlib.md5(b"x").hexdigest()),
        )
    assert asked == []
    # A streaming HTTP file knows no size: then, and only then, the store is asked.
    assert facts.remote_facts(
        _Stream(details={"size": None}, size=None), "gs://b/x", options, None
    ) == (99, None)
    assert asked == ["gs://b/x"]
