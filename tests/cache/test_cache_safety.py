"""The node cache against hostile or broken conditions: checksums a store does not guarantee,
bytes corrupted in transit, a full or read-only disk, and stores told apart only by their
endpoint.

Stores are fakes at the fsspec seam: ``slowfile://`` (tests/fakes.py), an opaque store like an
HTTP server or CDN, and ``FakeGCS`` registered as ``gs://``, whose ``info()`` reports a
``md5Hash`` or a ``crc32c`` (the checksums the cache trusts that a unit test can serve; each
test that uses it runs with both) and which can corrupt a byte of a download. A full disk is
a real tmpfs filled to the last byte where this machine lets us mount one, else the same
failures injected at the OS calls of the cache.
"""

from __future__ import annotations

import base64
import builtins
import collections
import contextlib
import errno
import hashlib
import json
import logging
import os
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import fakes
import fsspec
import fsspec.config
import google_crc32c
import pytest
from fsspec.registry import _registry as fsspec_registry

import cloudshards as wds
import cloudshards.cache.facts
import cloudshards.urls
from cloudshards.cache import ShardCache, entry_name
from cloudshards.cache.facts import trusted_md5
from cloudshards.cache.keys import canonical_url, store_endpoint
from cloudshards.cache.tee import TeeStream
from cloudshards.errors import ShardOpenError
from cloudshards.process import PerProcess
from cloudshards.source import OpenOptions

SampleList = list[tuple[str, dict[str, bytes]]]

# --- helpers -------------------------------------------------------------------------------


def samples_of(source: Any) -> SampleList:
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in source]


