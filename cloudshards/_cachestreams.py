"""The byte streams behind the node cache: tee-to-disk for the downloader, and a reader that
follows a file another process is still writing."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cloudshards._membertable import MemberTable, write_table
from cloudshards.errors import CacheError, ShardOpenError
from cloudshards.redact import redact_url
from cloudshards.types import ByteSource, ClosingStream

logger = logging.getLogger(__name__)

#: Errors that mean "the disk cannot take this entry": degrade to uncached streaming.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


@dataclass
class CacheStats:
    """Per-process cache counters.

    Attributes:
        hits: Shards served from a complete entry.
        misses: Shards this process downloaded (and cached), itself or ahead in the background.
        waits: Shards read by following another process's download.
        uncached: Shards streamed without caching (disk full, over budget, early stop).
        bytes_network: Bytes this process read from the store through the cache.
        bytes_disk: Bytes read from cache files (a shard this process downloaded ahead counts
            as a miss only: reading it back is part of that download, not a hit).
        evictions: Entries this process evicted.
    """

    hits: int = 0
    misses: int = 0
    waits: int = 0
    uncached: int = 0
    bytes_network: int = 0
    bytes_disk: int = 0
    evictions: int = 0
    _warned: set[str] = field(default_factory=set, repr=False)
    #: Entries this process downloaded ahead that its consumer has not opened yet.
    _ahead: set[str] = field(default_factory=set, repr=False)
    #: Downloads ahead start once this process has committed an entry, and never after the
    #: disk filled up: they must not cost a second download of what cannot be cached.
    _committed_one: bool = field(default=False, repr=False)
    _disk_full: bool = field(default=False, repr=False)

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class DownloadLock:
    """An exclusive ``flock`` on a lock file: released by the kernel if the process dies.

    ``with DownloadLock(path):`` waits for the lock; :meth:`try_acquire` does not.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def try_acquire(self, *, wait: bool = False) -> bool:
        """Take the lock (without waiting unless ``wait``); True on success."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def __enter__(self) -> DownloadLock:
        self.try_acquire(wait=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def is_locked(path: str) -> bool:
    """True when another process holds the download lock at ``path``."""
    lock = DownloadLock(path)
    if lock.try_acquire():
        lock.release()
        return False
    return True


class TeeStream(ClosingStream):
    """Reads the store and writes every byte to ``partial``; commits the entry at the end.

    The consumer gets the bytes as they arrive (stream-through), so a cold read through the
    cache costs one extra ``write`` per block. A write that fails because the disk is full
    drops the partial file and carries on as a plain stream. Closing before the end abandons
    the partial file (followers then take over the download).

    Args:
        remote: The open store stream.
        partial: Path of the partial file to write.
        commit: Called with the verified byte count at the end: renames the entry into place.
        abandon: Called when the partial file is given up (removes it, releases the lock).
        expected_size: Size the store reported, verified at the end when known.
        expected_md5: Hex MD5 to verify (an S3 single-part ETag), when known.
        skip: Bytes already delivered to this consumer (taking over a dead download).
    """

    def __init__(
        self,
        remote: ByteSource,
        partial: str,
        *,
        commit: Callable[[int], None],
        abandon: Callable[[], None],
        on_close: Callable[[], None],
        stats: CacheStats,
        expected_size: int | None,
        expected_md5: str | None,
        skip: int = 0,
    ) -> None:
        self.remote = remote
        self.url = remote.url
        self.partial = partial
        self._commit = commit
        self._abandon = abandon
        self._on_close = on_close
        self.stats = stats
        self.expected_size = expected_size
        self._md5 = hashlib.md5(usedforsecurity=False) if expected_md5 else None
        self._expected_md5 = expected_md5
        self._skip = skip
        self.offset = 0  # bytes delivered to the consumer
        self._written = 0
        self._fd: int | None = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.closed = False
        #: Set by the reader after a complete parse; saved next to the entry on commit.
        self.member_table: MemberTable | None = None

    def save_member_table(self, table: MemberTable) -> None:
        """Keep the member table of this shard, to be saved with the entry when it commits."""
        self.member_table = table

    def read(self, size: int = -1) -> bytes:
        """Read from the store, write to disk, return the bytes for the consumer."""
        while True:
            data = self.remote.read(size)
            if not data:
                self._finish()
                return b""
            self.stats.bytes_network += len(data)
            self._write(data)
            if self._skip:
                drop = min(self._skip, len(data))
                self._skip -= drop
                data = data[drop:]
                if not data:
                    continue
            self.offset += len(data)
            return data

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            return
        if self._md5 is not None:
            self._md5.update(data)
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            self._written += len(data)
        except OSError as exc:
            if exc.errno not in DISK_FULL_ERRNOS:
                raise CacheError(f"cannot write cache file {self.partial}: {exc}") from exc
            self._degrade(f"cache disk full ({exc.strerror}); streaming without caching")

    def _degrade(self, reason: str) -> None:
        self.stats._disk_full = True
        if reason not in self.stats._warned:
            self.stats._warned.add(reason)
            logger.warning("%s", reason)
        self.stats.misses -= 1
        self.stats.uncached += 1
        self._drop_partial()

    @property
    def partial_dropped(self) -> bool:
        """The partial file was given up mid-way (disk full): later bytes are not cached."""
        return self._fd is None and not self.closed and self._written < (self.expected_size or 0)

    def _drop_partial(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._abandon()

    def _finish(self) -> None:
        if self._fd is None:
            return
        if self.expected_size is not None and self._written != self.expected_size:
            self._drop_partial()
            raise ShardOpenError(
                f"incomplete download: got {self._written} bytes, the store says "
                f"{self.expected_size}",
                url=self.url,
                offset=self._written,
            )
        if self._md5 is not None and self._md5.hexdigest() != self._expected_md5:
            self._drop_partial()
            raise ShardOpenError(
                "downloaded bytes do not match the store's checksum (ETag)", url=self.url
            )
        fd, self._fd = self._fd, None
        os.close(fd)
        self._commit(self._written)

    #: At close, a remainder up to this size is still downloaded to complete the entry: tar
    #: readers stop at the end-of-archive marker, before the record padding after it.
    DRAIN_MAX_BYTES = 16 << 20

    def close(self) -> None:
        """Close the store stream, completing the entry when little is left to read;
        otherwise (the consumer stopped early) the partial file is abandoned."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._fd is not None:
                self._drain()
            if self._fd is not None:
                # The consumer stopped early with much left: not cached after all.
                self.stats.misses -= 1
                self.stats.uncached += 1
            self._drop_partial()
        finally:
            self.remote.close()
            self._on_close()

    def _drain(self) -> None:
        remaining = self.expected_size - self._written if self.expected_size is not None else None
        if remaining is not None and remaining > self.DRAIN_MAX_BYTES:
            return
        budget = self.DRAIN_MAX_BYTES
        while self._fd is not None and budget > 0:
            data = self.remote.read(min(budget, 1 << 22))
            if not data:
                self._finish()
                return
            budget -= len(data)
            self.stats.bytes_network += len(data)
            self._write(data)


