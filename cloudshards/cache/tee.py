"""The downloader's byte stream behind the node cache: it serves its consumer from the store
while writing the entry to disk, verifies the download, and commits the entry."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from cloudshards.cache.direct import PartialWriter
from cloudshards.cache.facts import Checksum, Hasher
from cloudshards.cache.files import open_file
from cloudshards.cache.lock import POISONED_MODE, is_disk_full
from cloudshards.cache.membertable import MemberTable, write_table
from cloudshards.cache.pending import PendingTable
from cloudshards.cache.recheck import WHY, recheck_download
from cloudshards.cache.stats import CacheStats, warn_disk_full
from cloudshards.errors import CacheError, ShardOpenError
from cloudshards.redact import redact_url
from cloudshards.source import ShardSource
from cloudshards.types import ClosingStream

__all__ = ["TeeStream"]

logger = logging.getLogger(__name__)


class TeeStream(ClosingStream):
    """Reads the store and writes every byte to ``partial``; commits the entry at the end.

    The consumer gets the bytes as they arrive (stream-through): one extra ``write`` per
    block (see :mod:`~cloudshards.cache.direct`). A full disk drops the partial file and
    carries on as a plain stream. Closing before the end abandons the partial file
    (followers then take over the download); nothing raises from ``close``.

    With a checksum to verify, the last :attr:`HOLD_BYTES` of the object are held back (in
    memory, and out of the partial file that followers read) until the whole download has
    been verified: no reader finishes a shard (its end-of-archive blocks) on bytes that were
    not verified. On a mismatch the object is fetched once more and compared (see
    :func:`~cloudshards.cache.recheck.recheck_download`).

    Args:
        remote, partial: The open store stream; the path of the partial file to write.
        commit: Called with the verified byte count at the end (renames the entry into place);
            False when it could not.
        abandon: Called when the partial file is given up (removes it, releases the lock).
        expected_size: Size the store reported, verified at the end when known.
        checksum: The checksum to verify, if the store guarantees one (see
            :func:`~cloudshards.cache.facts.trusted_checksum`).
        refetch: Opens the object again from its start, to recheck a checksum mismatch.
        distrust: Called when the store's checksum proves not to be one of its bytes.
        fd: The partial file, already open for writing (None: open ``partial`` here).
    """

    #: Bytes at the end of a verified download that are served only after verification.
    HOLD_BYTES = 1 << 20
    END_BYTES = 64 << 10  #: Of those, never served unverified (see :meth:`_serve_held_then`).

    def __init__(
        self,
        remote: ShardSource,
        partial: str,
        *,
        commit: Callable[[int], bool],
        abandon: Callable[[], None],
        on_close: Callable[[], None],
        stats: CacheStats,
        expected_size: int | None,
        checksum: Checksum | None,
        refetch: Callable[[], ShardSource] | None = None,
        distrust: Callable[[], None] | None = None,
        fd: int | None = None,
    ) -> None:
        self.remote = remote
        self.url = remote.url
        self.partial = partial
        self._commit = commit
        self._abandon = abandon
        self._on_close = on_close
        self.stats = stats
        self.expected_size = expected_size
        self._digest: Hasher | None = checksum.hasher() if checksum else None
        self._checksum = checksum
        self._refetch = refetch
        self._distrust = distrust
        # Bytes delivered to the consumer, read from the store, in the partial file.
        self.offset = self._received = self._written = 0
        self._hold_from: int | None = None
        if checksum and expected_size is not None:
            self._hold_from = max(0, expected_size - self.HOLD_BYTES)
        self._held = bytearray()  # received at or after _hold_from, not verified yet
        self._prefix_digest: Hasher | None = None  # of the bytes before _hold_from
        self._tail: memoryview | None = None  # the held bytes, being served
        self._failed_after: Exception | None = None  # raised once the held bytes are served
        self._keep = True  # False: verified as consistent but not cached after all
        self._committed = False
        self._cancelled = False  # closing abandons the partial file, however little is left
        self._store_failed = False  # a read of the store raised (after its own retries)
        #: Not cached nor this stream's to count: a cancelled download ahead, or one handed back.
        self.handed_back = False
        self._error: ShardOpenError | None = None
        # The store stream's read_view where it has one (parts as views, not copied).
        self._read_remote: Callable[[int], bytes | memoryview]
        self._read_remote = getattr(remote, "read_view", remote.read)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self._fd: int | None = open_file(partial, flags) if fd is None else fd
        self._writer = PartialWriter(self._fd)
        self.entry: str | None = None  #: The entry's path (set by the cache with table_path).
        self.closed = False
        self.tables = PendingTable()  # the reader's member table, saved with the entry
        self.table_path: str | None = None  #: Where the member table goes (None: not saved).

    def save_member_table(self, table: MemberTable) -> None:
        """Keep the shard's member table, saved with the entry when it commits; or save it now
        if the entry committed first (a verified download commits once the store's last byte
        is in, before the reader parsed the held-back end) and is still this file."""
        if self.tables.give(table) and self.table_path and self.tables.in_place():
            write_table(self.table_path, table, self._written)
        self.tables.unpin()  # the one table of the shard: given, written or not

    def read(self, size: int = -1) -> bytes:
        """Read from the store, write to disk, return the bytes for the consumer.

        Raises:
            ShardOpenError: The download is shorter or longer than the store said, or does
                not match its checksum in a way that may have reached this reader; or the
                store failed (after the bytes before the failure).
        """
        if size < 0:  # everything: the held-back end comes in a separate chunk
            return b"".join(iter(lambda: self.read(1 << 22), b""))
        return bytes(self.read_view(size))

    def read_view(self, size: int = -1) -> bytes | memoryview:
        """:meth:`read`, handing on a part as the store stream handed it on (a read-only view:
        :meth:`PartStream.read_view <cloudshards.source.parts.PartStream.read_view>`),
        written and parsed without a copy. ``size`` < 0: up to 4 MiB."""
        if self._error is not None:
            raise self._error
        if size == 0:
            return b""
        if size < 0:
            size = 1 << 22
        while True:
            data: bytes | memoryview
            if self._tail is not None:
                count = min(size, len(self._tail))
                if not count:
                    if self._failed_after is not None:
                        raise self._failed_after
                    return b""
                data, self._tail = self._tail[:count], self._tail[count:]
            else:
                try:
                    data = self._read_remote(size)
                except Exception as exc:
                    self._store_failed = True  # its retries are spent: close() does not drain
                    if not self._held:
                        raise
                    self._serve_held_then(exc)
                    continue
                except BaseException:
                    self._store_failed = True
                    raise
                if not data:
                    self._at_end(recheck=True)
                    if self._tail is None:
                        return b""
                    continue
                self.stats.bytes_network += len(data)
                data = self._take(data)
            if data:
                self.offset += len(data)
                return data

    def _serve_held_then(self, error: Exception) -> None:
        """The store failed (after its retries): serve the bytes held back for verification,
        then raise ``error``, as an uncached reader gets every byte before a failure (a shard
        under :attr:`HOLD_BYTES` gave no sample), but for its last :attr:`END_BYTES`: a reader
        that got its end-of-archive blocks would end the shard on them, without the error.
        Followers check them when taking over."""
        end = (self.expected_size or 0) - self.END_BYTES - (self._hold_from or 0)
        held = bytes(self._held[: max(0, end)])
        self._held.clear()
        self._write(held)
        self._tail, self._failed_after = memoryview(held), error

    def _take(self, data: bytes | memoryview) -> bytes | memoryview:
        """Write ``data`` (or hold back its part at the end); return what may be served now."""
        start = self._received
        self._received += len(data)
        if self._digest is None or self._hold_from is None or self._fd is None:
            if self._digest is not None and self._fd is not None:
                self._digest.update(data)
            self._write(data)
            return data
        cut = max(0, self._hold_from - start)
        if cut >= len(data):
            self._digest.update(data)
            self._write(data)
            return data
        front, back = data[:cut], data[cut:]
        self._digest.update(front)
        if self._prefix_digest is None:
            self._prefix_digest = self._digest.copy()
        self._digest.update(back)
        self._write(front)
        self._held += back
        if self._fd is None:  # the disk filled up: nothing is verified or held any more
            front, self._hold_from = bytes(front) + bytes(self._held), None
            self._held.clear()
        elif self.expected_size is not None and self._received > self.expected_size:
            self._fail(f"the store sent more than the {self.expected_size} bytes it said")
        return front

    def _write(self, data: bytes | memoryview, *, last: bool = False) -> None:
        """Append ``data`` to the partial file; ``last``: and everything still buffered."""
        if self._fd is None:
            return
        try:
            if data:
                self._writer.write(data)
            if last:
                self._writer.finish()
            self._written = self._writer.written
        except OSError as exc:
            if not is_disk_full(exc):
                self._drop_partial()
                raise CacheError(f"cannot write cache file {self.partial}: {exc}") from exc
            warn_disk_full(self.stats, exc)
            self._drop_partial()

    @property
    def committed(self) -> bool:
        """The entry is in place."""
        return self._committed

    @property
    def partial_dropped(self) -> bool:
        """The partial file was given up mid-way: later bytes are not cached."""
        return self._fd is None and not self._committed and not self.closed

    def _drop_partial(self, *, poison: bool = False) -> None:
        """Give the partial file up (the shard is not cached after all); with ``poison``,
        followers that read it get an error instead of taking the download over."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self._writer.release()
        if poison:
            try:
                os.fchmod(fd, POISONED_MODE)
            except OSError as exc:
                logger.debug("cache: cannot mark %s as bad: %s", self.partial, exc)
        try:
            os.close(fd)
        except OSError as exc:
            logger.debug("cache: closing %s: %s", self.partial, exc)
        self._abandon()

    def _fail(self, reason: str) -> None:
        """Bytes from this download may have reached readers wrong: raise to this one (now and
        on every later read), and to every follower."""
        self._drop_partial(poison=True)
        self._error = ShardOpenError(f"cache: {reason}", url=self.url, offset=self._received)
        raise self._error

    def _at_end(self, *, recheck: bool) -> None:
        """The store has no more bytes: verify them, then complete the entry."""
        if self._fd is None:
            return  # not cached (disk full): nothing to verify
        if self.expected_size is not None and self._received != self.expected_size:
            got, said = self._received, self.expected_size
            self._fail(f"incomplete download: got {got} bytes, the store says {said}")
        expected = self._checksum.hexdigest if self._checksum is not None else None
        if self._digest is None or self._digest.hexdigest() == expected:
            self._complete(bytes(self._held))
            return
        if self._hold_from is None or not recheck or self._refetch is None:
            self._fail("downloaded bytes do not match the store's checksum")
        assert self._hold_from is not None
        assert self._refetch is not None
        assert self._checksum is not None  # set together with the digest
        verdict, tail = recheck_download(
            self._refetch,
            self.stats,
            url=self.url,
            served=self._hold_from,
            size=self.expected_size,
            checksum=self._checksum,
            first_hex=self._digest.hexdigest(),
            prefix=self._prefix_digest,
        )
        if verdict == "tail":
            logger.warning(
                "cache: the end of a download of %s did not match the store's checksum; "
                "fetched it again, and the second download matched",
                redact_url(self.url),
            )
            self._complete(tail)
        elif verdict == "checksum":
            logger.warning(
                "cache: the store's checksum of %s is not one of its bytes (two downloads "
                "agree with each other, not with it); streaming it without caching, and not "
                "using this store's checksums from now on",
                redact_url(self.url),
            )
            if self._distrust is not None:
                self._distrust()
            self._keep = False
            self._complete(bytes(self._held))
        else:
            self._fail(f"downloaded bytes do not match the store's checksum, {WHY[verdict]}")

    def _complete(self, tail: bytes) -> None:
        """Write the verified held-back bytes, commit the entry (unless not kept), and serve
        those bytes from memory."""
        self._write(tail, last=True)
        if self._hold_from is not None:
            self._held.clear()
            self._tail = memoryview(tail)
        if self._fd is None or not self._keep:
            return
        fd, self._fd = self._fd, None
        self._writer.release()
        self.tables.pin(self.entry, fd)  # held until closed: see save_member_table
        try:
            os.close(fd)  # a network filesystem reports a failed write-back here
        except OSError as exc:
            self._abandon()
            self._not_kept(exc)
            return
        if self._commit(self._written):  # with the table it took (see PendingTable)
            self._committed = True
            self.stats.misses += 1
            late = self.tables.committed()
            if late is not None and self.table_path and self.tables.in_place():
                write_table(self.table_path, late, self._written)

    def _not_kept(self, exc: OSError) -> None:
        if is_disk_full(exc):
            warn_disk_full(self.stats, exc)
        else:
            logger.warning("cache: cannot complete %s (%s); not cached", self.partial, exc)

    def cancel(self) -> bool:
        """Close without completing the entry (a download ahead nobody wants any more),
        abandoning the partial file; True when that gave up a download in progress."""
        done = self._tail is not None and not self._store_failed  # verified, not a failure's
        unfinished = not self.closed and self._fd is not None and self._keep and not done
        self._cancelled = True
        self.handed_back = self.handed_back or unfinished
        self.close()
        return unfinished

    #: A remainder up to this size is still fetched at close (tar readers stop before padding).
    DRAIN_MAX_BYTES = 16 << 20

    def close(self) -> None:
        """Close the store stream, completing the entry when little is left to read; else
        (the consumer stopped early) the partial file is abandoned. Never raises (``finally``
        blocks, garbage collection): a remainder that cannot be completed or verified is not
        cached (with a warning when it failed verification)."""
        if self.closed:
            return
        self.closed = True
        try:
            stopped = self._cancelled or self._store_failed
            if self._fd is not None and self._keep and self._tail is None and not stopped:
                try:
                    self._drain()
                except Exception as exc:  # see the docstring: nothing escapes close()
                    if exc is self._error:
                        logger.warning("%s; not cached (bytes already read may be wrong)", exc)
                    else:
                        logger.debug("cache: not caching %s: %s", redact_url(self.url), exc)
            self._drop_partial()
        finally:
            if not self._committed and not self.handed_back:
                self.stats.uncached += 1  # each shard counts once: a miss (cached) or this
            self.tables.unpin()
            try:
                self.remote.close()
            except Exception as exc:  # see the docstring
                logger.debug("cache: closing the store stream of %s: %s", self.url, exc)
            self._on_close()

    def _drain(self) -> None:
        budget = self.DRAIN_MAX_BYTES
        if self.expected_size is not None and self.expected_size - self._received > budget:
            return
        while self._fd is not None:
            data = self._read_remote(1 << 22)
            if not data:  # the end: a remainder of exactly the budget completes too
                self._at_end(recheck=False)
                return
            self.stats.bytes_network += len(data)
            budget -= len(data)
            if budget < 0:  # the size was unknown, and more is left than is worth it
                return
            self._take(data)