def flocked(path: Path) -> bool:
    """Whether any process holds a flock on ``path`` (from /proc/locks, without locking)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(
        "FLOCK" in line and key in line.split()
        for line in Path("/proc/locks").read_text().splitlines()
    )


def held_locks(cache_dir: Path) -> list[str]:
    locks = cache_dir / "locks"
    names = sorted(os.listdir(locks)) if locks.is_dir() else []
    return [name for name in names if flocked(locks / name)] + (
        ["cache.lock"] if flocked(cache_dir / "cache.lock") else []
    )


def leftovers(cache_dir: Path) -> list[str]:
    """Partial and temporary files anywhere under the cache directory."""
    found = []
    for root, _, files in os.walk(cache_dir):
        found += [os.path.join(root, f) for f in files if f.endswith((".partial", ".tmp"))]
    return sorted(found)


def entries(cache_dir: Path) -> list[str]:
    data = cache_dir / "data"
    return sorted(os.listdir(data)) if data.is_dir() else []


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("cloudshards")
    ]


def member_offset(path: Path, index: int) -> int:
    """Where the data of the ``index``-th member of a tar starts."""
    with tarfile.open(path) as tar:
        return int(tar.getmembers()[index].offset_data)


@dataclass
class Handled:
    """A webdataset-style handler that records what reached it and skips the shard."""

    errors: list[BaseException] = field(default_factory=list)

    def __call__(self, exn: BaseException) -> bool:
        self.errors.append(exn)
        return True


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


# --- a GCS-like fake store: trusted md5Hash or crc32c, optional corruption ----------------


class CorruptingFile(fakes.SlowFile):
    def __init__(self, path: str, store: type[FakeGCS]) -> None:
        super().__init__(path)
        self._path = path
        self._store = store

    def readinto(self, buffer: Any) -> int:
        start = self.tell()
        count = super().readinto(buffer)
        view = memoryview(buffer).cast("B")
        view[:count] = self._store.corrupt(self._path, start, bytes(view[:count]))
        return count


class FakeGCS(fakes.SlowFileSystem):
    """``gs:///abs/path``: a local file served as a GCS object (``info()`` has the checksum
    ``field`` names: ``md5Hash`` or ``crc32c``).

    Class knobs (reset by the ``gcs`` fixture): ``wrong_checksum``, a byte repeated to the
    checksum's length, is reported instead of the real checksum;
    ``corrupt_at`` is a byte offset that is served flipped, ``corrupt_times`` times in all
    (each download that covers it uses one), as a bad link would; only in ``corrupt_path``
    when that is set (the shards after the first are fetched while it is read).
    """

    protocol = ("gs", "gcs")
    field: ClassVar[str] = "md5Hash"
    wrong_checksum: ClassVar[bytes | None] = None
    corrupt_at: ClassVar[int | None] = None
    corrupt_times: ClassVar[int] = 0
    corrupt_path: ClassVar[str | None] = None

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        details = super().info(path, **kwargs)
        if details["type"] == "file":
            data = Path(details["name"]).read_bytes()
            if self.field == "md5Hash":
                digest = hashlib.md5(data).digest()
            else:
                digest = google_crc32c.value(data).to_bytes(4, "big")
            if self.wrong_checksum is not None:
                digest = self.wrong_checksum * len(digest)
            details[self.field] = base64.b64encode(digest).decode()
        return details

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        data = super().cat_file(path, start, end, **kwargs)
        return self.corrupt(self._strip_protocol(path), start or 0, data)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> CorruptingFile:
        super()._open(path, mode, **kwargs).close()  # delays, the open log
        return CorruptingFile(self._strip_protocol(path), type(self))

    @classmethod
    def corrupt(cls, path: str, start: int, data: bytes) -> bytes:
        at = cls.corrupt_at
        if at is None or cls.corrupt_times <= 0 or not start <= at < start + len(data):
            return data
        if cls.corrupt_path is not None and path != cls.corrupt_path:
            return data
        cls.corrupt_times -= 1
        flipped = bytearray(data)
        flipped[at - start] ^= 0xFF
        return bytes(flipped)


@pytest.fixture(params=["md5Hash", "crc32c"])
def gcs(
    store: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[type[FakeGCS]]:
    """``FakeGCS`` as the ``gs://`` implementation, for this test only, reporting an MD5 or a
    CRC32C."""
    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_UNIVERSE_DOMAIN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(fsspec_registry, "gs", FakeGCS)
    monkeypatch.setattr(cloudshards.urls, "_fs_cache", PerProcess(dict))
    monkeypatch.setattr(cloudshards.cache.facts, "_DISTRUSTED", set())  # per process
    monkeypatch.setattr(FakeGCS, "field", request.param)
    monkeypatch.setattr(FakeGCS, "wrong_checksum", None)
    monkeypatch.setattr(FakeGCS, "corrupt_at", None)
    monkeypatch.setattr(FakeGCS, "corrupt_times", 0)
    monkeypatch.setattr(FakeGCS, "corrupt_path", None)
    yield FakeGCS
    FakeGCS.clear_instance_cache()


def gs_url(path: Path) -> str:
    return f"gs://{path}"


# === 5. checksums ===========================================================================


def _sse(**fields: Any) -> dict[str, Any]:
    return {"ETag": '"9e107d9d372bb6826bd81d3542a419d6"', "size": 10, **fields}


MD5 = "9e107d9d372bb6826bd81d3542a419d6"


@pytest.mark.parametrize(
    ("url", "details", "endpoint", "expected"),
    [
        # What s3fs's info() returns today: no encryption fields, so nothing says the ETag
        # is an MD5 (an SSE-KMS object looks exactly the same).
        ("s3://b/k.tar", _sse(), None, None),
        ("s3://b/k.tar", _sse(ServerSideEncryption="aws:kms"), None, None),
        ("s3://b/k.tar", _sse(ServerSideEncryption="aws:kms:dsse"), None, None),
        (
            "s3://b/k.tar",
            _sse(ServerSideEncryption="AES256", SSECustomerAlgorithm="AES256"),
            None,
            None,
        ),
        ("s3://b/k.tar", _sse(SSECustomerAlgorithm="AES256"), None, None),
        ("s3://b/k.tar", {"ETag": f'"{MD5}-3"', "ServerSideEncryption": "AES256"}, None, None),
        # SSE-S3 on AWS itself: the documented case where the ETag is the body's MD5.
        ("s3://b/k.tar", _sse(ServerSideEncryption="AES256"), None, MD5),
        ("s3a://b/k.tar", _sse(ServerSideEncryption="AES256"), None, MD5),
        # The same metadata from an S3-compatible store proves nothing.
        ("s3://b/k.tar", _sse(ServerSideEncryption="AES256"), "http://minio:9000", None),
        # An HTTP ETag is an opaque tag, whatever it looks like; so is any other store's.
        ("https://cdn.example/k.tar", {"ETag": f'"{MD5}"', "size": 10}, None, None),
        ("http://h/k.tar", {"ETag": MD5, "Content-MD5": "x"}, None, None),
        ("slowfile:///k.tar", {"ETag": f'"{MD5}"'}, None, None),
        ("az://c/k.tar", {"etag": f'"{MD5}"'}, None, None),
        # GCS: md5Hash is the MD5 of the stored bytes (absent for composite objects)...
        ("gs://b/k.tar", {"md5Hash": base64.b64encode(bytes.fromhex(MD5)).decode()}, None, MD5),
        ("gcs://b/k.tar", {"md5Hash": base64.b64encode(bytes.fromhex(MD5)).decode()}, None, MD5),
        ("gs://b/k.tar", {"etag": MD5, "componentCount": 2, "crc32c": "AAAAAA=="}, None, None),
        # ... which are not what a client gets when the object is served transcoded.
        (
            "gs://b/k.tar",
            {"md5Hash": base64.b64encode(bytes.fromhex(MD5)).decode(), "contentEncoding": "gzip"},
            None,
            None,
        ),
        ("gs://b/k.tar", {"md5Hash": "not base64!"}, None, None),
        ("gs://b/k.tar", {"md5Hash": base64.b64encode(b"short").decode()}, None, None),
    ],
)
def test_only_checksums_the_store_guarantees_are_trusted(
    url: str, details: dict[str, Any], endpoint: str | None, expected: str | None
) -> None:
    assert trusted_md5(url, details, endpoint) == expected


@pytest.mark.parametrize("etag", ["0123456789abcdef0123456789abcdef", "md5"])
def test_an_opaque_etag_that_looks_like_an_md5_does_not_break_the_cache(
    make_shards: Any,
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    etag: str,
) -> None:
    """A CDN in front of an SSE-KMS bucket, an S3-compatible store: a 32-hex ETag that is not
    the body's MD5 must neither fail the shard nor keep it out of the cache."""
    shards = make_shards([3, 4], payload_bytes=2000)
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv(fakes.ETAG_ENV, etag)
    urls = [fakes.url_of(p) for p in shards.paths]
    for _ in range(2):
        ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir))
        assert samples_of(ds) == shards.samples
    assert entries(cache_dir) == sorted(entry_name(u) for u in urls)
    assert fetches(store) == {str(p): 1 for p in shards.paths}  # the second epoch hit
    assert warnings_of(caplog) == []


