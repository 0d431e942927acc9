"""Streaming gunzip for the tar reader: decompressed bytes in bounded reads.

Used by :mod:`cloudshards.tar.blocks` only.
"""

from __future__ import annotations

import zlib
from typing import Any

from cloudshards.errors import ShardFormatError
from cloudshards.tar.headers import BLOCK

__all__ = ["GZIP_MAGIC", "GunzipReader"]

#: The first two bytes of every gzip stream (exported by :mod:`cloudshards.tar`).
GZIP_MAGIC = b"\x1f\x8b"

#: Compressed bytes fed to zlib per call: small, so carrying unconsumed input over is cheap.
_GZIP_INPUT_BYTES = 256 << 10


class GunzipReader:
    """A ``read(n)`` over the decompressed bytes of a (multi-member) gzip stream.

    Output per call is bounded by ``block_bytes``, so a gzip bomb cannot exhaust memory.
    """

    def __init__(self, stream: Any, first: bytes, url: str | None, block_bytes: int) -> None:
        self._stream = stream
        self._url = url
        self._block_bytes = max(block_bytes, BLOCK)
        self._decompressor = zlib.decompressobj(wbits=31)
        self._input = first  # compressed bytes not yet given to zlib
        self._compressed_read = len(first)  # compressed bytes read from the stream so far
        self._offset = 0  # decompressed bytes returned so far
        self._out = b""
        self._out_pos = 0

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
        while True:
            decompressor = self._decompressor
            if decompressor.eof:
                # Another gzip member may follow (cat a.gz b.gz); zero padding between or after
                # members is ignored, as gzip(1) and Python's gzip module do.
                rest = self._input.lstrip(b"\0")
                while not rest:
                    chunk = self._read_compressed()
                    if not chunk:
                        return b""
                    rest = chunk.lstrip(b"\0")
                self._input = rest
                decompressor = self._decompressor = zlib.decompressobj(wbits=31)
            if not self._input:
                self._input = self._read_compressed()
                if not self._input:
                    raise self._error("truncated gzip stream (ends before the gzip trailer)")
            try:
                out = decompressor.decompress(self._input[:_GZIP_INPUT_BYTES], self._block_bytes)
            except zlib.error as exc:
                raise self._error(f"corrupt gzip stream ({exc})") from None
            tail = decompressor.unused_data if decompressor.eof else decompressor.unconsumed_tail
            self._input = tail + self._input[_GZIP_INPUT_BYTES:]
            if out:
                return out

    def _read_compressed(self) -> bytes:
        chunk: bytes = self._stream.read(self._block_bytes)
        self._compressed_read += len(chunk)
        return chunk

    def _error(self, message: str) -> ShardFormatError:
        compressed = self._compressed_read - len(self._input)
        return ShardFormatError(
            f"{message} near compressed byte {compressed}", url=self._url, offset=self._offset
        )
