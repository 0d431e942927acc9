"""Batching and unbatching, with webdataset's collation (tensors and arrays are stacked).

Resumption: approximate (a partially filled batch is rebuilt from the restored position).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from cloudshards.stages.base import pipelinefilter

__all__ = [
    "_batched",
    "_unbatched",
    "_unlisted",
    "batched",
    "combine_values",
    "default_collation_fn",
    "unbatched",
    "unlisted",
]


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
                raise ValueError(f"all shapes must be equal in collation, got {shapes}")
            return torch.stack(list(b))
        return list(b)
    if isinstance(first, np.ndarray):
        if combine_tensors:
            shapes = {x.shape for x in b}
            if len(shapes) != 1:
                raise ValueError(f"all shapes must be equal in collation, got {shapes}")
            return np.array(list(b))
        return list(b)
    return list(b)


def default_collation_fn(
    samples: Sequence[Any], combine_tensors: bool = True, combine_scalars: bool = True
) -> Any:
    """Collate a list of tuples (or dicts) into one tuple (or dict) of columns."""
    first = samples[0]
    if isinstance(first, dict):
        keys = first.keys()
        for row in samples[1:]:
            if row.keys() != keys:
                raise ValueError("keys don't match in different samples")
        return {
            k: combine_values([row[k] for row in samples], combine_tensors, combine_scalars)
            for k in keys
        }
    width = len(first)
    for row in samples[1:]:
        if len(row) != width:
            raise ValueError("keys don't match in different samples")
    return tuple(
        combine_values([row[i] for row in samples], combine_tensors, combine_scalars)
        for i in range(width)
    )


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
    for batch in data:
        if not isinstance(batch, list):
            raise ValueError(f"unlisted expects lists, got {type(batch).__name__}")
        yield from batch


unlisted = pipelinefilter(_unlisted)


def _unbatched(data: Iterable[Any]) -> Iterator[Any]:
    """Split collated batches (tuples or dicts of columns) back into samples."""
    for sample in data:
        if isinstance(sample, (list, tuple)):
            for i in range(len(sample[0])):
                yield tuple(x[i] for x in sample)
        elif isinstance(sample, dict):
            lengths = {len(v) for v in sample.values()}
            if len(lengths) != 1:
                raise ValueError(f"unbatched: columns have different lengths {lengths}")
            for i in range(lengths.pop()):
                yield {k: v[i] for k, v in sample.items()}
        else:
            raise ValueError(f"unknown sample type: {type(sample)}")


unbatched = pipelinefilter(_unbatched)
