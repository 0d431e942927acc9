"""The orders of a running mix: round robin, smooth weighted round robin (by weights or by
quotas) and random draws, each a generator over the sources that keeps its position in a
:class:`Mixing` (what :class:`~cloudshards.mix.MixIterator` saves and restores)."""

from __future__ import annotations

import bisect
import itertools
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Mixing", "drawn", "quota", "robin", "smooth"]

logger = logging.getLogger("cloudshards.mix")


class Mixing:
    """What a running mix shares with its generator (which must not refer to the iterator)."""

    __slots__ = ("alive", "credits", "passes", "rng", "taken", "turn")

    def __init__(self, count: int, rng: random.Random | None) -> None:
        self.alive = list(range(count))  # the sources still in the mix, in order
        self.taken = [0] * count  # items taken from each source
        self.turn = 0  # round robin: the position in ``alive`` of the next source
        self.credits = [0.0] * count  # weighted mix: each source's credit
        self.passes = [0] * count  # mix by counts: the source's pass in this epoch
        self.rng = rng


def robin(sources: list[Iterator[Any]], longest: bool, mixing: Mixing) -> Iterator[Any]:
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


def smooth(
    sources: list[Iterator[Any]], weights: list[float], longest: bool, mixing: Mixing
) -> Iterator[Any]:
    """Smooth weighted round robin over ``mixing``: each step every source still in the mix
    earns its weight, the one with the most credit (the first on a tie) gives the item and pays
    back the total. Any prefix of the output holds each source's share to within one item."""
    alive, taken, credits = mixing.alive, mixing.taken, mixing.credits
    while alive:
        total = sum(weights[number] for number in alive)
        number = _credit(alive, weights, credits, 1)
        try:
            sample = next(sources[number])
        except StopIteration:
            _credit(alive, weights, credits, -1)  # this step gave nothing: undo its credits
            if not longest:
                alive.clear()
                return
            alive.remove(number)
            continue
        credits[number] -= total
        taken[number] += 1
        yield sample


def quota(
    sources: list[Iterator[Any]],
    quotas: list[int],
    mixing: Mixing,
    reopen: Callable[[int], Iterator[Any]],
) -> Iterator[Any]:
    """Smooth weighted round robin by ``quotas`` until each source gave its quota; a source
    that runs out first is read again (its next pass), one whose pass gives nothing leaves."""
    alive, taken, credits, passes = mixing.alive, mixing.taken, mixing.credits, mixing.passes
    alive[:] = [number for number in alive if taken[number] < quotas[number]]
    total = sum(quotas)
    empty: set[int] = set()  # reopened, nothing from them yet
    while alive:
        number = _credit(alive, quotas, credits, 1)
        try:
            sample = next(sources[number])
        except StopIteration:
            _credit(alive, quotas, credits, -1)  # this step gave nothing: undo its credits
            if number in empty:
                logger.warning("mix: dataset %d gives no samples; left out of the mix", number)
                alive.remove(number)
                continue
            passes[number] += 1
            sources[number] = reopen(number)
            empty.add(number)
            continue
        empty.discard(number)
        credits[number] -= total
        taken[number] += 1
        if taken[number] >= quotas[number]:
            alive.remove(number)
        yield sample


def drawn(
    sources: list[Iterator[Any]], weights: list[float], longest: bool, mixing: Mixing
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


def _credit(alive: list[int], weights: Any, credits: list[float], sign: int) -> int:
    """One step of smooth weighted round robin: every source still in the mix earns its weight
    (``sign`` -1 takes it back); the one with the most credit (the first on a tie) is next."""
    for number in alive:
        credits[number] += sign * weights[number]
    return max(alive, key=lambda n: (credits[n], -n))
