"""Mixing several datasets: webdataset's ``RoundRobin`` and ``RandomMix``.

Resumption: exact. A running mix (:class:`MixIterator`) saves which sources are still in it,
whose turn it is or its RNG's state, and each source's position: the source's own
``state_dict()`` when it has one (a cloudshards pipeline: shuffle buffers included), else the
number of items taken from it, skipped again on restore. Their configuration (number of
datasets, proportions) is in a pipeline's state fingerprint.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from cloudshards.stages.base import make_rng, rng_state, set_rng_state

__all__ = [
    "MixIterator",
    "RandomMix",
    "RoundRobin",
    "WeightedMix",
    "random_samples",
    "round_robin_longest",
    "round_robin_shortest",
]


def round_robin_shortest(*sources: Iterator[Any]) -> Iterator[Any]:
    """Take one item from each source in turn; stop when any source is exhausted."""
    yield from _robin(list(sources), False, _Mixing(len(sources), None))


def round_robin_longest(*sources: Iterator[Any]) -> Iterator[Any]:
    """Take one item from each source in turn, dropping exhausted sources, until none is left."""
    yield from _robin(list(sources), True, _Mixing(len(sources), None))


class _Resumable:
    """What RoundRobin and RandomMix share: the running mix's state, and a restore."""

    def state_dict(self) -> dict[str, Any]:
        """The running mix's position (see :class:`MixIterator`); ``{}`` before it runs."""
        live = self.__dict__.get("_live")
        return live.state_dict() if live is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result at the next ``iter()``."""
        self.__dict__["_restore"] = dict(state)

    def __getstate__(self) -> dict[str, Any]:
        # A running mix (its generator) does not travel to DataLoader workers; a restore does.
        return {k: v for k, v in self.__dict__.items() if k != "_live"}


class RoundRobin(_Resumable, IterableDataset):  # type: ignore[type-arg]
    """Interleave datasets one item at a time (until the shortest ends, or all with ``longest``)."""

    def __init__(self, datasets: Sequence[Iterable[Any]], longest: bool = False) -> None:
        self.datasets = datasets
        self.longest = longest

    def stage_config(self) -> dict[str, Any]:
        """How many datasets are interleaved, and until when."""
        return {"datasets": _count(self.datasets), "longest": self.longest}

    def __iter__(self) -> MixIterator:
        return _start(self, MixIterator(self.datasets, None, self.longest, None))


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
    mixing = _Mixing(len(sources), rng if rng is not None else make_rng("mix"))
    yield from _drawn(list(sources), weights, longest, mixing)


class RandomMix(_Resumable, IterableDataset):  # type: ignore[type-arg]
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

    def __iter__(self) -> MixIterator:
        datasets = list(self.datasets)
        weights = [1.0] * len(datasets) if self.probs is None else self.probs
        return _start(self, MixIterator(datasets, weights, self.longest, make_rng("mix")))


class WeightedMix(_Resumable, IterableDataset):  # type: ignore[type-arg]
    """Mix datasets in fixed proportions, deterministically: after any number of items, each
    dataset has given its share of them to within one item (smooth weighted round robin), in
    the same order on every rank and worker, so that every rank trains on the same mixture.
    With ``with_epoch(n)`` each rank's epoch is ``n`` items of it. Resumable exactly, like
    :class:`RandomMix`.

    Args:
        datasets: The datasets (each a cloudshards pipeline, or any iterable).
        weights: Their proportions (any positive numbers; normalised).
        longest: When a dataset runs out, go on with the others in their proportions (default:
            stop).
    """

    def __init__(
        self, datasets: Sequence[Iterable[Any]], weights: Sequence[float], longest: bool = False
    ) -> None:
        if not weights or any(float(w) <= 0 for w in weights):
            raise ValueError(f"weights must be positive numbers, got {list(weights)}")
        self.datasets = datasets
        self.weights = [float(w) for w in weights]
        self.longest = longest

    def stage_config(self) -> dict[str, Any]:
        """How many datasets are mixed, in which proportions, until when."""
        return {"datasets": _count(self.datasets), "weights": self.weights, "smooth": True}

    def __iter__(self) -> MixIterator:
        return _start(self, MixIterator(self.datasets, self.weights, self.longest, None))


def _count(datasets: Any) -> int | None:
    return len(datasets) if hasattr(datasets, "__len__") else None


def _start(mix: Any, it: MixIterator) -> MixIterator:
    """Hand ``it`` the state ``mix`` was restored with (once), and keep it as the live one."""
    restore = mix.__dict__.pop("_restore", None)
    if restore:
        it.load_state_dict(restore)
    mix._live = it
    return it


class _Mixing:
    """What a running mix shares with its generator (which must not refer to the iterator)."""

    __slots__ = ("alive", "credits", "rng", "taken", "turn")

    def __init__(self, count: int, rng: random.Random | None) -> None:
        self.alive = list(range(count))  # the sources still in the mix, in order
        self.taken = [0] * count  # items taken from each source
        self.turn = 0  # round robin: the position in ``alive`` of the next source
        self.credits = [0.0] * count  # weighted mix: each source's credit
        self.rng = rng


class MixIterator:
    """A running ``RoundRobin`` (``weights`` None), ``WeightedMix`` (weights, no ``rng``) or
    ``RandomMix``, resumable exactly.

    Its state: the sources still in the mix, the round robin's turn or the RNG's state, and
    for each source its own ``state_dict()`` when it has one (restored with its
    ``load_state_dict()`` before it is iterated again), else the number of items taken from it
    (skipped again on restore, which is exact for a source that yields the same items each
    time).
    """

    state_key = "mix"

    def __init__(
        self,
        datasets: Iterable[Any],
        weights: Sequence[float] | None,
        longest: bool,
        rng: random.Random | None,
    ) -> None:
        self._datasets = list(datasets)
        if weights is not None and len(weights) != len(self._datasets):
            raise ValueError(f"got {len(weights)} probabilities for {len(self._datasets)} datasets")
        self._weights = None if weights is None else [float(w) for w in weights]
        self._longest = longest
        self._mixing = _Mixing(len(self._datasets), rng)
        self._restore: Mapping[str, Any] | None = None
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._it is None:
            self._it = self._begin()
        return self._it

    def __next__(self) -> Any:
        return next(self.__iter__())

    def _begin(self) -> Iterator[Any]:
        mixing, restore = self._mixing, self._restore or {}
        saved = restore.get("sources", {})
        sources: list[Iterator[Any]] = []
        for number, dataset in enumerate(self._datasets):
            state = saved.get(str(number))
            if isinstance(state, Mapping) and callable(getattr(dataset, "load_state_dict", None)):
                dataset.load_state_dict(state)
                source = iter(dataset)
            else:
                source = iter(dataset)
                skip = int(state) if isinstance(state, int) else 0
                source = itertools.islice(source, skip, None) if skip else source
            sources.append(source)
        if restore:
            mixing.alive = [int(i) for i in restore["alive"]]
            mixing.taken = [int(n) for n in restore["taken"]]
            mixing.turn = int(restore.get("turn", 0))
            mixing.credits = [float(c) for c in restore.get("credits", mixing.credits)]
            if mixing.rng is not None and restore.get("rng") is not None:
                set_rng_state(mixing.rng, restore["rng"])
        if self._weights is None:
            return _robin(sources, self._longest, mixing)
        if mixing.rng is None:
            return _smooth(sources, self._weights, self._longest, mixing)
        return _drawn(sources, self._weights, self._longest, mixing)

    def state_dict(self) -> dict[str, Any]:
        """``{"alive": [...], "taken": [...], "turn": i, "rng": ..., "sources": {...}}``;
        ``{}`` before the first item."""
        mixing = self._mixing
        if not any(mixing.taken):
            return {}
        sources: dict[str, Any] = {}
        for number, dataset in enumerate(self._datasets):
            state_dict = getattr(dataset, "state_dict", None)
            sources[str(number)] = state_dict() if callable(state_dict) else mixing.taken[number]
        rng = None if mixing.rng is None else rng_state(mixing.rng)
        return {
            "alive": list(mixing.alive),
            "taken": list(mixing.taken),
            "turn": mixing.turn,
            "credits": list(mixing.credits),
            "rng": rng,
            "sources": sources,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result (before the first item)."""
        if self._it is not None:
            raise RuntimeError("a mix is restored before it starts")
        self._restore = state


