"""Epoch shaping: slice, with_epoch-style truncation (:class:`EpochLimiter`), and repeatedly.

Resumption: exact (counters only: a slice's items taken, an epoch's pass and items).
"""

from __future__ import annotations

import builtins
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from cloudshards.stages.base import StageIterator, pipelinefilter

__all__ = ["EpochLimiter", "guess_batchsize", "repeatedly", "slice"]


class EpochLimiter:
    """A pipeline's passes over its data in one epoch (``repeat``) and the epoch's length
    (``with_epoch``): its configuration, and while an epoch runs, its position.

    The pipeline makes one per ``iter()``, runs pass after pass (a pass that yields nothing
    ends the epoch) and counts the items it delivers in ``repetition`` and ``yielded``.

    Resumption: exact (the pass and the items delivered in the epoch; state key ``passes``).

    Args:
        repetitions: Passes per epoch (``sys.maxsize``: until ``nsamples``).
        nsamples: Items per epoch, or -1 for no limit.
    """

    __slots__ = ("nsamples", "repetition", "repetitions", "yielded")

    state_key = "passes"

    def __init__(self, repetitions: int = 1, nsamples: int = -1) -> None:
        self.repetitions = repetitions
        self.nsamples = nsamples
        self.repetition = 0
        self.yielded = 0

    @property
    def limit(self) -> int:
        """Items per epoch (``sys.maxsize`` when unlimited)."""
        return self.nsamples if self.nsamples > 0 else sys.maxsize

    def stage_config(self) -> dict[str, Any]:
        """Passes and items per epoch."""
        return {"repetitions": self.repetitions, "nsamples": self.nsamples}

    def state_dict(self) -> dict[str, Any]:
        """The current pass and the items delivered this epoch (``{}`` before any)."""
        if not (self.repetition or self.yielded):
            return {}
        return {"repetition": self.repetition, "yielded": self.yielded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue in pass ``repetition`` with ``yielded`` items already delivered."""
        self.repetition = int(state.get("repetition", 0))
        self.yielded = int(state.get("yielded", 0))


def _slice(data: Iterable[Any], *args: int | None) -> Iterator[Any]:
    """``itertools.islice`` as a filter: ``slice(stop)`` or ``slice(start, stop[, step])``;
    it keeps its position (the items it took) in the pipeline's state."""
    itertools.islice((), *args)  # islice's own checks of the arguments, and its errors
    bounds = builtins.slice(*args)
    return _Sliced(data, bounds.start or 0, bounds.stop, bounds.step or 1)


class _Sliced(StageIterator[Any]):
    """A slice of its source, by the index of each item taken from it.

    Resumption: exact (the items taken; state key ``slice``)."""

    state_key = "slice"

    def __init__(self, data: Iterable[Any], start: int, stop: int | None, step: int) -> None:
        self._source = iter(data)
        self._start, self._stop, self._step = start, stop, step
        self._taken = 0

    def __next__(self) -> Any:
        while self._stop is None or self._taken < self._stop:  # never one item past the end
            item = next(self._source)
            index, self._taken = self._taken, self._taken + 1
            if index >= self._start and (index - self._start) % self._step == 0:
                return item
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"taken": self._taken} if self._taken else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._taken = int(state["taken"])


slice = pipelinefilter(_slice)


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