def test_a_trusted_checksum_that_is_wrong_refetches_once_then_streams_uncached(
    make_shards: Any,
    gcs: type[FakeGCS],
    store: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store whose checksum (md5Hash or crc32c) is not one of what it serves: the samples
    are right (two downloads agree), the shard is not cached, one warning, and nothing
    raises."""
    shards = make_shards([3, 4], payload_bytes=2000)
    cache_dir = tmp_path / "cache"
    gcs.wrong_checksum = b"\x01"
    urls = [gs_url(p) for p in shards.paths]
    ds = wds.WebDataset(urls[:1], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds) == shards.samples[:3]
    assert fetches(store) == {str(shards.paths[0]): 2}
    assert entries(cache_dir) == []
    assert leftovers(cache_dir) == []
    assert held_locks(cache_dir) == []
    (message,) = warnings_of(caplog)
    assert "checksum" in message
    assert ds.cache is not None
    assert (ds.cache.stats.misses, ds.cache.stats.uncached) == (0, 1)
    # This process no longer trusts that store's checksums: the next shard is cached, once.
    ds = wds.WebDataset(urls[1:], shardshuffle=False, cache_dir=str(cache_dir))
    for _ in range(2):
        assert samples_of(ds) == shards.samples[3:]
    assert fetches(store)[str(shards.paths[1])] == 1
    assert entries(cache_dir) == [entry_name(urls[1])]


def test_a_trusted_checksum_is_verified_and_recorded(
    make_shards: Any, gcs: type[FakeGCS], store: Path, tmp_path: Path
) -> None:
    shards = make_shards([3], payload_bytes=2000)
    cache_dir = tmp_path / "cache"
    url = gs_url(shards.paths[0])
    for _ in range(2):
        ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
        assert samples_of(ds) == shards.samples
    assert fetches(store) == {str(shards.paths[0]): 1}
    meta = json.loads((cache_dir / "meta" / f"{entry_name(url)}.json").read_text())
    data = shards.paths[0].read_bytes()
    if gcs.field == "md5Hash":
        assert meta["checksum"] == f"md5:{hashlib.md5(data).hexdigest()}"
    else:
        assert meta["checksum"] == f"crc32c:{google_crc32c.value(data):08x}"
    # Committed before the reader parsed the held-back end, the entry still gets its table.
    assert (cache_dir / "meta" / f"{entry_name(url)}.members.json").exists()


def test_bytes_corrupted_in_transit_never_reach_the_consumer_from_the_tail(
    make_shards: Any,
    gcs: type[FakeGCS],
    store: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The last bytes of a shard are served only once the whole download matches its checksum:
    a byte flipped there is fetched again, and the consumer and the entry get the right one."""
    shards = make_shards([4], payload_bytes=2000)
    path = shards.paths[0]
    assert path.stat().st_size <= TeeStream.HOLD_BYTES  # the whole shard is the tail
    gcs.corrupt_at, gcs.corrupt_times = member_offset(path, 4), 1
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset([gs_url(path)], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds) == shards.samples
    assert gcs.corrupt_times == 0
    assert fetches(store) == {str(path): 2}
    assert (cache_dir / "data" / entry_name(gs_url(path))).read_bytes() == path.read_bytes()
    assert len(warnings_of(caplog)) == 1


def test_a_mismatch_that_cannot_be_checked_again_fails_the_shard(
    make_shards: Any,
    gcs: type[FakeGCS],
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checksum does not match and the second download fails: nothing can vouch for the
    bytes, so the reader gets a ShardOpenError that says so (through its handler)."""
    shards = make_shards([3], payload_bytes=2000)
    gcs.wrong_checksum = b"\x03"

    def refuse(self: Any, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        raise PermissionError(f"{path}: access denied")

    monkeypatch.setattr(FakeGCS, "_open", refuse)
    cache_dir = tmp_path / "cache"
    handler = Handled()
    ds = wds.WebDataset(
        [gs_url(shards.paths[0])],
        shardshuffle=False,
        cache_dir=str(cache_dir),
        handler=handler,
        empty_check=False,
    )
    assert samples_of(ds) == []  # the whole shard was held back: nothing unverified got out
    (error,) = handler.errors
    assert isinstance(error, ShardOpenError)
    assert "second download to check it failed" in str(error)
    assert entries(cache_dir) == []
    assert held_locks(cache_dir) == []


@pytest.fixture
def small_hold(monkeypatch: pytest.MonkeyPatch) -> int:
    """Hold back only the last 8 KiB of each download until it is verified."""
    monkeypatch.setattr(TeeStream, "HOLD_BYTES", 8192)
    monkeypatch.setenv(fakes.CHUNK_ENV, "4096")
    monkeypatch.setenv("CLOUDSHARDS_PART_BYTES", "65536")
    return 8192


def test_bytes_corrupted_before_the_tail_reach_the_handler_as_a_shard_error(
    make_shards: Any,
    gcs: type[FakeGCS],
    store: Path,
    tmp_path: Path,
    small_hold: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bytes already served that the checksum (and a second download) show were wrong: the
    consumer gets a ShardOpenError through its handler, never from close(); nothing is
    cached; the next read gets the right bytes."""
    shards = make_shards([5, 3], payload_bytes=10_000)
    path = shards.paths[0]
    assert path.stat().st_size > 4 * small_hold
    gcs.corrupt_at, gcs.corrupt_times = member_offset(path, 0) + 10, 1
    gcs.corrupt_path = str(path)
    cache_dir = tmp_path / "cache"
    urls = [gs_url(p) for p in shards.paths]
    handler = Handled()
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), handler=handler)
    got = samples_of(ds)
    assert got[-3:] == shards.samples[5:]  # the next shard is read as usual
    (error,) = handler.errors
    assert isinstance(error, ShardOpenError)
    assert "checksum" in str(error)
    assert entries(cache_dir) == [entry_name(urls[1])]
    assert leftovers(cache_dir) == []
    assert held_locks(cache_dir) == []
    assert fetches(store)[str(path)] == 2
    again = wds.WebDataset(urls[:1], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(again) == shards.samples[:5]
    assert entry_name(urls[0]) in entries(cache_dir)


def test_a_reader_that_stops_early_gets_no_error_from_close(
    make_shards: Any,
    gcs: type[FakeGCS],
    store: Path,
    tmp_path: Path,
    small_hold: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Closing completes a small remainder to cache it; when that fails verification, close()
    (and garbage collection) stay silent but for a warning, and release everything."""
    shards = make_shards([5], payload_bytes=10_000)
    gcs.wrong_checksum = b"\x02"
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(
        [gs_url(shards.paths[0])], shardshuffle=False, cache_dir=str(cache_dir), block_bytes=4096
    )
    it = iter(ds)
    assert samples_of([next(it)]) == shards.samples[:1]
    it.close()  # type: ignore[attr-defined]
    assert entries(cache_dir) == []
    assert leftovers(cache_dir) == []
    assert held_locks(cache_dir) == []
    assert any("checksum" in m for m in warnings_of(caplog))


def test_a_follower_of_a_download_that_failed_verification_gets_a_shard_error(
    make_shards: Any, gcs: type[FakeGCS], store: Path, tmp_path: Path, small_hold: int
) -> None:
    """Another reader that followed the bad download read the same wrong bytes: it must get a
    ShardOpenError too, not take over and finish as if nothing happened."""
    shards = make_shards([5], payload_bytes=10_000)
    path = shards.paths[0]
    url = gs_url(path)
    gcs.corrupt_at, gcs.corrupt_times = member_offset(path, 0) + 10, 1
    cache = ShardCache(tmp_path / "cache")
    downloader = cache.open(url)
    follower = cache.open(url, wait_s=10)
    assert type(follower).__name__ == "FollowStream"
    with pytest.raises(ShardOpenError, match="checksum"):
        fakes.read_all(downloader)
    downloader.close()
    with pytest.raises(ShardOpenError, match="checksum"):
        fakes.read_all(follower)
    follower.close()
    assert held_locks(tmp_path / "cache") == []
    with cache.open(url) as fresh:
        assert fresh.read(0) == b""
        assert fresh.read() == path.read_bytes()  # the held-back end included


# === 6. a full disk =========================================================================


class InjectedFaults:
    """The OS calls of a full (or read-only) disk, for paths under one directory only.

    ``ops`` picks which calls fail: ``mkdir``, ``lock`` (creating a lock file), ``reserve``
    (writing into a lock file), ``partial`` (creating a partial file), ``write`` (data into a
    partial file), ``close`` (closing a partial file reports the error, as NFS does), ``meta``
    (writing metadata), ``rename`` (``os.replace`` into the cache), or ``full`` (a filesystem
    with no free block: every write of data).
    """

    def __init__(self, directory: Path, error: int, ops: set[str]) -> None:
        self.directory = str(directory)
        self.error = error
        self.ops = ops
        self.hits: collections.Counter[str] = collections.Counter()

    def _mine(self, path: Any) -> bool:
        try:
            return os.path.abspath(os.fspath(path)).startswith(self.directory + os.sep)
        except TypeError:
            return False

    def _fd_path(self, fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def _fail(self, op: str, path: str) -> None:
        if op in self.ops or ("full" in self.ops and op in ("reserve", "write", "meta")):
            self.hits[op] += 1
            raise OSError(self.error, os.strerror(self.error), path)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_open, real_write, real_pwrite = os.open, os.write, os.pwrite
        real_close, real_replace, real_makedirs = os.close, os.replace, os.makedirs
        real_builtin_open = builtins.open

        def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            name = os.fspath(path)
            if kwargs.get("dir_fd") is not None:  # a name in a directory held open
                name = os.path.join(self._fd_path(kwargs["dir_fd"]), name)
            if self._mine(name) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                if name.endswith(".lock") and not os.path.exists(name):
                    self._fail("lock", name)
                if name.endswith(".partial"):
                    self._fail("partial", name)
                if name.endswith(".tmp"):  # metadata, tables, counters: a temporary, renamed
                    self._fail("meta", name)
            return real_open(path, flags, *args, **kwargs)

        def fake_write(fd: int, data: Any) -> int:
            path = self._fd_path(fd)
            if self._mine(path):
                self._fail("reserve" if path.endswith(".lock") else "write", path)
            return real_write(fd, data)

        def fake_pwrite(fd: int, data: Any, offset: int) -> int:
            path = self._fd_path(fd)
            if self._mine(path):
                self._fail("reserve" if path.endswith(".lock") else "write", path)
            return real_pwrite(fd, data, offset)

        def fake_close(fd: int) -> None:
            path = self._fd_path(fd)
            real_close(fd)
            if self._mine(path) and path.endswith(".partial"):
                self._fail("close", path)

        def fake_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            name = os.fspath(dst)
            if kwargs.get("dst_dir_fd") is not None:  # a name in a directory held open
                name = os.path.join(self._fd_path(kwargs["dst_dir_fd"]), name)
            if self._mine(name):
                self._fail("rename", name)
            real_replace(src, dst, *args, **kwargs)

        def fake_makedirs(path: Any, *args: Any, **kwargs: Any) -> None:
            if self._mine(path) or os.path.abspath(os.fspath(path)) == self.directory:
                self._fail("mkdir", os.fspath(path))
            real_makedirs(path, *args, **kwargs)

        def fake_builtin_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if self._mine(file) and any(c in mode for c in "wax+"):
                self._fail("meta", os.fspath(file))
            return real_builtin_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "write", fake_write)
        monkeypatch.setattr(os, "pwrite", fake_pwrite)
        monkeypatch.setattr(os, "close", fake_close)
        monkeypatch.setattr(os, "replace", fake_replace)
        monkeypatch.setattr(os, "makedirs", fake_makedirs)
        monkeypatch.setattr(builtins, "open", fake_builtin_open)


def _mount_tmpfs(directory: Path, *options: str) -> bool:
    """Mount a tiny tmpfs at ``directory``; False where this machine does not allow it."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                ",".join(("size=64k", *options)),
                "tmpfs",
                str(directory),
            ],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def _umount(directory: Path) -> None:
    subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30, check=False)


