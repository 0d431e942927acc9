"""Epoch shaping: slice, with_epoch-style truncation, and repeatedly.

Resumption: exact (counters only).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cloudshards.stages.base import pipelinefilter

__all__ = ["_slice", "guess_batchsize", "repeatedly", "repeatedly0", "slice"]


def _slice(data: Iterable[Any], *args: int | None) -> Iterator[Any]:
    """``itertools.islice`` as a filter: ``slice(stop)`` or ``slice(start, stop[, step])``."""
    return itertools.islice(data, *args)


slice = pipelinefilter(_slice)


def repeatedly0(
    loader: Iterable[Any], nepochs: int = sys.maxsize, nbatches: int = sys.maxsize
) -> Iterator[Any]:
    """Iterate ``loader`` ``nepochs`` times, at most ``nbatches`` items each."""
    for _ in range(nepochs):
        yield from itertools.islice(loader, nbatches)


def guess_batchsize(batch: Any) -> int:
    """The length of a batch's first column."""
    return len(batch[0])


def repeatedly(
    source: Iterable[Any],
    nepochs: int | None = None,
    nbatches: int | None = None,
    nsamples: int | None = None,
    batchsize: Callable[[Any], int] = guess_batchsize,
) -> Iterator[Any]:
    """Iterate ``source`` again and again until ``nepochs``, ``nbatches`` or ``nsamples``."""
    epoch = 0
    batch = 0
    total = 0
    while True:
        count = 0
        for sample in source:
            count += 1
            yield sample
            batch += 1
            if nbatches is not None and batch >= nbatches:
                return
            if nsamples is not None:
                total += batchsize(sample)
                if total >= nsamples:
                    return
        epoch += 1
        if count == 0 or (nepochs is not None and epoch >= nepochs):
            # An empty source would loop forever; webdataset 1.0.2 hangs here.
            return
