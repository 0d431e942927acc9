"""webdataset's tensor binary format (``.ten``/``.tb`` fields): lists of numeric arrays, no pickle.

The layout, read and written byte for byte as webdataset 1.0.2 does: a sequence of chunks,
each the 8 ASCII bytes ``~TenBin~``, its length (int64), then its bytes, zero-padded to a
multiple of 64. An array is two chunks: a header of int64 values (the dtype's short name and
an info string of at most 8 ASCII characters, each packed into 8 bytes; the number of
dimensions; each dimension) and the array's data in C order. Integers and arrays are
little-endian (webdataset writes the machine's order, little-endian everywhere it runs).

Written by hand: no maintained library reads this format (webdataset's module is its only
implementation, and cloudshards does not depend on webdataset). Decoding checks every length,
rank and shape against the buffer before making an array, and the arrays it returns are
read-only views of the field's bytes: a hostile field can make a ``ValueError``, not a large
allocation.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "decode_buffer",
    "decode_chunks",
    "decode_header",
    "decode_list",
    "encode_buffer",
    "encode_chunks",
    "encode_header",
    "encode_list",
    "roundup",
    "str64",
    "tenbin_dumps",
    "tenbin_loads",
    "unstr64",
]

#: The format's short dtype names (webdataset's table; it cannot write uint32: see ENCODABLE).
SHORT = {
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
}
LONG = {short: long for long, short in SHORT.items()}
#: What webdataset 1.0.2 writes (its table misspells uint32, so it refuses uint32 arrays);
#: refusing the same keeps files this writes readable by it. Reading accepts ``u4`` too.
ENCODABLE = frozenset(SHORT) - {"uint32"}

MAGIC = b"~TenBin~"
_INT64 = struct.Struct("<q")
_MAX_RANK = 9  # webdataset refuses 10 dimensions or more


def roundup(n: int, k: int = 64) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return k * ((n + k - 1) // k)


def str64(s: str) -> int:
    """An ASCII string of at most 8 characters as one int64."""
    data = s.encode("ascii")
    if len(data) > 8:
        raise ValueError(f"tenbin strings hold at most 8 ASCII characters, got {s!r}")
    return int(_INT64.unpack(data.ljust(8, b"\0"))[0])


def unstr64(i: int) -> str:
    """:func:`str64`'s string back."""
    try:
        return _INT64.pack(int(i)).decode("ascii").strip("\0")
    except (UnicodeDecodeError, struct.error) as exc:
        raise ValueError("tenbin header: not an ASCII name") from exc


def encode_header(a: np.ndarray, info: str = "") -> bytes:
    """The header chunk of array ``a``."""
    array = a
    if array.ndim > _MAX_RANK:
        raise ValueError(f"tenbin arrays have at most {_MAX_RANK} dimensions, got {array.ndim}")
    if array.dtype.name not in ENCODABLE:
        raise ValueError(f"tenbin cannot store {array.dtype.name} arrays")
    values = [str64(SHORT[array.dtype.name]), str64(info), array.ndim, *array.shape]
    return np.array(values, dtype="<i8").tobytes()


def decode_header(h: bytes | memoryview) -> tuple[tuple[int, ...], np.dtype[Any], str]:
    """(shape, dtype, info) of a header chunk ``h``, checked."""
    header = h
    if len(header) < 24 or len(header) % 8:
        raise ValueError(f"tenbin header of {len(header)} bytes")
    values = np.frombuffer(header, dtype="<i8")
    code = unstr64(values[0])
    if code not in LONG:
        raise ValueError(f"tenbin header: unknown array type {code!r}")
    rank = int(values[2])
    if not 0 <= rank <= _MAX_RANK or len(values) < 3 + rank:
        raise ValueError(f"tenbin header: {rank} dimensions in a header of {len(values)} values")
    shape = tuple(int(n) for n in values[3 : 3 + rank])
    if any(n < 0 for n in shape):
        raise ValueError(f"tenbin header: negative dimension in {shape}")
    return shape, np.dtype(LONG[code]).newbyteorder("<"), unstr64(values[1])