@dataclass
class FullDisk:
    """A cache directory on a filesystem with no free block left."""

    cache_dir: Path
    real: bool  # a real full tmpfs; False: the failures are injected


@pytest.fixture(params=["tmpfs", "injected"])
def full_disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FullDisk]:
    """A real tmpfs filled to its last block where this machine can mount one (root with
    CAP_SYS_ADMIN, as here); otherwise, and always for the ``injected`` variant, ENOSPC at
    every data write under the cache directory. Never skipped."""
    mount_point = tmp_path / "fs"
    if request.param == "tmpfs" and _mount_tmpfs(mount_point):
        try:
            with contextlib.suppress(OSError), open(mount_point / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
            yield FullDisk(mount_point / "cache", real=True)
        finally:
            _umount(mount_point)
        return
    InjectedFaults(mount_point, errno.ENOSPC, {"full"}).install(monkeypatch)
    yield FullDisk(mount_point / "cache", real=False)


def _read_through_cache(urls: list[str], cache_dir: Path, **kwargs: Any) -> tuple[SampleList, Any]:
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), **kwargs)
    samples = samples_of(ds)
    return samples, ds.cache


def _disk_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in warnings_of(caplog) if "disk full" in m]


@pytest.mark.timeout(60)
def test_a_full_filesystem_streams_uncached_and_holds_no_lock(
    make_shards: Any, store: Path, full_disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache directory on a filesystem with no free block: every shard streams from the
    store, one warning, no lock left held (a second open does not wait for the stall
    timeout), no partial file."""
    shards = make_shards([3, 4, 2], payload_bytes=3000)
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = full_disk.cache_dir
    if full_disk.real:
        assert os.statvfs(cache_dir.parent).f_bavail == 0
    samples, cache = _read_through_cache(urls, cache_dir)
    assert samples == shards.samples
    assert len(_disk_warnings(caplog)) == 1, warnings_of(caplog)
    assert cache.stats.uncached == 3
    assert cache.stats.misses == 0
    assert held_locks(cache_dir) == []
    assert leftovers(cache_dir) == []
    assert entries(cache_dir) == []
    start = time.monotonic()
    stream = ShardCache(cache_dir).open(urls[0], wait_s=5)
    try:
        assert fakes.read_all(stream) == shards.paths[0].read_bytes()
    finally:
        stream.close()
    assert time.monotonic() - start < 3
    assert held_locks(cache_dir) == []


FAULTS = [
    ("mkdir", errno.EROFS),
    ("lock", errno.ENOSPC),
    ("reserve", errno.ENOSPC),
    ("partial", errno.EDQUOT),
    ("write", errno.ENOSPC),
    ("close", errno.ENOSPC),
    ("meta", errno.EDQUOT),
    ("rename", errno.EROFS),
]


@pytest.mark.parametrize(("op", "error"), FAULTS, ids=[op for op, _ in FAULTS])
@pytest.mark.parametrize("budget", [None, 10_000_000], ids=["unlimited", "budget"])
def test_each_write_on_the_cache_path_degrades_to_streaming(
    make_shards: Any,
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    op: str,
    error: int,
    budget: int | None,
) -> None:
    """Whichever write fails with ENOSPC, EDQUOT or EROFS (creating the cache or a lock file,
    recording the reservation, creating or writing or closing the partial file, writing the
    metadata, renaming into place): samples are right, one warning, every lock released, no
    partial or temporary file; once the disk is back, the next read caches."""
    shards = make_shards([3, 4], payload_bytes=3000)
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "c"
    faults = InjectedFaults(cache_dir, error, {op})
    if op != "mkdir":
        ShardCache(cache_dir)._ensure_ready()
    with monkeypatch.context() as patch:
        faults.install(patch)
        samples, cache = _read_through_cache(urls, cache_dir, cache_size=budget or -1)
    assert faults.hits[op] >= 1
    assert samples == shards.samples
    assert len(_disk_warnings(caplog)) == 1, warnings_of(caplog)
    assert (cache.stats.misses, cache.stats.uncached) == (0, 2)
    assert held_locks(cache_dir) == []
    assert leftovers(cache_dir) == []
    assert entries(cache_dir) == []
    samples, _ = _read_through_cache(urls, cache_dir, cache_size=budget or -1)
    assert samples == shards.samples
    assert entries(cache_dir) == sorted(entry_name(u) for u in urls)


def test_a_read_only_cache_streams_uncached(
    make_shards: Any,
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A cache directory on a read-only filesystem (a real read-only tmpfs where mounting
    works): reading still works, with one warning."""
    shards = make_shards([3, 2], payload_bytes=500)
    urls = [fakes.url_of(p) for p in shards.paths]
    mount_point = tmp_path / "ro"
    if _mount_tmpfs(mount_point):
        try:
            ShardCache(mount_point / "cache")._ensure_ready()
            subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
            samples, cache = _read_through_cache(urls, mount_point / "cache")
        finally:
            _umount(mount_point)
    else:
        ShardCache(mount_point / "cache")._ensure_ready()
        with monkeypatch.context() as patch:
            InjectedFaults(mount_point, errno.EROFS, {"lock", "partial", "full"}).install(patch)
            samples, cache = _read_through_cache(urls, mount_point / "cache")
    assert samples == shards.samples
    assert cache.stats.uncached == 2
    assert len(_disk_warnings(caplog)) == 1, warnings_of(caplog)


def test_a_disk_that_fills_up_mid_shard_leaves_no_partial_file(
    make_shards: Any,
    store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shards = make_shards([6], payload_bytes=20_000)
    url = fakes.url_of(shards.paths[0])
    cache_dir = tmp_path / "c"
    ShardCache(cache_dir)._ensure_ready()
    monkeypatch.setenv(fakes.CHUNK_ENV, "8192")
    faults = InjectedFaults(cache_dir, errno.ENOSPC, set())
    writes = 0
    real_write = os.write

    def fill_after_one(fd: int, data: Any) -> int:
        nonlocal writes
        if faults._mine(faults._fd_path(fd)):
            writes += 1
            if writes > 1:  # the shard's first part (64 KiB) is written, its second is not
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fill_after_one)
    samples, _ = _read_through_cache([url], cache_dir, block_bytes=8192)
    assert samples == shards.samples
    assert writes > 1
    assert leftovers(cache_dir) == []
    assert held_locks(cache_dir) == []
    assert len(_disk_warnings(caplog)) == 1


# === 8. endpoints in cache keys =============================================================

S3_URL = "s3://bucket/train/shard-000001.tar"
GS_URL = "gs://bucket/train/shard-000001.tar"
AMBIENT = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_CLOUD_UNIVERSE_DOMAIN",
)


