"""webdataset 1.0.2's ``webdataset.mix``: round-robin and random mixing of datasets.

``RandomMix`` draws from a seeded RNG (per pipeline seed, epoch and worker) instead of the
global ``random`` module.
"""

from __future__ import annotations

from cloudshards.mix import (
    RandomMix,
    RoundRobin,
    random_samples,
    round_robin_longest,
    round_robin_shortest,
)

__all__ = [
    "RandomMix",
    "RoundRobin",
    "random_samples",
    "round_robin_longest",
    "round_robin_shortest",
]
