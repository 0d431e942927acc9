"""webdataset 1.0.2's ``webdataset.writer``: ``TarWriter``, ``ShardWriter`` and the encoders.

The writers are cloudshards' (:mod:`cloudshards.writers`): any fsspec URL, a shard appears only
once it is complete. Encoders are :mod:`cloudshards.encoders`; gzip fields are written with a
zero timestamp (reproducible bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cloudshards.encoders import (
    _cbor_dumps,
    _encode_field,
    _make_handlers,
    _msgpack_dumps,
    _npy_dumps,
    _npz_dumps,
    _torch_dumps,
    default_handlers,
    encode_based_on_extension,
    imageencoder,
    make_encoder,
)
from cloudshards.tensorbin import tenbin_dumps as _tenbin_dumps
from cloudshards.webdataset.gopen import gopen
from cloudshards.writers import ShardWriter, TarWriter

__all__ = [
    "ShardWriter",
    "TarWriter",
    "add_handlers",
    "bytestr",
    "cbor_dumps",
    "default_handlers",
    "encode_based_on_extension",
    "encode_based_on_extension1",
    "gopen",
    "imageencoder",
    "make_encoder",
    "make_handlers",
    "mp_dumps",
    "numpy_dumps",
    "numpy_npz_dumps",
    "tenbin_dumps",
    "torch_dumps",
]

torch_dumps = _torch_dumps
numpy_dumps = _npy_dumps
numpy_npz_dumps = _npz_dumps


def tenbin_dumps(x: Any) -> memoryview:
    """Encode an array, or a list of arrays, in the tenbin format (:mod:`cloudshards.tensorbin`)."""
    return memoryview(_tenbin_dumps(x))


def cbor_dumps(x: Any) -> bytes:
    """Encode as CBOR (needs ``cbor`` or ``cbor2``)."""
    return _cbor_dumps(x)


def mp_dumps(x: Any) -> bytes:
    """Encode as msgpack (needs ``msgpack``)."""
    return _msgpack_dumps(x)


def bytestr(data: Any) -> bytes:
    """Bytes as they are; anything else as its ``str`` in ASCII."""
    if isinstance(data, bytes):
        return data
    return str(data).encode("ascii")


def add_handlers(d: dict[str, Any], keys: str | Iterable[str], value: Any) -> None:
    """Set ``d[k] = value`` for each of the (space-separated) ``keys``."""
    for k in keys.split() if isinstance(keys, str) else keys:
        d[k] = value


def make_handlers() -> dict[str, Callable[[Any], bytes]]:
    """A fresh copy of the default extension -> encoder table."""
    return _make_handlers()


def encode_based_on_extension1(
    data: Any, tname: str, handlers: Mapping[str, Callable[[Any], bytes]]
) -> Any:
    """Encode one field value by the last extension of ``tname`` (``.gz`` compresses)."""
    return _encode_field(data, tname, handlers)