@pytest.fixture
def no_ambient_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No endpoint from the environment, fsspec's config or an AWS config file; returns the
    path AWS_CONFIG_FILE names (not created)."""
    for name in AMBIENT:
        monkeypatch.delenv(name, raising=False)
    for protocol in ("s3", "s3a", "gs", "gcs"):
        if protocol in fsspec.config.conf:
            monkeypatch.delitem(fsspec.config.conf, protocol)
    config = tmp_path / "aws-config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    return config


def key_of(url: str, storage_options: Any = None) -> str:
    return entry_name(url, store_endpoint(url, OpenOptions(storage_options=storage_options)))


@pytest.mark.parametrize(
    "storage_options",
    [
        {"client_kwargs": {"endpoint_url": "http://minio-a:9000"}},
        {"s3": {"client_kwargs": {"endpoint_url": "http://minio-a:9000"}}},
        {"s3": {"endpoint_url": "http://minio-a:9000"}},
        {"endpoint_url": "http://minio-a:9000", "client_kwargs": {"region_name": "x"}},
        {"s3": {"endpoint_url": "http://minio-a:9000/"}},
        {"s3": {"endpoint_url": "HTTP://MINIO-A:9000"}},
    ],
)
def test_every_s3fs_form_of_an_endpoint_is_in_the_key(
    no_ambient_endpoint: Path, storage_options: dict[str, Any]
) -> None:
    default = key_of(S3_URL)
    other = key_of(S3_URL, {"s3": {"endpoint_url": "http://minio-b:9000"}})
    assert default == entry_name(S3_URL)
    key = key_of(S3_URL, storage_options)
    assert key == entry_name(S3_URL, "http://minio-a:9000")
    assert key not in (default, other)


def test_s3fs_endpoint_url_wins_over_client_kwargs(no_ambient_endpoint: Path) -> None:
    options = {"endpoint_url": "http://a:1", "client_kwargs": {"endpoint_url": "http://b:2"}}
    assert store_endpoint(S3_URL, OpenOptions(storage_options=options)) == "http://a:1"


def test_fsspec_config_endpoints_are_in_the_key(
    no_ambient_endpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``FSSPEC_S3_ENDPOINT_URL``, ``FSSPEC_S3='{"client_kwargs": ...}'`` and fsspec config
    files end up in ``fsspec.config.conf``, which fsspec applies to every new filesystem."""
    default = key_of(S3_URL)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"client_kwargs": {"endpoint_url": "http://c:3"}})
    assert key_of(S3_URL) == entry_name(S3_URL, "http://c:3")
    assert key_of(S3_URL, {"endpoint_url": "http://d:4"}) == entry_name(S3_URL, "http://d:4")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": "http://e:5"})
    assert key_of(S3_URL) == entry_name(S3_URL, "http://e:5")
    monkeypatch.delitem(fsspec.config.conf, "s3")
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"endpoint_url": "http://f:6"})
    assert key_of(GS_URL) == entry_name(GS_URL, "http://f:6")
    assert key_of(S3_URL) == default


