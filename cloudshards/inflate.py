"""Bounded inflation for the decoders: gzip, ``.npz`` and ``.npy`` fields (and ``.pth`` zips)
never grow past the decode limit, and memory stays bounded by the limit, not by the bomb;
nor do the objects a JSON field becomes. The ``.npy``/``.npz`` decoders live here;
:mod:`cloudshards.decoders` re-exports them.

The limit is the running :class:`~cloudshards.decoders.Decoder`'s ``max_bytes`` (which a
pipeline sets from its ``max_member_bytes``), else :func:`cloudshards.config.max_decoded_bytes`.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
import zlib
from contextvars import ContextVar
from typing import IO, Any

import numpy as np

from cloudshards import config
from cloudshards.errors import DecodeError

__all__ = [
    "active_limit",
    "check_npy",
    "check_zip",
    "decode_limit",
    "gunzip",
    "json_loads",
    "npy_loads",
    "npz_loads",
    "too_big",
]

#: The decode limit of the Decoder running in this thread/context; None: the default.
active_limit: ContextVar[int | None] = ContextVar("cloudshards_decode_limit", default=None)

_OUTPUT_STEP = 1 << 20  # most bytes one inflate call may produce
_INPUT_STEP = 1 << 16  # compressed bytes fed per call (zlib copies the unconsumed rest each call)
_HOW_TO_RAISE = (
    "raise the pipeline's max_member_bytes, pass .decode(max_bytes=...), or set "
    "CLOUDSHARDS_MAX_DECODED_BYTES"
)


def decode_limit() -> int:
    """The limit for the field being decoded now."""
    limit = active_limit.get()
    return config.max_decoded_bytes() if limit is None else limit


def too_big(what: str, size: int | None, limit: int) -> DecodeError:
    """The error for ``what`` inflating to ``size`` bytes (None: more than ``limit``)."""
    amount = f"more than {limit:,}" if size is None else f"{size:,}"
    return DecodeError(
        f"{what} inflates to {amount} bytes, over the decode limit of {limit:,} bytes "
        f"(a decompression bomb, or a field larger than allowed: {_HOW_TO_RAISE})"
    )


#: Most memory ``json.loads`` makes per ``[``, ``{``, ``,`` or ``:`` of the text, beyond the
#: text itself: an empty list or dict, a number or a short string, and the slot that holds it
#: (32-83 bytes on 64-bit CPython 3.11; ``"[" + "[],"*N + "[]]"`` makes 22 bytes per byte).
_JSON_ITEM_BYTES = 64


def json_loads(data: bytes) -> Any:
    """``json.loads(data)``, refused when the objects it makes could exceed the decode limit.

    Every list, dict, item and key costs Python objects whatever its length in the text, so
    a 1 MB field can become 30 MB. Counted from the punctuation before parsing (a fast scan,
    skipped for fields too small to matter): the text's length plus 64 bytes per ``[``,
    ``{``, ``,`` and ``:`` (those inside strings too, an overestimate).

    Raises:
        DecodeError: The estimate is over the limit.
        ValueError: The text is not JSON (``json.JSONDecodeError``).
    """
    limit = decode_limit()
    if len(data) * (1 + _JSON_ITEM_BYTES) > limit:  # else even all punctuation would fit
        items = data.count(b"[") + data.count(b"{") + data.count(b",") + data.count(b":")
        estimate = len(data) + _JSON_ITEM_BYTES * items
        if estimate > limit:
            raise DecodeError(
                f"JSON of {len(data):,} bytes holds {items:,} lists, dicts, items or keys, "
                f"which could take {estimate:,} bytes as Python objects, over the decode limit "
                f"of {limit:,} bytes ({_HOW_TO_RAISE})"
            )
    return json.loads(data)


def gunzip(data: bytes, max_bytes: int) -> bytes:
    """``gzip.decompress(data)`` (several members, zero padding), refusing output over
    ``max_bytes`` as soon as it is reached.

    Raises:
        DecodeError: The output would exceed ``max_bytes``, or the data ends too early.
        zlib.error: The data is not gzip or is corrupt (bad header, CRC or length).
    """
    out = bytearray()
    start, end = 0, len(data)
    while start < end:
        # wbits=31: gzip framing; zlib checks the header, the CRC and the length itself.
        inflater = zlib.decompressobj(wbits=31)
        fed = start
        while not inflater.eof:
            room = min(_OUTPUT_STEP, max_bytes - len(out) + 1)
            if inflater.unconsumed_tail:
                chunk = inflater.decompress(inflater.unconsumed_tail, room)
            elif fed < end:
                chunk = inflater.decompress(data[fed : fed + _INPUT_STEP], room)
                fed = min(fed + _INPUT_STEP, end)
            else:
                chunk = inflater.decompress(b"", room)  # output zlib still holds
                if not chunk:
                    raise DecodeError("gzip data is truncated (no end-of-stream marker)")
            out += chunk
            if len(out) > max_bytes:
                raise too_big("gzip data", None, max_bytes)
        start = fed - len(inflater.unused_data)
        start = _skip_zeros(data, start, end)
    return bytes(out)


def _skip_zeros(data: bytes, start: int, end: int) -> int:
    # gzip.decompress ignores zero padding between and after members.
    while start < end:
        piece = data[start : start + _INPUT_STEP]
        stripped = piece.lstrip(b"\0")
        start += len(piece) - len(stripped)
        if stripped:
            break
    return start


def check_npy(stream: IO[bytes], available: int, max_bytes: int, what: str = ".npy array") -> None:
    """Check a ``.npy`` header before numpy allocates the array it declares.

    Reads the header from ``stream`` (positioned at the magic); ``available`` is the number of
    bytes from there to the end of the data.

    Raises:
        DecodeError: The array is larger than ``max_bytes`` or than the data that follows.
    """
    start = stream.tell()
    version = np.lib.format.read_magic(stream)
    # Version 3.0 differs from 2.0 only in encoding field names as UTF-8: sizes read the same.
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
    else:
        shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
    if dtype.hasobject:
        return  # pickled: numpy refuses it with allow_pickle=False
    declared = math.prod(shape) * dtype.itemsize
    if declared > max_bytes:
        raise too_big(f"{what} of {dtype} {tuple(shape)}", declared, max_bytes)
    present = available - (stream.tell() - start)
    if declared > present:
        raise DecodeError(
            f"{what} header declares {declared:,} bytes ({dtype} {tuple(shape)}) but only "
            f"{present:,} follow: corrupt or hostile data"
        )


def check_zip(data: bytes, max_bytes: int, what: str) -> None:
    """Check that a zip (``.npz``, ``.pth``) holds at most ``max_bytes`` once inflated, and that
    its ``.npy`` members hold the arrays their headers declare.

    A member cannot inflate past its declared size (``zipfile`` stops there and then fails
    its CRC), so the declared sizes bound what numpy and torch inflate.

    Raises:
        DecodeError: Too large in total, or a ``.npy`` member declares more than it holds.
        zipfile.BadZipFile: Not a zip archive.
    """
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
        total = sum(member.file_size for member in members)
        if total > max_bytes:
            raise too_big(f"{what} of {len(members)} members", total, max_bytes)
        for member in members:
            with archive.open(member) as stream:
                if stream.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
                    continue
                stream.seek(0)
                check_npy(stream, member.file_size, max_bytes, f"member {member.filename!r}")


def npy_loads(data: bytes) -> Any:
    """Load a ``.npy`` array (object arrays refused: they need pickle), checking the size its
    header declares against the data and the decode limit before allocating it."""
    stream = io.BytesIO(data)
    check_npy(stream, len(data), decode_limit())
    stream.seek(0)
    return np.lib.format.read_array(stream, allow_pickle=False)


def npz_loads(data: bytes) -> dict[str, Any]:
    """Load a ``.npz`` archive into a dict of arrays (object arrays refused), refusing one that
    would inflate past the decode limit before inflating anything."""
    if data[: len(np.lib.format.MAGIC_PREFIX)] == np.lib.format.MAGIC_PREFIX:
        raise ValueError("expected an .npz archive, found a single .npy array")
    check_zip(data, decode_limit(), ".npz archive")
    loaded = np.load(io.BytesIO(data), allow_pickle=False)
    with loaded:
        return dict(loaded)
