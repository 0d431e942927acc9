"""Mixing several datasets: webdataset's ``RoundRobin`` and ``RandomMix``.

Resumption: none yet (a mix keeps no state; its datasets restart). Their configuration (number
of datasets, proportions) is in a pipeline's state fingerprint.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from cloudshards.stages.base import make_rng

__all__ = [
    "RandomMix",
    "RoundRobin",
    "random_samples",
    "round_robin_longest",
    "round_robin_shortest",
]


def round_robin_shortest(*sources: Iterator[Any]) -> Iterator[Any]:
    """Take one item from each source in turn; stop when any source is exhausted."""
    for i in itertools.count():
        try:
            yield next(sources[i % len(sources)])
        except StopIteration:
            return


def round_robin_longest(*sources: Iterator[Any]) -> Iterator[Any]:
    """Take one item from each source in turn, dropping exhausted sources, until none is left."""
    remaining = list(sources)
    i = 0
    while remaining:
        i %= len(remaining)
        try:
            sample = next(remaining[i])
        except StopIteration:
            del remaining[i]
            continue
        i += 1
        yield sample


class RoundRobin(IterableDataset):  # type: ignore[type-arg]
    """Interleave datasets one item at a time (until the shortest ends, or all with ``longest``)."""

    def __init__(self, datasets: Sequence[Iterable[Any]], longest: bool = False) -> None:
        self.datasets = datasets
        self.longest = longest

    def stage_config(self) -> dict[str, Any]:
        """How many datasets are interleaved, and until when."""
        return {"datasets": _count(self.datasets), "longest": self.longest}

    def __iter__(self) -> Iterator[Any]:
        sources = [iter(d) for d in self.datasets]
        if self.longest:
            return round_robin_longest(*sources)
        return round_robin_shortest(*sources)


def random_samples(
    sources: list[Iterator[Any]],
    probs: Sequence[float] | None = None,
    longest: bool = False,
    rng: random.Random | None = None,
) -> Iterator[Any]:
    """Draw each item from a source chosen with probability ``probs[i]``.

    Stops when a source is exhausted, or (``longest``) drops it and continues with the rest.
    """
    weights = [1.0] * len(sources) if probs is None else [float(p) for p in probs]
    if len(weights) != len(sources):
        raise ValueError(f"got {len(weights)} probabilities for {len(sources)} datasets")
    rng = rng if rng is not None else make_rng("mix")
    sources = list(sources)
    while sources:
        total = sum(weights)
        cumulative = list(itertools.accumulate(w / total for w in weights))
        i = min(bisect.bisect_left(cumulative, rng.random()), len(sources) - 1)
        try:
            yield next(sources[i])
        except StopIteration:
            if not longest:
                return
            del sources[i]
            del weights[i]


class RandomMix(IterableDataset):  # type: ignore[type-arg]
    """Mix datasets at random in the given proportions."""

    def __init__(
        self,
        datasets: Sequence[Iterable[Any]],
        probs: Sequence[float] | None = None,
        longest: bool = False,
    ) -> None:
        self.datasets = datasets
        self.probs = probs
        self.longest = longest

    def stage_config(self) -> dict[str, Any]:
        """How many datasets are mixed, in which proportions, until when."""
        probs = None if self.probs is None else [float(p) for p in self.probs]
        return {"datasets": _count(self.datasets), "probs": probs, "longest": self.longest}

    def __iter__(self) -> Iterator[Any]:
        sources = [iter(d) for d in self.datasets]
        return random_samples(sources, self.probs, longest=self.longest)


def _count(datasets: Any) -> int | None:
    return len(datasets) if hasattr(datasets, "__len__") else None