def encode_list(l: Sequence[Any], infos: Sequence[str] | None = None) -> list[bytes]:  # noqa: E741
    """Header and data chunks of each array of ``l`` (``infos``: a string per array)."""
    arrays = l
    names = [""] if infos is None else list(infos)
    if infos is not None and len(names) != len(arrays):
        raise ValueError(f"{len(names)} infos for {len(arrays)} arrays")
    chunks: list[bytes] = []
    for number, value in enumerate(arrays):
        array = np.asarray(value)
        little = array.astype(array.dtype.newbyteorder("<"), order="C", copy=False)
        chunks += [encode_header(array, names[number % len(names)]), little.tobytes()]
    return chunks


def decode_list(l: Sequence[Any], infos: bool = False) -> Any:  # noqa: E741
    """Arrays from header and data chunks ``l`` (with ``infos``: (arrays, their strings))."""
    chunks = l
    if len(chunks) % 2:
        raise ValueError("tenbin: an array header without its data")
    arrays, names = [], []
    for header, data in zip(chunks[::2], chunks[1::2], strict=True):
        shape, dtype, info = decode_header(header)
        count = int(np.prod(shape, dtype=object)) if shape else 1
        if count * dtype.itemsize > len(data):
            raise ValueError(
                f"tenbin: a {'x'.join(map(str, shape)) or 'scalar'} {dtype.name} array needs "
                f"{count * dtype.itemsize} bytes, its data has {len(data)}"
            )
        arrays.append(np.frombuffer(data, dtype=dtype, count=count).reshape(shape))
        names.append(info)
    return (arrays, names) if infos else arrays


def encode_chunks(l: Iterable[bytes]) -> bytearray:  # noqa: E741
    """Chunks ``l`` framed: magic, length, bytes, zero padding to 64."""
    out = bytearray()
    for chunk in l:
        out += MAGIC + _INT64.pack(len(chunk)) + chunk
        out += bytes(roundup(len(chunk)) - len(chunk))
    return out


def decode_chunks(buf: bytes | bytearray | memoryview) -> list[memoryview]:
    """The chunks of a framed buffer (views, no copies), checked."""
    view = memoryview(buf)
    chunks, offset, total = [], 0, len(view)
    while offset < total:
        if offset + 16 > total or view[offset : offset + 8] != MAGIC:
            raise ValueError(f"tenbin: no chunk at byte {offset} (bad magic or truncated)")
        nbytes = _INT64.unpack(view[offset + 8 : offset + 16])[0]
        if nbytes < 0 or offset + 16 + nbytes > total:
            raise ValueError(f"tenbin: a chunk of {nbytes} bytes at byte {offset} of {total}")
        chunks.append(view[offset + 16 : offset + 16 + nbytes])
        offset += 16 + roundup(nbytes)
    return chunks


def encode_buffer(l: list[Any], infos: Sequence[str] | None = None) -> bytearray:  # noqa: E741
    """A list of arrays as one tenbin buffer."""
    if not isinstance(l, list):
        raise ValueError("tenbin encodes a list of arrays")
    return encode_chunks(encode_list(l, infos=infos))


def decode_buffer(buf: bytes | bytearray | memoryview, infos: bool = False) -> Any:
    """The list of arrays in a tenbin buffer (read-only views of it)."""
    return decode_list(decode_chunks(buf), infos=infos)


def tenbin_loads(data: bytes) -> list[np.ndarray]:
    """Decode a ``.ten``/``.tb`` field: its list of arrays."""
    return decode_buffer(data)  # type: ignore[no-any-return]


def tenbin_dumps(value: Any) -> bytes:
    """Encode a ``.ten``/``.tb`` field: a list of arrays, or one array (as a list of one)."""
    return bytes(encode_buffer(value if isinstance(value, list) else [value]))
