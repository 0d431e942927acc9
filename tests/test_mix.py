"""Dataset mixing, function-style wrappers and gopen."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import cloudshards as wds
from cloudshards.errors import ConfigError
from cloudshards.mix import random_samples


def test_round_robin_shortest_and_longest() -> None:
    assert list(wds.RoundRobin([[1, 2, 3], ["a"]])) == [1, "a", 2]
    assert list(wds.RoundRobin([[1, 2, 3], ["a"]], longest=True)) == [1, "a", 2, 3]


def test_random_mix_respects_proportions_and_exhaustion() -> None:
    import random

    mixed = list(random_samples([iter([0] * 900), iter([1] * 900)], [3, 1], rng=random.Random(0)))
    counts = Counter(mixed)
    assert 0.65 < counts[0] / len(mixed) < 0.85
    everything = list(wds.RandomMix([range(5), range(10, 13)], longest=True))
    assert sorted(everything) == [0, 1, 2, 3, 4, 10, 11, 12]
    with pytest.raises(ValueError, match="probabilities"):
        list(random_samples([iter([1])], [1, 2]))


def test_with_epoch_and_with_length_wrappers() -> None:
    epochs = wds.with_epoch(range(5), 3)
    assert list(epochs) == [0, 1, 2]
    assert list(epochs) == [0, 1, 2]  # a finished epoch starts the next from the beginning
    assert len(wds.with_length(range(5), 9)) == 9
    assert list(wds.with_length(range(2), 9)) == [0, 1]


def test_gopen_reads_and_writes(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    with wds.gopen(str(path), "wb") as out:
        out.write(b"payload")
    with wds.gopen(str(path)) as stream:
        assert stream.read() == b"payload"
    with pytest.raises(ConfigError):
        wds.gopen(str(path), "r")
    with pytest.raises(ConfigError, match="allow_pipe"):
        wds.gopen(f"pipe:cat {path}")
