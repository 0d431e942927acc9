"""Balanced epochs: every rank and worker yields exactly the same number of samples, with no
duplicate ("drop") or at most one repeat each ("pad"), whatever the shard sizes."""

from __future__ import annotations

import logging
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudshards as wds
from cloudshards.balance import assign_samples, resolve_sample_counts
from cloudshards.errors import ConfigError

UNEVEN = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # 44 samples


def keys_of(dataset: Any) -> list[str]:
    return [sample["__key__"] for sample in dataset]


@pytest.mark.parametrize("seed", range(20))
def test_assignment_is_equal_disjoint_and_contiguous(seed: int) -> None:
    rng = random.Random(seed)
    counts = [rng.randrange(0, 12) for _ in range(rng.randrange(1, 12))]
    order = list(range(len(counts)))
    rng.shuffle(order)
    consumers = rng.randrange(1, 9)
    total = sum(counts)
    for mode in ("drop", "pad"):
        taken: Counter[tuple[int, int]] = Counter()
        lengths = []
        for consumer in range(consumers):
            segments = list(
                assign_samples(
                    ({"url": f"u{i}", "shard_index": i} for i in order),
                    dict(enumerate(counts)),
                    consumer=consumer,
                    num_consumers=consumers,
                    mode=mode,
                )
            )
            length = 0
            for segment in segments:
                assert segment["take"] > 0
                assert segment["skip"] + segment["take"] <= counts[segment["shard_index"]]
                for i in range(segment["skip"], segment["skip"] + segment["take"]):
                    if not segment.get("pad"):
                        taken[(segment["shard_index"], i)] += 1
                length += segment["take"]
            # Only the first and last segment may be partial shards (locality).
            real = [segment for segment in segments if not segment.get("pad")]
            for segment in real[1:-1]:
                assert segment["take"] == counts[segment["shard_index"]]
            lengths.append(length)
        expected = total // consumers if mode == "drop" else -(-total // consumers)
        assert lengths == [expected] * consumers
        assert all(n == 1 for n in taken.values())  # never twice, except the pad repeats
        assert total - len(taken) == (total % consumers if mode == "drop" else 0)


