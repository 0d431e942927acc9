"""A reader of a cache file that another process is still downloading, as it grows."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from cloudshards.cache import lock as _cachelock
from cloudshards.cache.files import inode_at
from cloudshards.cache.handoff import Handoff
from cloudshards.cache.lock import is_locked, is_poisoned
from cloudshards.cache.membertable import MemberTable, write_table
from cloudshards.cache.stats import CacheStats
from cloudshards.errors import ShardOpenError
from cloudshards.redact import redact_url
from cloudshards.source import ShardSource
from cloudshards.types import ClosingStream

logger = logging.getLogger(__name__)


class FollowStream(ClosingStream):
    """Reads a cache file that another process is still downloading, as it grows.

    At the current end of the file it checks: the entry was committed (the file we hold was
    renamed into place) means the real end; the downloader's lock is free without a commit
    means it died or stopped, and ``take_over()`` returns a stream of the shard from its
    first byte, read up to our offset and checked against what we read (an object replaced
    since must not continue the bytes of its former version), unless the downloader marked
    the file as failing verification (see :data:`~cloudshards.cache.lock.POISONED_MODE`):
    the bytes read so far may be wrong, and ``read`` raises instead.

    Args:
        fd: An open descriptor of the partial file.
        url: The shard URL (for errors).
        entry: Path the partial file is renamed to when complete.
        lock_path: The downloader's lock file.
        take_over: Returns a replacement stream, from the shard's first byte.
        handoff: The blocks of this process's own download ahead of the file, if it is one:
            read from memory while they are held, and waited for instead of polling.
    """

    POLL_MIN_S = 0.002
    POLL_MAX_S = 0.05
    #: How long the file may stay as it is, its downloader alive, before this reader reads
    #: the rest from the store itself: a downloader that stopped reading (an iterator left
    #: alive, a paused process) would otherwise hold it forever.
    STALL_S = 60.0

    def __init__(
        self,
        fd: int,
        url: str,
        *,
        entry: str,
        lock_path: str,
        stats: CacheStats,
        take_over: Callable[[], ShardSource],
        on_close: Callable[[], None],
        handoff: Handoff | None = None,
    ) -> None:
        self.fd = fd
        self.url = url
        self.entry = entry
        self.lock_path = lock_path
        self.stats = stats
        self._take_over = take_over
        self._on_close = on_close
        self._replacement: ShardSource | None = None
        self._handoff = handoff
        self._inode = os.fstat(fd).st_ino
        self.offset = 0
        self.closed = False

    def wait_for_bytes(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until this process's own download has its first
        bytes, or has ended; at once when it is another process's."""
        if self._handoff is not None:
            self._handoff.wait(0, timeout)

    def read(self, size: int = -1) -> bytes:
        """Return the next bytes, waiting for the downloader when we have caught up."""
        return bytes(self.read_view(size))

    def read_view(self, size: int = -1) -> bytes | memoryview:
        """:meth:`read`, with the blocks of this process's own download ahead handed on from
        memory as they came (see :mod:`cloudshards.cache.handoff`)."""
        if self._replacement is not None:
            return self._replacement.read(size)
        if size == 0:
            return b""
        delay = self.POLL_MIN_S
        handoff = self._handoff
        waited_since = time.monotonic()
        while True:
            data: bytes | memoryview | None = None
            if handoff is not None:
                data = handoff.take(self.offset, size)
            if not data:
                data = self._pread(self._readable(size))
            if data:
                self.offset += len(data)
                self.stats.bytes_disk += len(data)
                if handoff is not None:
                    handoff.reader_at(self.offset)
                return data
            _cachelock._checkpoint("follower_caught_up")
            if handoff is not None and self.offset >= handoff.end:
                if handoff.error is not None:  # this process's own download failed
                    raise handoff.error
                if handoff.stream is not None:  # ... or its disk filled up: the rest
                    self._replacement = self._release_handoff()
                    return self._replacement.read(size)
                if handoff.complete:  # ... or it published the whole object: the end
                    return b""
            # The process's own download has timeouts of its own: never a second download.
            own = handoff is not None and not handoff.finished
            stalled = not own and time.monotonic() - waited_since > self.STALL_S
            unlocked = not is_locked(self.lock_path) or self._replaced()
            if unlocked and handoff is not None and _more_from(handoff, self.offset):
                unlocked = False  # this process's download: what it hands on comes next
            if self._committed() or stalled or unlocked:
                # Committed means no more writes, so one more read is authoritative: the
                # bytes written between our last read and the commit are still to come.
                # (The downloader renames before it unlocks, so a free lock is checked the
                # same way.)
                if self._committed():
                    data = self._pread(size)
                    self.offset += len(data)
                    self.stats.bytes_disk += len(data)
                    return data
                if is_poisoned(self.fd):
                    raise ShardOpenError(
                        "cache: the download this reader followed does not match the store's "
                        "checksum; bytes already read from it may be wrong: read the shard again",
                        url=self.url,
                        offset=self.offset,
                    )
                if stalled:
                    logger.warning(
                        "cache: the download of %s this reader follows made no progress for "
                        "%.0f s; reading the rest from the store",
                        redact_url(self.url),
                        self.STALL_S,
                    )
                else:
                    logger.info(
                        "cache: download of %s was abandoned; taking over", redact_url(self.url)
                    )
                handed = self._release_handoff()
                if handed is not None:  # cannot be: it is taken above; never left open
                    handed.close()
                self._replacement = self._caught_up(self._take_over())
                return self._replacement.read(size)
            if handoff is not None:
                handoff.wait(self.offset, delay)  # woken by the next block
            else:
                time.sleep(delay)
            delay = min(delay * 2, self.POLL_MAX_S)

    def _readable(self, size: int) -> int:
        """``size``, or less: no further than this process's own download published while it
        runs (a byte in the file it has not published may be followed by a full disk, and the
        rest of the download handed over from there)."""
        handoff = self._handoff
        if handoff is None or handoff.finished:
            return size
        return max(0, min(size if size > 0 else 1 << 22, handoff.end - self.offset))

    def _pread(self, size: int) -> bytes:
        if size == 0:
            return b""
        return os.pread(self.fd, size if size > 0 else 1 << 22, self.offset)

    def _release_handoff(self) -> Any:
        """Let the download's handoff go; return the stream it handed over, if any."""
        if self._handoff is None:
            return None
        handoff, self._handoff = self._handoff, None
        return handoff.release()

    def _caught_up(self, replacement: ShardSource) -> ShardSource:
        """``replacement`` read up to this reader's offset, each byte the one read from the
        file (kept open for this).

        Raises:
            ShardOpenError: The store's object is not the one read so far (replaced since).
        """
        at = 0
        try:
            while at < self.offset:
                data = replacement.read(min(self.offset - at, 1 << 22))
                if not data or os.pread(self.fd, len(data), at) != data:
                    raise ShardOpenError(
                        "the object changed while it was read (the store's bytes are not the "
                        "ones read from the download this reader followed)",
                        url=self.url,
                        offset=at,
                    )
                at += len(data)
        except BaseException:
            replacement.close()
            raise
        fd, self.fd = self.fd, -1  # checked: the old file's space goes back to the disk
        os.close(fd)
        return replacement

    def _replaced(self) -> bool:
        """Whether another reader took the download over into a new file (ours, the old one,
        stays readable through our descriptor)."""
        return inode_at(f"{self.entry}.partial") not in (None, self._inode)

    def _committed(self) -> bool:
        return inode_at(self.entry) == self._inode

    #: Where the entry's member table goes (set by the cache); None: not saved.
    table_path: str | None = None

    #: How long a reader that parsed the whole shard waits for the downloader's commit.
    COMMIT_WAIT_S = 10.0

    def save_member_table(self, table: MemberTable) -> None:
        """Save the member table of the entry we followed, once it is committed (and only if
        we read the committed file itself, not a replacement stream).

        The parse ends at the end-of-archive marker, often before the downloader has written
        the record padding after it, verified and renamed the file: wait for that commit
        while the downloader still holds its lock (bounded), or the entry never gets a table
        and every later epoch parses it again. The commit itself deletes an older entry's
        table, which is why ours can only be written after it.
        """
        if self.table_path is None or self._replacement is not None or self.fd < 0:
            return
        handoff = self._handoff
        tee = handoff.tee if handoff is not None else None
        if handoff is not None and tee is not None:
            # This process's own download: it saves the table as it commits the entry, or
            # this reader does now if it has (the entry still the file read: not evicted and
            # replaced since). The reader goes on once the download has ended, woken then, as
            # below: under a byte budget, the next shard's room may be this entry's, which can
            # only be evicted once it is in place.
            if tee.tables.give(table):
                if self._committed():
                    write_table(self.table_path, table, os.fstat(self.fd).st_size)
                return
            handoff.wait_finished(self.COMMIT_WAIT_S)
            if tee.committed or not handoff.finished:
                return  # saved with the entry, or it will be once that commits
            # Ended without a commit: another process may have taken the download over.
        deadline = time.monotonic() + self.COMMIT_WAIT_S
        delay = self.POLL_MIN_S
        while not self._committed():
            if not is_locked(self.lock_path) or time.monotonic() > deadline:
                if not self._committed():  # the downloader renames before it unlocks
                    return
                break
            time.sleep(delay)
            delay = min(delay * 2, self.POLL_MAX_S)
        write_table(self.table_path, table, os.fstat(self.fd).st_size)

    def close(self) -> None:
        """Close the file (and any replacement stream). Never raises: it runs in ``finally``
        blocks and at garbage collection, outside the consumer's error handler."""
        if self.closed:
            return
        self.closed = True
        handed = self._release_handoff()  # a download of its own stops (see ahead)
        if handed is not None:  # handed over, never reached: ours to close
            self._replacement = self._replacement or handed
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError as exc:
                logger.debug("cache: closing %s: %s", self.entry, exc)
        try:
            if self._replacement is not None:
                self._replacement.close()
        except Exception as exc:  # see the docstring
            logger.debug("cache: closing the stream of %s: %s", redact_url(self.url), exc)
        finally:
            self._on_close()


def _more_from(handoff: Handoff, offset: int) -> bool:
    """Whether this process's download may still hand the reader at ``offset`` something:
    bytes, its stream or its error (looked at once, after the reader's last look)."""
    return (
        not handoff.finished
        or handoff.end > offset
        or handoff.stream is not None
        or handoff.error is not None
    )
