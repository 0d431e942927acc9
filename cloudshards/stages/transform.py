"""Per-sample transforms and filters: map, map_dict, map_tuple, select, rsample, decode.

Each ``_name`` generator has webdataset 1.0.2's signature and behaviour; ``name`` is its
curried filter factory. Resumption: exact (no buffered state).
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from cloudshards.handlers import reraise_exception
from cloudshards.stages.base import StageIterator, make_rng, per_sample, pipelinefilter
from cloudshards.types import ExceptionHandler, Sample

__all__ = [
    "Decode",
    "_associate",
    "_decode",
    "_info",
    "_log_keys",
    "_map",
    "_map_dict",
    "_map_tuple",
    "_rsample",
    "_select",
    "associate",
    "decode",
    "identity",
    "info",
    "log_keys",
    "map",
    "map_dict",
    "map_tuple",
    "rsample",
    "select",
]

logger = logging.getLogger(__name__)


def identity(x: Any) -> Any:
    """Return ``x`` unchanged."""
    return x


@per_sample
def _map(
    data: Iterable[Any], f: Callable[[Any], Any], handler: ExceptionHandler = reraise_exception
) -> Iterator[Any]:
    """Apply ``f`` to each sample; a None result drops the sample; dict results keep ``__key__``."""
    for sample in data:
        try:
            result = f(sample)
        except Exception as exn:
            if handler(exn):
                continue
            break
        if result is None:
            if not _told_none:
                _dropped_by_none(f)
            continue
        if isinstance(sample, dict) and isinstance(result, dict):
            result["__key__"] = sample.get("__key__")
        yield result


map = pipelinefilter(_map)

_told_none = False  # see _dropped_by_none


def _dropped_by_none(f: Callable[[Any], Any]) -> None:
    """Say once per process, in a multi-rank job, that a map dropped a sample: the loaders
    end an epoch together after a ``select`` (which they look for), not after a map, so the
    ranks may take unequal numbers of steps, which hangs DDP."""
    global _told_none
    _told_none = True
    from cloudshards.dist import WorkerInfo

    if WorkerInfo.detect().world_size > 1:
        logger.warning(
            "map(%s) returned None, which drops the sample (as in webdataset): in a "
            "multi-rank job the ranks may then get unequal numbers of batches, and DDP hangs. "
            "Filter with .select() instead: WebLoader and StatefulLoader end the epoch "
            "together after one (docs/distributed.md)",
            getattr(f, "__qualname__", type(f).__name__),
        )


@per_sample
class Decode:
    """The stage ``.decode(...)`` adds: :func:`_map` with a decoder, which can be told the
    fields the rest of the pipeline uses (``to_tuple`` right after it does).

    Resumption: exact (no buffered state).

    Args:
        decoder: Called on each sample (a :class:`~cloudshards.decoders.Decoder` can be
            narrowed; any other callable is used as it is).
        handler: What a decoding error does (webdataset handler).
    """

    #: Its class name in version 1 states (it was a ``map`` filter then).
    v1_name = "FilterFunction"

    def __init__(
        self, decoder: Callable[[Any], Any], handler: ExceptionHandler = reraise_exception
    ) -> None:
        self.decoder = decoder
        self.handler = handler

    def __call__(self, data: Iterable[Any]) -> Iterator[Any]:
        return _map(data, self.decoder, self.handler)

    def stage_config(self) -> dict[str, Any]:
        """Nothing: which fields are decoded, and how, changes no position."""
        return {}

    def for_fields(self, fields: set[str]) -> Decode | None:
        """A copy that decodes only ``fields``, or None when the decoder already chose its
        fields (``only=``) or is not a plain :class:`~cloudshards.decoders.Decoder`."""
        from cloudshards.decoders import Decoder

        decoder = self.decoder
        if type(decoder) is not Decoder or decoder.only is not None:
            return None
        narrowed = copy.copy(decoder)
        narrowed.only = set(fields)
        return Decode(narrowed, self.handler)

    def __repr__(self) -> str:
        return f"<decode {self.decoder!r}>"


@per_sample
def _map_dict(
    data: Iterable[Sample],
    handler: ExceptionHandler = reraise_exception,
    **kw: Callable[[Any], Any],
) -> Iterator[Sample]:
    """Apply ``kw[field]`` to ``sample[field]`` for each given field."""
    if not kw:
        raise ValueError("map_dict needs at least one field=function argument")
    for key, f in kw.items():
        if not callable(f):
            raise ValueError(f"map_dict: {key}={f!r} is not callable")
    for sample in data:
        try:
            for k, f in kw.items():
                sample[k] = f(sample[k])
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield sample


map_dict = pipelinefilter(_map_dict)


@per_sample
def _map_tuple(
    data: Iterable[Any],
    *args: Callable[[Any], Any] | None,
    handler: ExceptionHandler = reraise_exception,
) -> Iterator[tuple[Any, ...]]:
    """Apply ``args[i]`` to element ``i`` of each tuple sample (None leaves it unchanged)."""
    fns = [f if f is not None else identity for f in args]
    for f in fns:
        if not callable(f):
            raise ValueError(f"map_tuple: {f!r} is not callable")
    for sample in data:
        if not isinstance(sample, (list, tuple)):
            raise ValueError(f"map_tuple needs tuple samples, got {type(sample).__name__}")
        values = list(sample)
        n = min(len(fns), len(values))
        try:
            for i in range(n):
                values[i] = fns[i](values[i])
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield tuple(values)


map_tuple = pipelinefilter(_map_tuple)


@per_sample
def _select(data: Iterable[Any], predicate: Callable[[Any], bool]) -> Iterator[Any]:
    """Keep the samples for which ``predicate`` is true."""
    for sample in data:
        if predicate(sample):
            yield sample


select = pipelinefilter(_select)


def _rsample(data: Iterable[Any], p: float = 0.5) -> Iterator[Any]:
    """Keep each sample with probability ``p`` (seeded per epoch and worker); the draws made
    are kept in the pipeline's state, so a restored epoch keeps the same samples."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"rsample: p={p} must be in [0, 1]")
    return _Sampled(data, p)


