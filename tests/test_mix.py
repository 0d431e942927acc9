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


def test_top_level_gopen_hands_out_files_as_webdataset_does(tmp_path: Path) -> None:
    """``wds.gopen`` is webdataset's: a local path is a real file (seek, tell, lines,
    ``fileno``: what ``torch.load`` and ``np.load`` need); a remote URL is a buffered stream
    with lines and ``peek``, as webdataset's ``curl`` pipe is."""
    import fsspec
    import torch

    path = tmp_path / "manifest.txt"
    path.write_bytes(b"a.tar\nb.tar\n")
    with wds.gopen(str(path)) as stream:
        assert [line.strip() for line in stream] == [b"a.tar", b"b.tar"]
        stream.seek(6)
        assert stream.tell() == 6
        assert stream.read() == b"b.tar\n"
        assert stream.fileno() >= 0
    weights = tmp_path / "w.pth"
    torch.save({"w": torch.ones(2)}, weights)
    with wds.gopen(str(weights)) as stream:
        assert torch.equal(torch.load(stream, weights_only=True)["w"], torch.ones(2))

    fs = fsspec.filesystem("memory")
    fs.pipe("/top-gopen/m.txt", b"x.tar\ny.tar\n" * 1000)
    try:
        with wds.gopen("memory://top-gopen/m.txt") as stream:
            assert stream.peek(1)[:1] == b"x"
            assert stream.readline() == b"x.tar\n"
            assert sum(1 for _ in stream) == 1999
            assert stream.read() == b""
        with wds.gopen("memory://top-gopen/m.txt") as stream:
            assert stream.read() == b"x.tar\ny.tar\n" * 1000
    finally:
        fs.rm("/top-gopen", recursive=True)


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