def test_aws_environment_and_config_file_endpoints_are_in_the_key(
    no_ambient_endpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = key_of(S3_URL)
    no_ambient_endpoint.write_text(
        "[default]\nendpoint_url = http://profile-default:1\n"
        "[profile r2]\nendpoint_url = http://profile-r2:2\n"
        "[profile minio]\nservices = local\n"
        "[services local]\ns3 =\n  endpoint_url = http://services-s3:3\n"
    )
    assert key_of(S3_URL) == entry_name(S3_URL, "http://profile-default:1")
    assert key_of(S3_URL, {"profile": "r2"}) == entry_name(S3_URL, "http://profile-r2:2")
    assert key_of(S3_URL, {"profile": "minio"}) == entry_name(S3_URL, "http://services-s3:3")
    monkeypatch.setenv("AWS_PROFILE", "r2")
    assert key_of(S3_URL) == entry_name(S3_URL, "http://profile-r2:2")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:4")
    assert key_of(S3_URL) == entry_name(S3_URL, "http://env:4")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://env-s3:5")
    assert key_of(S3_URL) == entry_name(S3_URL, "http://env-s3:5")
    assert key_of(S3_URL, {"client_kwargs": {"endpoint_url": "http://x:6"}}) == entry_name(
        S3_URL, "http://x:6"
    )
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert key_of(S3_URL) == default
    no_ambient_endpoint.write_text("[default]\nignore_configured_endpoint_urls = true\n")


def test_gcsfs_endpoint_forms_are_in_the_key(
    no_ambient_endpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = key_of(GS_URL)
    assert default == entry_name(GS_URL)
    emulator = entry_name(GS_URL, "http://localhost:4443")
    assert key_of(GS_URL, {"gs": {"endpoint_url": "http://localhost:4443"}}) == emulator
    assert key_of(GS_URL, {"gcs": {"endpoint_url": "http://localhost:4443"}}) == emulator
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")  # gcsfs adds http://
    assert key_of(GS_URL) == emulator
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "default")  # gcsfs: the real service
    assert key_of(GS_URL) == default
    monkeypatch.setenv("GOOGLE_CLOUD_UNIVERSE_DOMAIN", "example-universe.com")
    assert key_of(GS_URL) not in (default, emulator)
    monkeypatch.setenv("GOOGLE_CLOUD_UNIVERSE_DOMAIN", "googleapis.com")
    assert key_of(GS_URL) == default


SECRETS = ("AKIAEXAMPLEKEY", "s3cr3t-value", "t0ken-value", "sig-value")


@pytest.mark.parametrize(
    "storage_options",
    [
        {
            "s3": {
                "endpoint_url": "http://AKIAEXAMPLEKEY:s3cr3t-value@minio:9000/?X-Amz-Signature=sig-value"
            }
        },
        {
            "s3": {
                "client_kwargs": {"endpoint_url": "http://AKIAEXAMPLEKEY:s3cr3t-value@minio:9000"}
            }
        },
    ],
)
def test_credentials_never_reach_the_key(
    no_ambient_endpoint: Path, storage_options: dict[str, Any]
) -> None:
    """Credentials in an endpoint URL, or beside it, never reach the key: the entry is the
    same for every key pair, so rotating credentials keeps the cache."""
    with_keys = {
        "s3": {
            **storage_options["s3"],
            "key": "AKIAEXAMPLEKEY",
            "secret": "s3cr3t-value",
            "token": "t0ken-value",
        }
    }
    endpoint = store_endpoint(S3_URL, OpenOptions(storage_options=with_keys))
    assert endpoint == "http://minio:9000"
    assert canonical_url(S3_URL, endpoint) == f"{S3_URL} @http://minio:9000"
    assert key_of(S3_URL, with_keys) == key_of(S3_URL, storage_options)


def test_client_kwargs_endpoints_cache_separately(
    make_shards: Any, store: Path, tmp_path: Path, no_ambient_endpoint: Path
) -> None:
    """Two stores behind the same bucket and key, named only by ``client_kwargs``: two
    entries, each fetched once."""
    shards = make_shards([2])
    cache_dir = tmp_path / "cache"
    urls = [fakes.url_of(p) for p in shards.paths]
    for storage_options in (
        {"client_kwargs": {"endpoint_url": "http://a"}},
        {"client_kwargs": {"endpoint_url": "http://b"}},
    ):
        for _ in range(2):
            ds = wds.WebDataset(
                urls, shardshuffle=False, cache_dir=str(cache_dir), storage_options=storage_options
            )
            assert samples_of(ds) == shards.samples
    assert len(entries(cache_dir)) == 2
    assert fetches(store) == {str(shards.paths[0]): 2}


# --- symlinks planted in a shared cache directory -------------------------------------------


def _planted(cache_dir: Path, url: str) -> tuple[str, Path]:
    ShardCache(cache_dir)._ensure_ready()
    victim = cache_dir.parent / "victim.txt"
    victim.write_text("precious\n")
    return entry_name(url, store_endpoint(url, OpenOptions())), victim


def test_a_symlink_at_a_partial_files_name_is_never_written_through(
    make_shards: Any, store: Path, tmp_path: Path
) -> None:
    """Entry names are computable: another user of a shared cache directory can plant a
    symlink where a download will write. The cache never writes through it: a download
    (holding the entry's lock) removes whatever is at its partial file's name, the link
    itself, and writes a file of its own; the link's target is untouched."""
    shards = make_shards([3])
    url = fakes.url_of(shards.paths[0])
    cache_dir = tmp_path / "c"
    name, victim = _planted(cache_dir, url)
    (cache_dir / "data" / f"{name}.partial").symlink_to(victim)
    samples, _ = _read_through_cache([url], cache_dir)
    assert samples == shards.samples
    assert victim.read_text() == "precious\n"
    entry = cache_dir / "data" / name
    assert not entry.is_symlink()
    assert entry.read_bytes() == shards.paths[0].read_bytes()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kind", "where"),
    [
        ("fifo", "data"),
        ("directory", "data"),
        ("directory", "partial"),
        ("fifo", "lock"),
        ("directory", "lock"),
    ],
)
def test_a_fifo_or_directory_at_an_entrys_name_is_a_clear_error_not_a_hang(
    make_shards: Any, store: Path, tmp_path: Path, kind: str, where: str
) -> None:
    """A FIFO planted where the cache opens a file held the open forever; a directory at an
    entry's name, which cannot be removed, made the reader refetch in a loop. Either is
    refused at once with a CacheError naming the file. (A FIFO at a partial file's name is
    removed by the download that holds the lock, as a symlink there is.)"""
    shards = make_shards([3])
    url = fakes.url_of(shards.paths[0])
    cache_dir = tmp_path / "c"
    name, _ = _planted(cache_dir, url)
    path = {
        "data": cache_dir / "data" / name,
        "partial": cache_dir / "data" / f"{name}.partial",
        "lock": cache_dir / "locks" / f"{name}.lock",
    }[where]
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(wds.CacheError, match=f"{path.name}.* not a regular file") as info:
        _read_through_cache([url], cache_dir)
    if where == "data":
        assert url in str(info.value)


