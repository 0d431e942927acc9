"""Streaming decompression for the tar reader: gzip, bzip2 and xz shards (``.tar.gz``,
``.tgz``, ``.tar.bz2``, ``.tar.xz``), told by their magic bytes, in bounded reads.

webdataset 1.0.2 reads all three (through ``tarfile``'s ``r|*``), and cloudshards' own
``TarWriter`` writes them. The decompressors are the standard library's (zlib, bz2, lzma);
what is written here is only the bounded, multi-stream reading around them.

Used by :mod:`cloudshards.tar.blocks` only.
"""

from __future__ import annotations

import bz2
import logging
import lzma
import zlib
from typing import Any

from cloudshards import config
from cloudshards.errors import ShardFormatError
from cloudshards.redact import redact_url
from cloudshards.tar.headers import BLOCK

__all__ = ["GZIP_MAGIC", "DecompressReader", "compression_of"]

logger = logging.getLogger("cloudshards.tar")

#: The first two bytes of every gzip stream (exported by :mod:`cloudshards.tar`).
GZIP_MAGIC = b"\x1f\x8b"
_XZ_MAGIC = b"\xfd7zXZ\x00"
# "BZh", the block size (1-9), then a block's magic (pi) or, for empty data, the end's (sqrt pi):
# ten bytes, so that no tar whose first member is named "BZh..." is taken for one.
_BZIP2_AFTER_LEVEL = (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90")

#: Bytes of the stream's start that :func:`compression_of` needs.
MAGIC_BYTES = 10

#: Compressed bytes fed to the decompressor per call: small, so leftover input is cheap.
_INPUT_BYTES = 256 << 10

#: Decompressed bytes past which a stream may be :data:`MAX_INFLATION` times its compressed
#: size at most (gzip cannot pass 1,032x; bzip2 and xz of zeros can pass a million).
INFLATION_FLOOR = 1 << 30
MAX_INFLATION = 10_000

#: Most memory an xz stream may make lzma use (its dictionary): xz -9 needs 65 MiB. A hostile
#: stream can ask for gigabytes; it gets a ShardFormatError instead.
XZ_MEMORY_LIMIT = 256 << 20


def compression_of(head: bytes) -> str | None:
    """``"gzip"``, ``"bzip2"`` or ``"xz"`` when ``head`` (the first :data:`MAGIC_BYTES` of a
    shard) starts such a stream; None for anything else (a tar)."""
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[:6] == _XZ_MAGIC:
        return "xz"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[3:4] != b"0":
        return "bzip2" if head[4:10] in _BZIP2_AFTER_LEVEL else None
    return None


def _decompressor(kind: str) -> Any:
    if kind == "gzip":
        return zlib.decompressobj(wbits=31)
    if kind == "bzip2":
        return bz2.BZ2Decompressor()
    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=XZ_MEMORY_LIMIT)


