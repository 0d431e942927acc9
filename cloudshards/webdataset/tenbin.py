"""webdataset 1.0.2's ``webdataset.tenbin``: its tensor binary format, on cloudshards' reader and
writer (:mod:`cloudshards.tensorbin`), plus the stream and file helpers of webdataset's module."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import IO, Any

from cloudshards.tensorbin import (
    MAGIC,
    SHORT,
    decode_buffer,
    decode_chunks,
    decode_header,
    decode_list,
    encode_buffer,
    encode_chunks,
    encode_header,
    encode_list,
    roundup,
    str64,
    unstr64,
)

__all__ = [
    "bytedata",
    "bytelen",
    "check_acceptable_input_type",
    "check_infos",
    "decode_buffer",
    "decode_chunks",
    "decode_header",
    "decode_list",
    "encode_buffer",
    "encode_chunks",
    "encode_header",
    "encode_list",
    "load",
    "long_to_short",
    "magic",
    "magic_bytes",
    "magic_str",
    "read",
    "read_chunk",
    "roundup",
    "save",
    "short_to_long",
    "str64",
    "unstr64",
    "write",
    "write_chunk",
]

#: dtype names of the format, webdataset's tables as they are (uint32 misspelt "unit32": it
#: cannot write uint32 arrays, nor can cloudshards; ``u4`` fields read as uint32 here).
long_to_short = {name if name != "uint32" else "unit32": code for name, code in SHORT.items()}
short_to_long = {code: name for name, code in long_to_short.items()}
magic_str = MAGIC.decode("ascii")
magic_bytes = MAGIC
magic = str64(magic_str)


def bytelen(a: Any) -> int:
    """The length of ``a`` in bytes."""
    if hasattr(a, "nbytes"):
        return int(a.nbytes)
    if isinstance(a, (bytes, bytearray)):
        return len(a)
    raise ValueError(a, "cannot determine nbytes")


def bytedata(a: Any) -> Any:
    """The raw data of ``a``."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        return a
    if hasattr(a, "data"):
        return a.data
    raise ValueError(a, "cannot return bytedata")


def check_acceptable_input_type(data: Sequence[Any], allow64: bool) -> None:
    """Refuse arrays the format cannot hold (64-bit ones unless ``allow64``)."""
    for a in data:
        if a.dtype.name not in long_to_short:
            raise ValueError("unsupported datatype")
        if not allow64 and a.dtype.name in ("float64", "int64", "uint64"):
            raise ValueError("64 bit datatypes not allowed unless explicitly enabled")


def check_infos(data: Any, infos: Any, required_infos: Any = None) -> Any:
    """``data`` (with its ``infos`` when ``required_infos`` is True), as webdataset returns."""
    if required_infos is False or required_infos is None:
        return data
    if required_infos is True:
        return data, infos
    if not isinstance(required_infos, (tuple, list)):
        raise ValueError("required_infos must be tuple or list")
    for required, actual in zip(required_infos, infos, strict=False):
        if required != actual:
            raise ValueError(f"actual info {actual} doesn't match required info {required}")
    return data


def write_chunk(stream: IO[bytes], buf: Any) -> None:
    """Write one framed chunk to ``stream``."""
    stream.write(bytes(encode_chunks([bytes(bytedata(buf))])))


def read_chunk(stream: IO[bytes]) -> bytes | None:
    """Read one framed chunk from ``stream`` (None at its end)."""
    head = stream.read(16)
    if not head:
        return None
    if len(head) < 16 or head[:8] != MAGIC:
        raise ValueError("magic number does not match")
    nbytes = int.from_bytes(head[8:], "little", signed=True)
    if nbytes < 0:
        raise ValueError("negative nbytes")
    data = stream.read(nbytes)
    if len(data) < nbytes:
        raise ValueError("premature EOF")
    stream.read(roundup(nbytes) - nbytes)
    return data


def write(stream: IO[bytes], l: Sequence[Any], infos: Sequence[str] | None = None) -> None:  # noqa: E741
    """Write the arrays ``l`` to ``stream``."""
    for chunk in encode_list(list(l), infos=infos):
        write_chunk(stream, chunk)


def read(stream: IO[bytes], n: int = sys.maxsize, infos: bool = False) -> Any:
    """Read up to ``n`` arrays from ``stream``."""
    chunks: list[bytes] = []
    for _ in range(n):
        header = read_chunk(stream)
        if header is None:
            break
        data = read_chunk(stream)
        if data is None:
            raise ValueError("premature EOF")
        chunks += [header, data]
    return decode_list(chunks, infos=infos)


def save(fname: str, *args: Any, infos: Sequence[str] | None = None, nocheck: bool = False) -> None:
    """Save arrays to a ``.ten`` file."""
    if not nocheck and not fname.endswith(".ten"):
        raise ValueError("file name should end in .ten")
    with open(fname, "wb") as stream:
        write(stream, args, infos=infos)


def load(fname: str, infos: bool = False, nocheck: bool = False) -> Any:
    """Load the arrays of a ``.ten`` file."""
    if not nocheck and not fname.endswith(".ten"):
        raise ValueError("file name should end in .ten")
    with open(fname, "rb") as stream:
        return read(stream, infos=infos)
