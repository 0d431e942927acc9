"""Batching and unbatching, with webdataset's collation (tensors and arrays are stacked).

Resumption: approximate (a partially filled batch is rebuilt from the restored position;
the rest of a batch being split by ``unbatched``/``unlisted`` is lost, with a warning).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import default_convert

from cloudshards.stages.base import StageIterator, checkpoint_warning, pipelinefilter

logger = logging.getLogger(__name__)

__all__ = [
    "CollationError",
    "_batched",
    "_unbatched",
    "_unlisted",
    "batched",
    "combine_values",
    "convert_batch",
    "default_collation_fn",
    "unbatched",
    "unlisted",
]


class CollationError(ValueError, AssertionError):
    """The arrays or tensors of one batch differ in shape, so they cannot be stacked. An
    ``AssertionError`` too, which webdataset 1.0.2 raises here (an ``assert``), so that code
    written for it catches it still."""


def _is_tensor(value: Any) -> bool:
    # Checked by module name so that this module need not import torch.
    return type(value).__module__.startswith("torch") and hasattr(value, "shape")


def combine_values(
    b: Sequence[Any], combine_tensors: bool = True, combine_scalars: bool = True
) -> Any:
    """Collate one column: ints/floats to a numpy array, tensors/arrays stacked, else a list."""
    first = b[0]
    if isinstance(first, (int, float)):
        if combine_scalars:
            return np.array(list(b))
        return list(b)
    if _is_tensor(first):
        if combine_tensors:
            import torch

            shapes = {x.shape for x in b}
            if len(shapes) != 1:
                raise CollationError(f"all shapes must be equal in collation, got {shapes}")
            return torch.stack(list(b))
        return list(b)
    if isinstance(first, np.ndarray):
        if combine_tensors:
            shapes = {x.shape for x in b}
            if len(shapes) != 1:
                raise CollationError(f"all shapes must be equal in collation, got {shapes}")
            return np.array(list(b))
        return list(b)
    return list(b)


def default_collation_fn(
    samples: Sequence[Any], combine_tensors: bool = True, combine_scalars: bool = True
) -> Any:
    """Collate a list of tuples (or dicts) into one tuple (or dict) of columns.

    Other samples (a bare tensor, array or string) are collated as webdataset collates them:
    as sequences, into a dict of columns keyed by position, ``{0: ..., 1: ...}``. A batch of
    1-D tensors ``[a, b]`` becomes ``{0: stack([a[0], b[0]]), 1: ...}``.
    """
    first = samples[0]
    if isinstance(first, dict):
        rows: Sequence[Mapping[Any, Any]] = samples
    elif isinstance(first, (list, tuple)):
        width = len(first)
        for row in samples[1:]:
            if len(row) != width:
                raise ValueError("keys don't match in different samples")
        return tuple(
            combine_values([row[i] for row in samples], combine_tensors, combine_scalars)
            for i in range(width)
        )
    else:
        rows = [dict(enumerate(sample)) for sample in samples]
    keys = rows[0].keys()
    for row in rows[1:]:
        if row.keys() != keys:
            raise ValueError("keys don't match in different samples")
    return {
        k: combine_values([row[k] for row in rows], combine_tensors, combine_scalars) for k in keys
    }


def _batched(
    data: Iterable[Any],
    batchsize: int = 20,
    collation_fn: Callable[[list[Any]], Any] | None = default_collation_fn,
    partial: bool = True,
) -> Iterator[Any]:
    """Group samples into batches of ``batchsize``; the last may be short when ``partial``."""
    if batchsize < 1:
        raise ValueError(f"batchsize must be >= 1, got {batchsize}")
    batch: list[Any] = []
    for sample in data:
        batch.append(sample)
        if len(batch) == batchsize:
            yield collation_fn(batch) if collation_fn is not None else batch
            batch = []
    if batch and (partial or len(batch) == batchsize):
        yield collation_fn(batch) if collation_fn is not None else batch


batched = pipelinefilter(_batched)


def _unlisted(data: Iterable[list[Any]]) -> Iterator[Any]:
    """Flatten lists of samples (``listed``'s output) back into samples."""
    return _Flattened("unlisted", data, _listed_samples)


def _listed_samples(batch: Any) -> list[Any]:
    if not isinstance(batch, list):
        raise ValueError(f"unlisted expects lists, got {type(batch).__name__}")
    return batch


unlisted = pipelinefilter(_unlisted)


def _unbatched(data: Iterable[Any]) -> Iterator[Any]:
    """Split collated batches (tuples or dicts of columns) back into samples."""
    return _Flattened("unbatched", data, _batch_samples)


def _batch_samples(sample: Any) -> list[Any]:
    if isinstance(sample, (list, tuple)):
        return [tuple(x[i] for x in sample) for i in range(len(sample[0]))]
    if isinstance(sample, dict):
        lengths = {len(v) for v in sample.values()}
        if len(lengths) != 1:
            raise ValueError(f"unbatched: columns have different lengths {lengths}")
        return [{k: v[i] for k, v in sample.items()} for i in range(lengths.pop())]
    raise ValueError(f"unknown sample type: {type(sample)}")


unbatched = pipelinefilter(_unbatched)


class _Flattened(StageIterator[Any]):
    """The samples of each batch of its source, one by one.

    Resumption: approximate. The stage before it has delivered the batch being split, so a
    checkpoint taken inside one cannot hold the rest of it (samples are no plain data): a
    restore loses them (at most a batch less one per worker), and such a checkpoint says so
    with a warning."""

    def __init__(self, key: str, data: Iterable[Any], split: Callable[[Any], list[Any]]) -> None:
        self.state_key = key  # type: ignore[misc]
        self._source = iter(data)
        self._split = split
        self._batch: list[Any] = []
        self._at = 0

    def __next__(self) -> Any:
        while self._at >= len(self._batch):
            self._batch, self._at = self._split(next(self._source)), 0
        sample = self._batch[self._at]
        self._at += 1
        return sample

    def state_dict(self) -> dict[str, Any]:
        if self._at < len(self._batch):  # the rest of this batch is not in the state
            key = self.state_key
            checkpoint_warning(key, functools.partial(_warn_inside_batch, key))
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass  # (nothing was saved: see state_dict)


_WARNED: set[str] = set()


def _warn_inside_batch(key: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "%s: a checkpoint taken inside a batch cannot hold the rest of it; a restore "
            "loses those samples (at most a batch less one per worker)",
            key,
        )


#: Types default_convert hands back as they are.
_LEAVES = frozenset({bytes, str, int, float, bool, type(None)})


def convert_batch(data: Any) -> Any:
    """torch's ``default_convert`` (what a DataLoader with ``batch_size=None`` applies to each
    item), with fast paths for the tuples and lists of bytes, strings and numbers that
    ``.batched()`` makes: the same result (tuples become lists, lists are copied, arrays
    become tensors), without its per-element isinstance checks against abstract classes."""
    kind = type(data)
    if kind is list:
        if all(type(item) in _LEAVES for item in data):
            return data.copy()
        return [convert_batch(item) for item in data]
    if kind is tuple:
        return [convert_batch(item) for item in data]
    if kind in _LEAVES:
        return data
    return default_convert(data)  # type: ignore[no-untyped-call]