class DecompressReader:
    """A ``read(n)`` over the decompressed bytes of a gzip, bzip2 or xz stream (several
    concatenated streams too, with zero padding between or after them, as gzip(1), bzip2 and
    xz read them).

    Output per call is bounded by ``block_bytes``, so a compression bomb cannot exhaust
    memory; the end of the (last) stream is checked (gzip's CRC and length, bzip2's and xz's
    checks), so a truncated or corrupt shard raises instead of ending early.

    Args:
        stream: The compressed stream (``read(n)``).
        first: Bytes already read from its start.
        url: The shard's URL, for errors.
        block_bytes: Most bytes read, and returned, per call.
        kind: ``"gzip"``, ``"bzip2"`` or ``"xz"`` (see :func:`compression_of`).
    """

    def __init__(
        self, stream: Any, first: bytes, url: str | None, block_bytes: int, kind: str = "gzip"
    ) -> None:
        self.kind = kind
        self._stream = stream
        self._url = url
        self._block_bytes = max(block_bytes, BLOCK)
        # zlib hands back the input it did not use (unconsumed_tail); bz2 and lzma keep it
        # and say whether they want more (needs_input).
        self._zlib = kind == "gzip"
        self._decompressor = _decompressor(kind)
        self._input = first  # compressed bytes not yet given to the decompressor
        self._compressed_read = len(first)  # compressed bytes read from the stream so far
        self._offset = 0  # decompressed bytes returned so far
        self._out = b""
        self._out_pos = 0
        self._failed: str | None = None  # a corrupt gzip stream, raised at the next read
        self._max_inflation = config.env_int("MAX_INFLATION", MAX_INFLATION)

    def read(self, size: int) -> bytes:
        """Return up to ``size`` decompressed bytes; ``b""`` only at a clean end of stream."""
        out, out_pos = self._out, self._out_pos
        if out_pos >= len(out):
            out = self._out = self._decompress()
            out_pos = 0
        data = out[out_pos : out_pos + size]
        self._out_pos = out_pos + len(data)
        self._offset += len(data)
        return data

    def _decompress(self) -> bytes:
        if self._failed is not None:
            raise ShardFormatError(self._failed, url=self._url, offset=self._offset)
        while True:
            decompressor = self._decompressor
            if decompressor.eof:
                # Another stream may follow (cat a.gz b.gz); zero padding is ignored.
                rest = self._input.lstrip(b"\0")
                while len(rest) < MAGIC_BYTES:
                    chunk = self._read_compressed()
                    if not chunk:
                        break
                    rest = (rest + chunk).lstrip(b"\0")
                if compression_of(rest) != self.kind:
                    return self._trailing(rest)
                self._input = rest
                decompressor = self._decompressor = _decompressor(self.kind)
            wants_input = self._zlib or decompressor.needs_input
            if wants_input and not self._input:
                self._input = self._read_compressed()
                if not self._input:
                    raise self._error(
                        f"truncated {self.kind} stream (ends before {_END[self.kind]})"
                    )
            feed = self._input[:_INPUT_BYTES] if wants_input else b""
            saved = decompressor.copy() if self._zlib else None  # see _salvage
            try:
                out: bytes = decompressor.decompress(feed, self._block_bytes)
            except (zlib.error, OSError, lzma.LZMAError, EOFError) as exc:
                if "memory" in str(exc).lower():  # lzma's memlimit: refused, not corrupt
                    raise self._error(
                        f"refused: the {self.kind} stream needs more than "
                        f"{XZ_MEMORY_LIMIT >> 20} MiB of decoder memory ({exc})"
                    ) from None
                if saved is None:
                    raise self._error(f"corrupt {self.kind} stream ({exc})") from None
                out, at_byte = self._salvage(saved, feed)
                # Named after the replay: the byte zlib fails at (or, when the replay could
                # not find it, where the failed call's input began: the damage lies no earlier).
                failure = self._error(f"corrupt {self.kind} stream ({exc})").reason
                if at_byte:  # nothing after the failing byte is handed on
                    self._failed = failure
                if out:
                    return out
                raise ShardFormatError(failure, url=self._url, offset=self._offset) from None
            rest = self._input[len(feed) :]
            if self._zlib:
                tail = (
                    decompressor.unused_data if decompressor.eof else decompressor.unconsumed_tail
                )
                rest = tail + rest
            elif decompressor.eof:
                rest = decompressor.unused_data + rest
            self._input = rest
            if out:
                self._check_inflation(self._offset + len(out))
                return out

    def _trailing(self, rest: bytes) -> bytes:
        """The end, after a whole stream that checked out: what follows it is no stream of its
        kind, so it is ignored with a warning, as gzip(1) does (an upload tool's padding, a
        signature appended), rather than failing a shard whose every byte was verified."""
        self._input = b""
        if rest:
            where = redact_url(self._url) if self._url else "a shard"
            logger.warning(
                "%s: what follows its %s stream is not %s data: ignored", where, *[self.kind] * 2
            )
        return b""

    def _salvage(self, saved: Any, feed: bytes) -> tuple[bytes, bool]:
        """What ``feed`` decodes to before the byte zlib fails at, replayed from ``saved``
        (the state before the failed call) in small steps, and whether that byte was found
        (the input then starts at it): zlib drops a call's whole output when it fails (a bad
        CRC in the trailer dropped up to a block of good members), so the members before the
        damage are handed on, and the failure is raised at the next read.
        Error path only: nothing is replayed while nothing fails."""
        out = bytearray()
        at, state, failed = 0, saved, False
        for step in (4096, 1):  # the failing 4 KiB, then the failing byte in it
            while not (failed or state.eof) and at < len(feed) and len(out) < self._block_bytes:
                trial = state.copy()
                piece = feed[at : at + step]
                try:
                    out += trial.decompress(piece, self._block_bytes - len(out))
                except zlib.error:
                    failed = step == 1
                    break
                # (An end of stream cannot be where the whole call failed: as a normal call.)
                at += len(piece) - len(trial.unconsumed_tail) - len(trial.unused_data)
                state = trial
        self._decompressor = state
        self._input = feed[at:] + self._input[len(feed) :]
        return bytes(out), failed

    def _check_inflation(self, total: int) -> None:
        """Refuse a stream that inflated past :data:`INFLATION_FLOOR` at over ``max_inflation``
        times its compressed size: 785 bytes of bzip2 are 1 GiB of zeros, and a small shard
        of them kept a worker busy for an hour, for members its filter skips too."""
        if total > INFLATION_FLOOR and total > self._max_inflation * self._compressed_read:
            raise self._error(
                f"refused: the {self.kind} stream inflates over {self._max_inflation:,} times "
                f"its size (a decompression bomb? CLOUDSHARDS_MAX_INFLATION raises the limit)"
            )

    def _read_compressed(self) -> bytes:
        chunk: bytes = self._stream.read(self._block_bytes)
        self._compressed_read += len(chunk)
        return chunk

    def _error(self, message: str) -> ShardFormatError:
        compressed = self._compressed_read - len(self._input)
        return ShardFormatError(
            f"{message} near compressed byte {compressed}", url=self._url, offset=self._offset
        )


_END = {
    "gzip": "the gzip trailer",
    "bzip2": "its end-of-stream marker",
    "xz": "its stream footer",
}