def ranks_keys(
    spec: str, monkeypatch: pytest.MonkeyPatch, world: int, **kw: Any
) -> list[list[str]]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    result = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        result.append(keys_of(wds.WebDataset(spec, seed=3, **kw)))
    return result


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_get_equal_counts_by_default(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    shards = make_shards(UNEVEN)
    for epoch in range(2):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        per_rank = []
        for rank in range(world):
            monkeypatch.setenv("RANK", str(rank))
            ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
            ds.set_epoch(epoch)
            per_rank.append(keys_of(ds))
        assert [len(keys) for keys in per_rank] == [44 // world] * world
        union = Counter(key for keys in per_rank for key in keys)
        assert max(union.values()) == 1
        assert set(union) <= set(shards.keys)
        assert len(shards.keys) - len(union) == 44 % world


def test_pad_mode_gives_everyone_the_ceiling(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    per_rank = ranks_keys(shards.spec(), monkeypatch, 3, shardshuffle=True, balance="pad")
    assert [len(keys) for keys in per_rank] == [15, 15, 15]
    union = Counter(key for keys in per_rank for key in keys)
    assert set(union) == set(shards.keys)
    assert sum(union.values()) - len(union) == 1  # one repeat fills the one short rank


def test_balanced_epochs_reshuffle_and_repeat_with_the_seed(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")

    def epoch_keys(epoch: int) -> list[str]:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5)
        ds.set_epoch(epoch)
        return keys_of(ds)

    assert epoch_keys(0) != epoch_keys(1)
    assert epoch_keys(1) == epoch_keys(1)


def test_workers_of_every_rank_yield_the_same_count(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    monkeypatch.setenv("WORLD_SIZE", "2")
    counts = []
    seen: Counter[str] = Counter()
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=1).batched(4)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        batches = list(loader)
        counts.append(len(batches))
        for batch in batches:
            seen.update(batch["__key__"])
    # 44 samples / 4 consumers = 11 each = 3 batches (4, 4, 3) per worker = 6 per rank.
    assert counts == [6, 6]
    assert max(seen.values()) == 1
    assert len(seen) == 44


def test_counts_come_from_an_index_a_mapping_or_one_counting_pass(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([2, 5, 3])
    urls = [str(p) for p in shards.paths]
    mapping = dict(zip(urls, [2, 5, 3], strict=True))
    assert resolve_sample_counts(urls, counts=mapping) == [2, 5, 3]
    with pytest.raises(ConfigError, match="3 shards"):
        resolve_sample_counts(urls, counts=[1, 2])
    with caplog.at_level(logging.WARNING):
        assert resolve_sample_counts(urls) == [2, 5, 3]
        assert "counting the samples of 3 shards" in caplog.text
        caplog.clear()
        assert resolve_sample_counts(urls) == [2, 5, 3]  # remembered: no second pass
        assert "counting" not in caplog.text
    index = wds.build_index(urls)
    wds.write_index(index, str(shards.paths[0].parent / "shard.index.json"))
    assert resolve_sample_counts(urls, index=str(shards.paths[0].parent / "shard.index.json")) == [
        2,
        5,
        3,
    ]


def write_members(path: Path, names: list[str], size: int) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"x" * size))


@pytest.mark.parametrize("same_size", [False, True])
def test_a_rewritten_shard_is_recounted(tmp_path: Path, same_size: bool) -> None:
    """The node remembers counts per shard *version*: a shard rewritten in place (a new size,
    or the same size and a new mtime) is counted again, so its new samples are all read."""
    shard = tmp_path / "shard-000000.tar"
    write_members(shard, ["a.bin"], 2048)
    assert resolve_sample_counts([str(shard)]) == [1]
    before = shard.stat()
    if same_size:
        # Four 512-byte members instead of one of 2048: tarfile pads both to one 10 KiB record.
        write_members(shard, ["a.bin", "b.bin", "c.bin", "d.bin"], 512)
        assert shard.stat().st_size == before.st_size
    else:
        write_members(shard, [f"{k}.bin" for k in "abcd"], 4096)
        assert shard.stat().st_size != before.st_size
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert resolve_sample_counts([str(shard)]) == [4]


def test_a_shard_shorter_than_its_count_still_keeps_ranks_equal(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([4, 4])
    wrong = {str(shards.paths[0]): 4, str(shards.paths[1]): 6}  # the second really has 4
    urls = [str(p) for p in shards.paths]
    per_rank = ranks_keys(urls, monkeypatch, 2, sample_counts=wrong, shardshuffle=False)
    assert [len(keys) for keys in per_rank] == [5, 5]
    assert "fewer samples than its count said" in caplog.text


def test_with_epoch_or_one_rank_does_not_balance(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3, 1, 4])
    assert len(keys_of(wds.WebDataset(shards.spec(), shardshuffle=False))) == 8
    per_rank = ranks_keys(shards.spec(), monkeypatch, 2, shardshuffle=False, empty_check=False)
    assert sorted(len(k) for k in per_rank) == [4, 4]
    monkeypatch.setenv("RANK", "0")
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).with_epoch(6)
    assert len(keys_of(ds)) == 6


def test_balance_refuses_what_it_cannot_combine_with(make_shards: Any) -> None:
    shards = make_shards([2, 2])
    with pytest.raises(ConfigError, match="balance"):
        wds.WebDataset(shards.spec(), balance="fair")
    with pytest.raises(ConfigError, match="resampled"):
        wds.WebDataset(shards.spec(), balance="drop", resampled=True)
    with pytest.raises(ConfigError, match="nodesplitter"):
        wds.WebDataset(shards.spec(), balance="drop", nodesplitter=lambda src: src)


def test_fewer_shards_than_consumers_is_explained(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([3, 3])
    ranks_keys(shards.spec(), monkeypatch, 3, balance=None, empty_check=False)
    assert "2 shards for 3 consumers" in caplog.text
    assert "balance='drop'" in caplog.text


def test_rank_and_world_size_can_be_given_explicitly(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    from_env = ranks_keys(shards.spec(), monkeypatch, 3, shardshuffle=True)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    explicit = [
        keys_of(wds.WebDataset(shards.spec(), seed=3, shardshuffle=True, rank=r, world_size=3))
        for r in range(3)
    ]
    assert explicit == from_env
    with pytest.raises(ConfigError, match="give both"):
        wds.WebDataset(shards.spec(), rank=1)
    with pytest.raises(ConfigError, match="0 <= rank < world_size"):
        wds.WebDataset(shards.spec(), rank=3, world_size=3)


def test_slurm_variables_give_the_rank(make_shards: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards(UNEVEN)
    from_env = ranks_keys(shards.spec(), monkeypatch, 2, shardshuffle=True)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    slurm = []
    for rank in range(2):
        monkeypatch.setenv("SLURM_PROCID", str(rank))
        slurm.append(keys_of(wds.WebDataset(shards.spec(), seed=3, shardshuffle=True)))
    assert slurm == from_env


def test_the_index_next_to_the_shards_is_found_once_then_remembered(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([2, 5, 3])
    urls = [str(p) for p in shards.paths]
    from cloudshards._index_files import default_index_url

    location = default_index_url(urls)
    wds.write_index(wds.build_index(urls), location)
    with caplog.at_level(logging.WARNING):
        assert resolve_sample_counts(urls) == [2, 5, 3]
        Path(location).unlink()  # later asks never go back to the store
        assert resolve_sample_counts(urls) == [2, 5, 3]
    assert "counting" not in caplog.text