def _robin(sources: list[Iterator[Any]], longest: bool, mixing: _Mixing) -> Iterator[Any]:
    """:func:`round_robin_longest` / :func:`round_robin_shortest` over ``mixing``."""
    alive, taken = mixing.alive, mixing.taken
    while alive:
        mixing.turn %= len(alive)
        number = alive[mixing.turn]
        try:
            sample = next(sources[number])
        except StopIteration:
            if not longest:
                alive.clear()
                return
            del alive[mixing.turn]
            continue
        taken[number] += 1
        mixing.turn += 1
        yield sample


def _smooth(
    sources: list[Iterator[Any]], weights: list[float], longest: bool, mixing: _Mixing
) -> Iterator[Any]:
    """Smooth weighted round robin over ``mixing``: each step every source still in the mix
    earns its weight, the one with the most credit (the first on a tie) gives the item and pays
    back the total. Any prefix of the output holds each source's share to within one item."""
    alive, taken, credits = mixing.alive, mixing.taken, mixing.credits
    while alive:
        total = sum(weights[number] for number in alive)
        for number in alive:
            credits[number] += weights[number]
        number = max(alive, key=lambda n: (credits[n], -n))
        try:
            sample = next(sources[number])
        except StopIteration:
            for other in alive:  # this step gave nothing: undo its credits
                credits[other] -= weights[other]
            if not longest:
                alive.clear()
                return
            alive.remove(number)
            continue
        credits[number] -= total
        taken[number] += 1
        yield sample


def _drawn(
    sources: list[Iterator[Any]], weights: list[float], longest: bool, mixing: _Mixing
) -> Iterator[Any]:
    """:func:`random_samples` over ``mixing``."""
    rng = mixing.rng
    assert rng is not None
    alive, taken = mixing.alive, mixing.taken
    while alive:
        live = [weights[number] for number in alive]
        total = sum(live)
        cumulative = list(itertools.accumulate(w / total for w in live))
        position = min(bisect.bisect_left(cumulative, rng.random()), len(alive) - 1)
        number = alive[position]
        try:
            sample = next(sources[number])
        except StopIteration:
            if not longest:
                alive.clear()
                return
            del alive[position]
            continue
        taken[number] += 1
        yield sample