class _Sampled(StageIterator[Any]):
    """Each sample of its source kept with probability ``p``.

    Resumption: exact (the draws made from the epoch's seeded RNG, replayed on restore;
    state key ``rsample``)."""

    state_key = "rsample"

    def __init__(self, data: Iterable[Any], p: float) -> None:
        self._source = iter(data)
        self._p = p
        self._rng = make_rng("rsample")  # while the chain is built: the epoch's context
        self._draws = 0

    def __next__(self) -> Any:
        uniform, p = self._rng.uniform, self._p
        for sample in self._source:
            self._draws += 1
            if uniform(0.0, 1.0) < p:
                return sample
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self._draws} if self._draws else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._draws = int(state["draws"])
        for _ in range(self._draws):  # the same sequence on: as the epoch drew it
            self._rng.uniform(0.0, 1.0)


rsample = pipelinefilter(_rsample)


def _associate(data: Iterable[Sample], associator: Any, **kw: Any) -> Iterator[Sample]:
    """Merge extra fields into each sample, from ``associator(key)`` or ``associator[key]``."""
    for sample in data:
        if callable(associator):
            extra = associator(sample["__key__"])
        else:
            extra = associator.get(sample["__key__"], {})
        sample.update(extra)
        yield sample


associate = pipelinefilter(_associate)


def _info(
    data: Iterable[Any],
    fmt: str | None = None,
    n: int = 3,
    every: int = -1,
    width: int = 50,
    stream: Any = None,
    name: str = "",
) -> Iterator[Any]:
    """Print the first ``n`` (and every ``every``-th) samples to ``stream`` (stderr)."""
    stream = stream if stream is not None else sys.stderr
    for i, sample in enumerate(data):
        if i < n or (every > 0 and (i + 1) % every == 0):
            if fmt is None:
                print("---", name, file=stream)
                for k, v in sample.items():
                    print(k, repr(v)[:width], file=stream)
            else:
                print(fmt.format(**sample), file=stream)
        yield sample


info = pipelinefilter(_info)


def _log_keys(data: Iterable[Any], logfile: str | None = None) -> Iterator[Any]:
    """Append ``index, __worker__, __rank__, __key__`` lines (tab-separated, as webdataset
    writes them) to ``logfile`` (if given) for each sample."""
    if not logfile:
        yield from data
        return
    # Line-buffered appends: each line is one write, so workers' lines do not interleave.
    fields = ("__worker__", "__rank__", "__key__")
    with open(logfile, "a", buffering=1) as stream:
        for i, sample in enumerate(data):
            worker, rank, key = (
                sample.get(k) if isinstance(sample, dict) else None for k in fields
            )
            stream.write(f"{i}\t{worker}\t{rank}\t{key}\n")
            yield sample


log_keys = pipelinefilter(_log_keys)


@per_sample
def _decode(
    data: Iterable[Sample], *args: Any, handler: ExceptionHandler = reraise_exception, **kw: Any
) -> Iterator[Sample]:
    """Decode each sample's fields with the given handlers (imagespec strings or functions)."""
    from cloudshards.decoders import make_decoder

    decoder = make_decoder(*args, **kw)
    for sample in data:
        try:
            decoded = decoder(sample)
        except Exception as exn:
            if handler(exn):
                continue
            break
        yield decoded


decode = pipelinefilter(_decode)
