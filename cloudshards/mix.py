"""Mixing several datasets: webdataset's ``RoundRobin`` and ``RandomMix``.

Resumption: exact. A running mix (:class:`MixIterator`) saves which sources are still in it,
whose turn it is or its RNG's state, and each source's position: the source's own
``state_dict()`` when it has one (a cloudshards pipeline: shuffle buffers included), else the
number of items taken from it, skipped again on restore. Their configuration (number of
datasets, proportions) is in a pipeline's state fingerprint.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from cloudshards.dist import WorkerInfo
from cloudshards.errors import StateMismatchError
from cloudshards.mixelastic import elastic_restore
from cloudshards.mixorder import Mixing, drawn, quota, robin, smooth
from cloudshards.stages.base import current_context, make_rng, rng_state, set_rng_state

#: Epochs of a dataset per epoch of a mix by counts: pass ``p`` of mix epoch ``e`` sets the
#: dataset's epoch to ``e * _PASSES + p`` (each pass another order).
_PASSES = 1024

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
    yield from robin(list(sources), False, Mixing(len(sources), None))


def round_robin_longest(*sources: Iterator[Any]) -> Iterator[Any]:
    """Take one item from each source in turn, dropping exhausted sources, until none is left."""
    yield from robin(list(sources), True, Mixing(len(sources), None))


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
    mixing = Mixing(len(sources), rng if rng is not None else make_rng("mix"))
    yield from drawn(list(sources), weights, longest, mixing)


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
    Resumable exactly, like :class:`RandomMix`.

    By ``weights``, the mix runs until a dataset runs out (or, ``longest``, all do); cut its
    epochs with ``with_epoch(n)``: each rank's epoch is then ``n`` items of it. By ``counts``,
    each epoch holds that many samples of each dataset over the whole job: every rank and
    DataLoader worker takes ``counts[i] // (ranks x workers)`` of dataset ``i`` (the
    remainder, fewer than ranks x workers, is left out), so epochs are equal everywhere with
    no ``with_epoch``. A dataset whose epoch gives fewer is read again (its next pass, in
    another order: upsampling); one that gives more contributes the first of its samples in
    that epoch's order (a different subset each epoch: subsampling).

    Inside a pipeline the mix sets each dataset's epoch from the pipeline's (its
    ``set_epoch``), so every dataset reshuffles each epoch and resumes with it.

    Args:
        datasets: The datasets (each a cloudshards pipeline, or any iterable).
        weights: Their proportions (any positive numbers; normalised).
        longest: When a dataset runs out, go on with the others in their proportions (default:
            stop). Weights only.
        counts: Samples of each dataset per epoch, over all ranks and workers (instead of
            ``weights``).
    """

    def __init__(
        self,
        datasets: Sequence[Iterable[Any]],
        weights: Sequence[float] | None = None,
        longest: bool = False,
        *,
        counts: Sequence[int] | None = None,
    ) -> None:
        if (weights is None) == (counts is None):
            raise ValueError("give WeightedMix either weights or counts")
        if counts is not None and (not counts or any(int(n) < 0 for n in counts)):
            raise ValueError(f"counts must be numbers of samples, got {list(counts)}")
        if weights is not None and (not weights or any(float(w) <= 0 for w in weights)):
            raise ValueError(f"weights must be positive numbers, got {list(weights)}")
        self.datasets = datasets
        self.weights = None if weights is None else [float(w) for w in weights]
        self.counts = None if counts is None else [int(n) for n in counts]
        self.longest = longest

    def stage_config(self) -> dict[str, Any]:
        """How many datasets are mixed, in which proportions, until when."""
        config: dict[str, Any] = {"datasets": _count(self.datasets), "smooth": True}
        if self.counts is not None:
            return {**config, "counts": self.counts}
        return {**config, "weights": self.weights}

    def restore_elastic(
        self, old: Sequence[Mapping[str, Any]], layout: tuple[int, int], batch: int
    ) -> None:
        """At the next ``iter()``, continue an epoch saved by another number of ranks or
        workers (every old consumer's mix state, and their (ranks, workers)); see
        :mod:`cloudshards.mixelastic`."""
        if self.counts is None:
            raise StateMismatchError(
                "a mix by weights has no end of epoch to divide: give it with_epoch(n), or "
                "mix by counts, to restore it on another number of ranks or workers"
            )
        self.__dict__["_elastic"] = (list(old), layout, batch)

    def __iter__(self) -> MixIterator:
        if self.counts is None:
            return _start(self, MixIterator(self.datasets, self.weights, self.longest, None))
        context = current_context()
        info = context.info if context is not None else WorkerInfo.detect()
        quotas = [count // info.num_consumers for count in self.counts]
        elastic = self.__dict__.pop("_elastic", None)
        if elastic is not None:
            old, layout, batch = elastic
            quotas, restore = elastic_restore(self.counts, old, layout, info, batch)
            self.__dict__["_restore"] = restore
        it = MixIterator(self.datasets, [float(q) for q in quotas], False, None, quotas)
        return _start(self, it)


def _count(datasets: Any) -> int | None:
    return len(datasets) if hasattr(datasets, "__len__") else None


def _start(mix: Any, it: MixIterator) -> MixIterator:
    """Hand ``it`` the state ``mix`` was restored with (once), and keep it as the live one."""
    restore = mix.__dict__.pop("_restore", None)
    if restore:
        it.load_state_dict(restore)
    mix._live = it
    return it


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
        quotas: Sequence[int] | None = None,
    ) -> None:
        self._datasets = list(datasets)
        self._quotas = None if quotas is None else list(quotas)
        context = current_context()
        self._epoch = None if context is None else context.epoch
        if weights is not None and len(weights) != len(self._datasets):
            raise ValueError(f"got {len(weights)} probabilities for {len(self._datasets)} datasets")
        self._weights = None if weights is None else [float(w) for w in weights]
        self._longest = longest
        self._mixing = Mixing(len(self._datasets), rng)
        self._restore: Mapping[str, Any] | None = None
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._it is None:
            self._it = self._begin()
        return self._it

    def __next__(self) -> Any:
        return next(self.__iter__())

    def _open(self, number: int, state: Any = None) -> Iterator[Any]:
        """Source ``number`` in its current pass: its epoch set from the pipeline's, then its
        saved state (a pipeline's) or the items to skip (any other iterable) restored."""
        dataset = self._datasets[number]
        set_epoch = getattr(dataset, "set_epoch", None)
        if self._epoch is not None and callable(set_epoch):
            set_epoch(self._epoch * _PASSES + self._mixing.passes[number])
        if isinstance(state, Mapping) and callable(getattr(dataset, "load_state_dict", None)):
            dataset.load_state_dict(state)
            return iter(dataset)
        skip = int(state) if isinstance(state, int) else 0
        return itertools.islice(iter(dataset), skip, None) if skip else iter(dataset)

    def _begin(self) -> Iterator[Any]:
        mixing, restore = self._mixing, self._restore or {}
        saved = restore.get("sources", {})
        if restore:
            mixing.alive = [int(i) for i in restore["alive"]]
            mixing.taken = [int(n) for n in restore["taken"]]
            mixing.turn = int(restore.get("turn", 0))
            mixing.credits = [float(c) for c in restore.get("credits", mixing.credits)]
            mixing.passes = [int(n) for n in restore.get("passes", mixing.passes)]
            if restore.get("quotas") is not None:  # an elastic restore's share
                self._quotas = [int(n) for n in restore["quotas"]]
                self._weights = [float(n) for n in self._quotas]
            if mixing.rng is not None and restore.get("rng") is not None:
                set_rng_state(mixing.rng, restore["rng"])
        sources = [self._open(n, saved.get(str(n))) for n in range(len(self._datasets))]
        if self._quotas is not None:
            return quota(sources, self._quotas, mixing, self._open)
        if self._weights is None:
            return robin(sources, self._longest, mixing)
        if mixing.rng is None:
            return smooth(sources, self._weights, self._longest, mixing)
        return drawn(sources, self._weights, self._longest, mixing)

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
            "passes": list(mixing.passes),
            "quotas": self._quotas,
            "rng": rng,
            "sources": sources,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result (before the first item)."""
        if self._it is not None:
            raise RuntimeError("a mix is restored before it starts")
        self._restore = state
