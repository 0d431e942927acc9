"""webdataset 1.0.2's ``webdataset.filters``: curried filters and the generators behind them.

Every ``_name`` generator takes webdataset's arguments and yields what webdataset yields; the
curried ``name`` is ``pipelinefilter(_name)``. They are cloudshards' stages (``cloudshards.stages``)
except where noted. Differences: without ``rng``/``seed``, ``_shuffle`` and ``_rsample`` seed from
the pipeline's (seed, epoch, rank, worker) instead of the clock or the global RNG; ``.pyd``
fields unpickle only after :func:`cloudshards.allow_unsafe_decoders`; ``LMDBCached`` is left out.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import reduce
from typing import Any

from cloudshards.decoders import unpickle_loads
from cloudshards.handlers import reraise_exception
from cloudshards.replay import LMDB_INSTEAD, Cached
from cloudshards.stages.base import FilterFunction, PipelineStage, RestCurried, pipelinefilter
from cloudshards.stages.batch import (
    _batched,
    _unbatched,
    _unlisted,
    batched,
    combine_values,
    default_collation_fn,
    unbatched,
    unlisted,
)
from cloudshards.stages.epoch import slice
from cloudshards.stages.fields import (
    _extract_keys,
    _rename,
    _rename_keys,
    _to_tuple,
    extract_keys,
    find_decoder,
    getfirst,
    parse_field_spec,
    rename,
    rename_keys,
    to_tuple,
    transform_with,
)
from cloudshards.stages.shuffle import _shuffle, detshuffle, pick, shuffle
from cloudshards.stages.transform import (
    _associate,
    _decode,
    _info,
    _log_keys,
    _map,
    _map_dict,
    _map_tuple,
    _rsample,
    _select,
    associate,
    decode,
    identity,
    info,
    log_keys,
    map,
    map_dict,
    map_tuple,
    rsample,
    select,
)
from cloudshards.webdataset._unsupported import unsupported_class
from cloudshards.webdataset.pytorch import TorchTensor

__all__ = [
    "Cached",
    "FilterFunction",
    "LMDBCached",
    "PipelineStage",
    "RestCurried",
    "TorchTensor",
    "_associate",
    "_batched",
    "_decode",
    "_extract_keys",
    "_info",
    "_log_keys",
    "_map",
    "_map_dict",
    "_map_tuple",
    "_rename",
    "_rename_keys",
    "_rsample",
    "_select",
    "_shuffle",
    "_to_tuple",
    "_unbatched",
    "_unlisted",
    "_xdecode",
    "associate",
    "batched",
    "combine_values",
    "compose",
    "compose2",
    "decode",
    "decode_bin",
    "decode_pickle",
    "decode_text",
    "default_collation_fn",
    "default_decoders",
    "detshuffle",
    "dict2tuple",
    "extract_keys",
    "find_decoder",
    "getfirst",
    "identity",
    "info",
    "log_keys",
    "map",
    "map_dict",
    "map_tuple",
    "parse_field_spec",
    "pick",
    "pipeline",
    "pipelinefilter",
    "rename",
    "rename_keys",
    "reraise_exception",
    "rsample",
    "select",
    "shuffle",
    "slice",
    "to_tuple",
    "transform_with",
    "tuple2dict",
    "unbatched",
    "unlisted",
    "xdecode",
]


def compose2(f: Callable[[Any], Any], g: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Return ``x -> g(f(x))``."""
    return lambda x: g(f(x))


def compose(*args: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Compose functions left to right."""
    return reduce(compose2, args)


def pipeline(source: Any, *args: Callable[[Any], Any]) -> Any:
    """Apply the filters ``args`` to ``source`` in order."""
    if not args:
        return source
    return compose(*args)(source)


def tuple2dict(l: Any) -> dict[Any, Any]:  # noqa: E741 - webdataset's parameter name
    """A dict unchanged; a sequence as ``{index: item}``."""
    if isinstance(l, dict):
        return l
    return dict(enumerate(l))


def dict2tuple(d: dict[int, Any]) -> tuple[Any, ...]:
    """The inverse of :func:`tuple2dict` for integer keys ``0..max``."""
    return tuple(d[i] for i in range(1 + max(d.keys())))


def decode_bin(stream: io.BytesIO) -> bytes:
    """Read the field's bytes."""
    return stream.read()


def decode_text(stream: io.BytesIO) -> str:
    """Read the field as UTF-8 text."""
    return stream.read().decode("utf-8")


def decode_pickle(stream: io.BytesIO) -> Any:
    """Unpickle the field, only after :func:`cloudshards.allow_unsafe_decoders`.

    Raises:
        DecodeError: Unsafe decoding is off; the message says how to turn it on.
    """
    return unpickle_loads(stream.read())


#: ``(glob, decoder)`` pairs that ``xdecode`` tries first, as in webdataset.
default_decoders: list[tuple[str, Callable[[Any], Any]]] = [
    ("*.bin", decode_bin),
    ("*.txt", decode_text),
    ("*.pyd", decode_pickle),
]


def _xdecode(
    source: Iterable[dict[str, Any]],
    *args: tuple[str, Any],
    must_decode: bool = True,
    defaults: Sequence[tuple[str, Any]] = default_decoders,
    **kw: Any,
) -> Iterator[dict[str, Any]]:
    """Decode fields by glob patterns; decoders get a binary stream; ``False`` keeps bytes."""
    decoders = [*defaults, *args, *(("*." + k, v) for k, v in kw.items())]
    for sample in source:
        new_sample: dict[str, Any] = {}
        for path, data in sample.items():
            if path.startswith("__"):
                new_sample[path] = data
                continue
            decoder: Any = find_decoder(decoders, path)
            if decoder is False:
                value = data
            elif decoder is None:
                if must_decode:
                    raise ValueError(f"No decoder found for {path}.")
                value = data
            else:
                value = decoder(io.BytesIO(data) if isinstance(data, bytes) else data)
            new_sample[path] = value
        yield new_sample


xdecode = pipelinefilter(_xdecode)


LMDBCached = unsupported_class("filters.LMDBCached", LMDB_INSTEAD)
