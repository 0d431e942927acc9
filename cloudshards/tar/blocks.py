"""Byte-level plumbing of the tar reader: a block buffer over the stream (decompressed by
:class:`~cloudshards.tar.decompress.DecompressReader` when it is gzip, bzip2 or xz).

Used by :mod:`cloudshards.tar.members` only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cloudshards.errors import ShardFormatError, ShardOpenError
from cloudshards.redact import redact_url
from cloudshards.tar.decompress import MAGIC_BYTES, DecompressReader, compression_of
from cloudshards.tar.headers import BLOCK, ZERO_BLOCK

__all__ = ["MAX_OFFSET", "BlockReader", "describe_size"]

logger = logging.getLogger(__name__)

#: Largest offset a member may reach: seek(), the member table and the index keep offsets as
#: signed 64-bit integers, and no real stream is longer.
MAX_OFFSET = (1 << 63) - 1


def describe_size(size: int) -> str:
    """A size for a message: exact when plausible, else its magnitude (``str()`` of a huge int
    is slow, and raises ValueError past 4300 digits)."""
    return str(size) if size < 1 << 64 else f"at least 2**{size.bit_length() - 1}"


class BlockReader:
    """A buffer of large reads over a tar stream.

    ``buf[pos:]`` holds the bytes not yet consumed; ``base`` is the offset of ``buf[0]`` in the
    uncompressed stream. The tar loop slices ``buf`` directly and calls these methods only when
    it runs past the end of ``buf``.
    """

    __slots__ = (
        "_stream_read", "base", "block_bytes", "buf", "compressed", "failure", "pos", "read",
        "seekable", "spare", "spare_pos", "url",
    )  # fmt: skip

    def __init__(self, stream: Any, url: str | None, block_bytes: int) -> None:
        self.url = url
        self.block_bytes = block_bytes
        self.base = 0
        self.pos = 0
        # A stream that can hand on its blocks without copying them does (PartStream's
        # obstore parts): the loop in members.py makes bytes of what it slices from them.
        self.read: Callable[[int], bytes] = getattr(stream, "read_view", stream.read)
        self.buf = b""
        # A block read whole to complete a straddling header or member, and where its unread
        # rest starts: the next fill takes it as its buffer, without a copy (see fill).
        self.spare = b""
        self.spare_pos = 0
        self._stream_read = self.read
        self.seekable: Any = stream  # set below; not None here, so fill(2) keeps no spare
        self.fill(MAGIC_BYTES)
        #: The decompressed stream of a gzip, bzip2 or xz shard; None for a plain tar.
        self.compressed: DecompressReader | None = None
        kind = compression_of(bytes(self.buf[:MAGIC_BYTES]))
        if kind is not None:
            # Uncompressed tars never touch a decompressor: the check above is their only cost.
            self.compressed = DecompressReader(stream, bytes(self.buf), url, block_bytes, kind)
            self.read = self.compressed.read
            self.buf = b""
        # The stream to seek on, when seeking can replace reading (never when decompressing).
        self.seekable = stream if self.compressed is None and _seekable(stream) else None
        #: The store's failure that ended the stream (see :meth:`_guarded`), raised in place of
        #: the error the tar reader finds where the stream stopped.
        self.failure: ShardOpenError | None = None
        self._stream_read = self.read = self._guarded(self.read)

    def _guarded(self, read: Callable[[int], bytes]) -> Callable[[int], bytes]:
        """``read``, a failure of the store ending the stream as EOF would: the tar reader
        then finds where the stream stopped as for a truncated one (inside which member, and
        so whether the sample before it is complete: everything before the failure is handed
        on), and :meth:`error` raises the store's failure, naming that member."""

        def guarded(size: int) -> bytes:
            if self.failure is not None:
                return b""
            try:
                return read(size)
            except ShardOpenError as exc:
                self.failure = exc
                return b""

        return guarded

    def error(
        self, message: str, offset: int, member: str | None = None, entry: str | None = None
    ) -> ShardFormatError:
        """Build the ShardFormatError for this shard.

        ``member`` names a regular file (by its name in the archive); anything else involved,
        such as an extended header or an entry that is not a file, is described by ``entry``
        in the message only.

        Raises:
            ShardOpenError: The store failed where the stream stopped: the real cause, raised
                instead (naming ``member``).
        """
        if self.failure is not None:
            self.failure.name_member(member)
            raise self.failure
        if entry is not None:
            message = f"{message} (in {entry})"
        return ShardFormatError(message, url=self.url, offset=offset, member=member)

    def fill(self, need: int) -> bool:
        """Make ``need`` bytes available at ``pos``; False if the stream ends first."""
        buf, pos = self.buf, self.pos
        avail = len(buf) - pos
        if avail >= need:
            return True
        self.base += pos
        if avail:
            # Complete only the straddling header or member: the next block read then starts
            # on a boundary, instead of joining the leftover onto a fresh 4 MiB block.
            parts = [buf[pos:]]
            want = need - avail
        else:
            if self.spare and len(self.spare) - self.spare_pos >= need:
                # The rest of the block the last straddle read whole becomes the buffer as it
                # is: the stream's blocks (a remote shard's parts) are never copied.
                self.buf, self.pos = self.spare, self.spare_pos
                self.base -= self.spare_pos
                self._drop_spare()
                return True
            parts = []
            want = max(need, self.block_bytes)
        while avail < need:
            read = self.read  # the spare's reader until the spare is used up
            if parts and self.seekable is None and read is self._stream_read:
                # Read a whole block, not just the missing bytes: a stream that hands out its
                # blocks without copying (PartStream) would copy the rest of a block that is
                # read from its middle. What is not needed now is kept as the spare.
                chunk = read(max(want, self.block_bytes))
                if len(chunk) > want:
                    self.spare, self.spare_pos = chunk, want
                    self.read = self._read_spare
                    chunk = chunk[:want]
            else:
                chunk = read(want)
            if not chunk:
                break
            parts.append(chunk)
            avail += len(chunk)
            want -= len(chunk)
        self.buf = parts[0] if len(parts) == 1 else b"".join(parts)
        self.pos = 0
        return avail >= need

    def _read_spare(self, size: int) -> bytes:
        """``read`` while a spare block is held: its bytes first, then the stream's."""
        spare, start = self.spare, self.spare_pos
        end = len(spare) if size < 0 else min(len(spare), start + size)
        data = spare[start:end]
        if end >= len(spare):
            self._drop_spare()
        else:
            self.spare_pos = end
        return data

    def _drop_spare(self) -> None:
        self.spare = b""
        self.spare_pos = 0
        self.read = self._stream_read

    def take_or_raise(
        self, size: int, padded: int, member: str | None, entry: str | None = None
    ) -> bytes:
        """Return the next ``size`` bytes and skip the padding up to ``padded``.

        Raises:
            ShardFormatError: The member would end past :data:`MAX_OFFSET`, or the stream
                ends (or its decompression fails) inside the data or its padding.
        """
        start = self._check_fits(size, padded, member, entry)
        try:
            data = self._take(size) if size else b""
            complete = data is not None and self.skip(padded - size)
        except ShardFormatError as exc:
            raise self._in_member(exc, member, entry) from exc
        if data is None or not complete:
            raise self.error("truncated tar: stream ends inside member data", start, member, entry)
        return data if type(data) is bytes else bytes(data)  # a slice of a view: copy it out

    def skip_or_raise(
        self, size: int, padded: int, member: str | None, entry: str | None = None
    ) -> None:
        """Skip a member of ``size`` bytes padded to ``padded`` (data not wanted).

        Raises:
            ShardFormatError: The member would end past :data:`MAX_OFFSET`, or the stream
                ends (or its decompression fails) first.
        """
        start = self._check_fits(size, padded, member, entry)
        try:
            complete = self.skip(padded)
        except ShardFormatError as exc:
            raise self._in_member(exc, member, entry) from exc
        if not complete:
            raise self.error("truncated tar: stream ends inside member data", start, member, entry)

    def too_large(
        self, size: int, offset: int, member: str | None, entry: str | None = None
    ) -> ShardFormatError:
        """The error for a member at ``offset`` whose size would take it past MAX_OFFSET."""
        return self.error(
            f"corrupt tar: a size of {describe_size(size)} bytes would end past byte 2**63, "
            "beyond any real shard",
            offset,
            member,
            entry,
        )

    def _check_fits(self, size: int, padded: int, member: str | None, entry: str | None) -> int:
        start = self.base + self.pos
        if start + padded > MAX_OFFSET:
            # Checked before any seek or read: those raise OverflowError on such sizes.
            raise self.too_large(size, start, member, entry)
        return start

    def _in_member(
        self, exc: ShardFormatError, member: str | None, entry: str | None
    ) -> ShardFormatError:
        """The decompression's error, naming the member whose data it was reading."""
        if exc.member is not None or (member is None and entry is None):
            return exc
        offset = self.base + self.pos if exc.offset is None else exc.offset
        return self.error(exc.reason, offset, member, entry)

    def skip(self, size: int) -> bool:
        """Skip ``size`` bytes; False if the stream ends first."""
        buf, pos = self.buf, self.pos
        avail = len(buf) - pos
        if size <= avail:
            self.pos = pos + size
            return True
        if size <= self.block_bytes and self.seekable is None:
            # Padding or a small member across a block boundary: through fill, which keeps
            # the rest of the next block whole (a short read would copy it in pieces).
            if not self.fill(size):
                return False
            self.pos += size
            return True
        size -= avail
        self.base += len(buf)
        self.buf = b""
        self.pos = 0
        if size > self.block_bytes and self._seek(size - 1):
            # Seeking past the end succeeds silently: read the last byte to prove it exists.
            if not self.read(1):
                return False
            self.base += size
            return True
        while size > 0:
            chunk = self.read(min(size, self.block_bytes))
            if not chunk:
                return False
            size -= len(chunk)
            self.base += len(chunk)
        return True

    def _take(self, size: int) -> bytes | None:
        buf, pos = self.buf, self.pos
        avail = len(buf) - pos
        if size <= avail:
            self.pos = pos + size
            return buf[pos : pos + size]
        if size <= self.block_bytes:
            if not self.fill(size):
                return None
            pos = self.pos
            self.pos = pos + size
            return self.buf[pos : pos + size]
        # A large member: read it straight from the stream, not block by block.
        self.base += pos + size
        self.buf = b""
        self.pos = 0
        if avail == 0 or self._seek(-avail):
            # Seekable stream (local file, BytesIO): one read() of the whole member is one copy
            # instead of two, ~2x faster at the memory bandwidth of these machines.
            present = self._ends_within(size) if self.seekable is not None else True
            if present is None:
                return self._read_chunks(size)
            return self._read_exact(size) if present else None
        # Not seekable: head + rest is two copies. readinto() into a fresh bytearray measured
        # slower (zeroing + copy + bytes()), and a reused scratch buffer would hold up to
        # max_member_bytes of memory for the life of the shard.
        rest = self._read_exact(size - avail)
        return None if rest is None else b"".join((buf[pos:], rest))  # buf may be a view

    def _read_exact(self, size: int) -> bytes | None:
        chunk = self.read(size)
        if len(chunk) == size:
            return chunk
        parts = [chunk]
        got = len(chunk)
        while got < size:
            if not chunk:
                return None
            chunk = self.read(size - got)
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _ends_within(self, size: int) -> bool | None:
        """Whether the stream holds ``size`` more bytes (seek there, read a byte, seek back),
        so that a corrupt size within the member limit is never allocated by ``read(size)`` on
        a file; None when the stream cannot seek that far."""
        if not self._seek(size - 1):
            return None
        last = self.read(1)
        if not self._seek(-size + 1 - len(last)):
            raise self.error("cannot seek back in the shard stream", self.base - size)
        return bool(last)

    def _read_chunks(self, size: int) -> bytes | None:
        parts = []
        while size > 0:
            chunk = self.read(min(size, self.block_bytes))
            if not chunk:
                return None
            parts.append(chunk)
            size -= len(chunk)
        return b"".join(parts)

    def _seek(self, delta: int) -> bool:
        if self.seekable is None:
            return False
        try:
            self.seekable.seek(delta, 1)
        except (OSError, ValueError, OverflowError):
            logger.debug("seek failed on %s; reading instead", _shown(self.url))
            self.seekable = None
            return False
        return True

    def finish_at_eof(self, ext_offset: int) -> None:
        """Handle the stream ending where a header should start.

        Raises:
            ShardFormatError: The stream ends inside a header, right after an extended
                header that should have been followed by a member, or with no end marker.
        """
        offset = self.base + self.pos
        if len(self.buf) > self.pos:
            raise self.error("truncated tar: stream ends inside a header", offset)
        if ext_offset >= 0:
            raise self.error("truncated tar: stream ends after an extended header", ext_offset)
        # GNU tar and tarfile accept this silently, but every common writer ends an archive
        # with zero blocks, and a download or upload cut on a member boundary (8 MiB parts are
        # 512-aligned) looks exactly like this: silently losing the rest of a shard is worse
        # than a clear error that the handler policy can skip.
        raise self.error(
            "truncated tar: stream ends without an end-of-archive marker (zero blocks); "
            "the shard was cut short or written incompletely",
            offset,
        )

    def finish_at_zero_block(self, offset: int, ext_offset: int) -> None:
        """Handle the first zero block: check the end of the archive, drain a compressed stream.

        Raises:
            ShardFormatError: A zero block follows an extended header or precedes more data
                (a zeroed header), or the compressed stream after the archive is corrupt.
        """
        if ext_offset >= 0:
            raise self.error("corrupt tar: extended header not followed by a member", ext_offset)
        self.fill(BLOCK)
        if self.failure is not None:
            raise self.failure  # one zero block, then the store failed: not a proper end
        second = bytes(self.buf[self.pos : self.pos + BLOCK])
        if second.count(0) != len(second):
            raise self.error("corrupt tar: a zero block followed by more data", offset)
        if self.compressed is not None:
            # Read to the end so the stream's own check (gzip's CRC and length) is made.
            while self.compressed.read(self.block_bytes):
                pass
        elif second != ZERO_BLOCK and second:
            logger.debug("%s ends inside its second zero block", _shown(self.url))


def _seekable(stream: Any) -> bool:
    seekable = getattr(stream, "seekable", None)
    try:
        return bool(seekable()) if seekable is not None else False
    except (OSError, ValueError):
        return False


def _shown(url: str | None) -> str:
    return "<stream>" if url is None else redact_url(url)