def test_a_symlink_at_a_metadata_name_is_replaced_not_written_through(
    make_shards: Any, store: Path, tmp_path: Path
) -> None:
    shards = make_shards([3])
    url = fakes.url_of(shards.paths[0])
    cache_dir = tmp_path / "c"
    name, victim = _planted(cache_dir, url)
    for planted in (f"{name}.json", f"{name}.members.json"):
        (cache_dir / "meta" / planted).symlink_to(victim)
    samples, _ = _read_through_cache([url], cache_dir)
    assert samples == shards.samples
    assert victim.read_text() == "precious\n"
    assert not (cache_dir / "meta" / f"{name}.json").is_symlink()
    warm, _ = _read_through_cache([url], cache_dir)  # its own files, read back
    assert warm == shards.samples


@pytest.mark.parametrize("sub", ["data", "meta", "locks", "stats"])
def test_a_cache_subdirectory_that_is_a_symlink_is_refused(
    make_shards: Any, store: Path, tmp_path: Path, sub: str
) -> None:
    shards = make_shards([3])
    url = fakes.url_of(shards.paths[0])
    cache_dir, outside = tmp_path / "c", tmp_path / "outside"
    cache_dir.mkdir()
    outside.mkdir()
    (cache_dir / sub).symlink_to(outside)
    with pytest.raises(wds.CacheError, match=f"{sub} is a symlink"):
        _read_through_cache([url], cache_dir)
    assert list(outside.iterdir()) == []


def test_metadata_files_follow_the_umask_like_the_data_files(tmp_path: Path) -> None:
    from cloudshards.cache.files import open_file, replace_with

    old = os.umask(0o077)  # a private cache: nothing in it readable by other users
    try:
        replace_with(str(tmp_path / "meta.json"), b"{}")
        os.close(open_file(str(tmp_path / "data.tar"), os.O_WRONLY | os.O_CREAT))
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in tmp_path.iterdir()}
    assert modes == {"meta.json": 0o600, "data.tar": 0o600}
