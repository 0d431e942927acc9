"""Sample shuffling with a bounded buffer (webdataset's ``shuffle`` and ``detshuffle``).

Resumption: approximate (up to ``bufsize`` buffered samples per worker are not replayed). The
buffer size, ``initial`` and seed are in the state fingerprint: a state saved with another
shuffle is refused.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

from cloudshards.stages.base import PipelineStage, make_rng

__all__ = ["Shuffler", "detshuffle", "pick", "shuffle"]


def pick(buf: list[Any], rng: random.Random) -> Any:
    """Remove and return a random element of ``buf`` in O(1)."""
    k = rng.randint(0, len(buf) - 1)
    sample = buf[k]
    buf[k] = buf[-1]
    buf.pop()
    return sample


def _shuffle(
    data: Iterable[Any],
    bufsize: int = 1000,
    initial: int = 100,
    rng: random.Random | None = None,
    seed: int | None = None,
    handler: Any = None,
) -> Iterator[Any]:
    """Shuffle ``data`` through a buffer of ``bufsize`` items, yielding once ``initial`` are in.

    Same algorithm as webdataset 1.0.2 (it pulls up to two items per output while filling).
    Without ``rng`` or ``seed`` the seed comes from the pipeline's (seed, epoch, rank, worker).
    """
    if seed is not None:
        if rng is not None:
            raise ValueError("pass either rng or seed to shuffle, not both")
        rng = random.Random(seed)
    elif rng is None:
        rng = make_rng("shuffle")
    initial = min(initial, bufsize)
    source = iter(data)
    buf: list[Any] = []
    for sample in source:
        buf.append(sample)
        if len(buf) < bufsize:
            try:  # noqa: SIM105 - faster than contextlib.suppress in this per-sample loop
                buf.append(next(source))
            except StopIteration:
                pass
        if len(buf) >= initial:
            yield pick(buf, rng)
    while buf:
        yield pick(buf, rng)


class Shuffler:
    """The ``shuffle(bufsize, initial, ...)`` filter; picks its RNG when the chain is built."""

    def __init__(
        self,
        bufsize: int = 1000,
        initial: int = 100,
        rng: random.Random | None = None,
        seed: int | None = None,
    ) -> None:
        self.bufsize = bufsize
        self.initial = initial
        self.rng = rng
        self.seed = seed

    def __call__(self, data: Iterable[Any]) -> Iterator[Any]:
        rng = self.rng
        if rng is None and self.seed is None:
            # Drawn now, while the pipeline's context is current, not lazily on first next().
            rng = make_rng("shuffle")
        return _shuffle(data, self.bufsize, self.initial, rng=rng, seed=self.seed)

    def stage_config(self) -> dict[str, Any]:
        """Buffer size, initial fill and seed (an explicit ``rng`` counts by its type)."""
        return {"bufsize": self.bufsize, "initial": self.initial, "seed": self.seed}

    def __repr__(self) -> str:
        return f"<shuffle bufsize={self.bufsize} initial={self.initial}>"


def shuffle(
    bufsize: int = 1000,
    initial: int = 100,
    rng: random.Random | None = None,
    seed: int | None = None,
    handler: Any = None,
) -> Shuffler:
    """Filter factory: shuffle samples through a buffer (see :func:`_shuffle`)."""
    return Shuffler(bufsize, initial, rng=rng, seed=seed)


class detshuffle(PipelineStage):
    """Deterministic shuffle: seeded by ``seed + epoch``, the epoch counting calls to ``run``."""

    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: int = 0, epoch: int = -1):
        self.bufsize = bufsize
        self.initial = initial
        self.seed = seed
        self.epoch = epoch

    def stage_config(self) -> dict[str, Any]:
        """Buffer size, initial fill and seed (not the epoch counter)."""
        return {"bufsize": self.bufsize, "initial": self.initial, "seed": self.seed}

    def run(self, src: Iterable[Any]) -> Iterator[Any]:
        """Shuffle ``src`` with the next epoch's seed."""
        self.epoch += 1
        rng = random.Random(self.seed + self.epoch)
        return _shuffle(src, self.bufsize, self.initial, rng)