class FollowStream(ClosingStream):
    """Reads a cache file that another process is still downloading, as it grows.

    At the current end of the file it checks: the entry was committed (the file we hold was
    renamed into place) means the real end; the downloader's lock is free without a commit
    means it died, and ``take_over(offset)`` returns a stream that continues for us.

    Args:
        fd: An open descriptor of the partial file.
        url: The shard URL (for errors).
        entry: Path the partial file is renamed to when complete.
        lock_path: The downloader's lock file.
        take_over: Returns a replacement stream that skips ``offset`` delivered bytes.
    """

    POLL_MIN_S = 0.002
    POLL_MAX_S = 0.05

    def __init__(
        self,
        fd: int,
        url: str,
        *,
        entry: str,
        lock_path: str,
        stats: CacheStats,
        take_over: Callable[[int], ByteSource],
        on_close: Callable[[], None],
    ) -> None:
        self.fd = fd
        self.url = url
        self.entry = entry
        self.lock_path = lock_path
        self.stats = stats
        self._take_over = take_over
        self._on_close = on_close
        self._replacement: ByteSource | None = None
        self._inode = os.fstat(fd).st_ino
        self.offset = 0
        self.closed = False

    def read(self, size: int = -1) -> bytes:
        """Return the next bytes, waiting for the downloader when we have caught up."""
        if self._replacement is not None:
            return self._replacement.read(size)
        delay = self.POLL_MIN_S
        while True:
            data = os.read(self.fd, size if size > 0 else 1 << 22)
            if data:
                self.offset += len(data)
                self.stats.bytes_disk += len(data)
                return data
            if self._committed() or not is_locked(self.lock_path):
                # Committed means no more writes, so one more read is authoritative: the
                # bytes written between our last read and the commit are still to come.
                # (The downloader renames before it unlocks, so a free lock is checked the
                # same way.)
                if self._committed():
                    data = os.read(self.fd, size if size > 0 else 1 << 22)
                    self.offset += len(data)
                    self.stats.bytes_disk += len(data)
                    return data
                logger.info(
                    "cache: download of %s was abandoned; taking over", redact_url(self.url)
                )
                os.close(self.fd)
                self.fd = -1
                self._replacement = self._take_over(self.offset)
                return self._replacement.read(size)
            time.sleep(delay)
            delay = min(delay * 2, self.POLL_MAX_S)

    def _committed(self) -> bool:
        try:
            return os.stat(self.entry).st_ino == self._inode
        except FileNotFoundError:
            return False

    #: Where the entry's member table goes (set by the cache); None: not saved.
    table_path: str | None = None

    def save_member_table(self, table: MemberTable) -> None:
        """Save the member table of the entry we followed, once it is committed (and only if
        we read the committed file itself, not a replacement stream)."""
        if self.table_path is None or self._replacement is not None or not self._committed():
            return
        write_table(self.table_path, table, os.fstat(self.fd).st_size)

    def close(self) -> None:
        """Close the file (and any replacement stream)."""
        if self.closed:
            return
        self.closed = True
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            if self._replacement is not None:
                self._replacement.close()
        finally:
            self._on_close()
