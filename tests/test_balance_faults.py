"""Balanced epochs stay equal across ranks when shards fail: a shard cut short, missing, or
holding fewer samples than its count, let pass by a continuing handler. Each rank must still
yield its share (unequal counts hang DDP): the shortfall repeats the last sample read."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

import cloudshards as wds
from cloudshards.errors import ShardError

SIZES = [7, 13, 5, 11, 9]  # 45 samples: 22 a rank with 2 ranks ("drop")


def truncate(path: Path) -> None:
    """Cut a shard in the middle of a member (a partial upload)."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3 + 100])


def per_rank(
    urls: list[str], monkeypatch: pytest.MonkeyPatch, world: int = 2, **kw: Any
) -> list[list[str]]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    result = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        ds = wds.WebDataset(
            urls, shardshuffle=False, sample_counts=SIZES, handler=wds.ignore_and_continue, **kw
        )
        result.append([sample["__key__"] for sample in ds])
    return result


def stopped_and_restored(build: Any, k: int) -> list[str]:
    """The keys of a loader stopped after ``k`` samples, then of one restored from its state."""
    loader = build()
    it = iter(loader)
    head = [next(it)["__key__"] for _ in range(k)]
    state = loader.state_dict()
    del it
    restored = build()
    restored.load_state_dict(state)
    return head + [s["__key__"] for s in restored]


@pytest.mark.parametrize("fault", ["truncated", "missing", "fewer"])
def test_a_failed_shard_under_a_continuing_handler_keeps_ranks_equal(
    make_shards: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    shards = make_shards(SIZES)
    bad = shards.paths[1]  # 13 samples, all read by rank 0
    if fault == "truncated":
        truncate(bad)
    elif fault == "missing":
        bad.unlink()
    else:  # rewritten with 3 samples: the counts say 13
        make_shards([3], directory=bad.parent / "short")
        (bad.parent / "short" / "shard-000000.tar").replace(bad)
    urls = [str(p) for p in shards.paths]
    with caplog.at_level(logging.WARNING):
        ranks = per_rank(urls, monkeypatch)
    assert [len(keys) for keys in ranks] == [22, 22]
    # Rank 1 read its share as usual; rank 0 repeated samples instead of the lost ones.
    assert len(set(ranks[1])) == 22
    counts = Counter(ranks[0])
    lost = 22 - len(counts)
    assert lost > 0
    assert sum(n - 1 for n in counts.values()) == lost
    assert set(counts) <= set(shards.keys)
    assert "fewer samples than balancing gave it" in caplog.text
    assert "shard-000001.tar" in caplog.text


def test_a_share_that_starts_past_a_short_shards_end_is_padded_too(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's share begins inside shard 1 (13 by its count), which really holds 3: it reads
    none of its 7 samples there, has nothing read yet to repeat, and repeats its last sample
    at the end instead."""
    shards = make_shards([20, 3, 20])
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    got = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = wds.WebDataset(urls, shardshuffle=False, sample_counts=[20, 13, 20])
        got.append([sample["__key__"] for sample in ds])
    assert [len(keys) for keys in got] == [26, 26]
    # Rank 0 reads shard 1's 3 samples and repeats the third at once.
    assert "s0001_000002" in got[0]
    assert got[0][-1] == "s0001_000002"
    # Rank 1: shard 1's samples 6.. do not exist; shard 2's are read, then the last repeated.
    real = [key for key in got[1] if key != got[1][-1]]
    assert real == [f"s0002_{i:06d}" for i in range(len(real))]
    assert len(real) >= 19
    assert got[1][len(real) :] == [got[1][-1]] * (26 - len(real))
    assert 26 - len(real) >= 6


def test_a_reader_that_reads_nothing_at_all_raises_instead_of_hanging(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(SIZES)
    shards.paths[0].unlink()
    shards.paths[1].unlink()
    shards.paths[2].unlink()  # rank 0's whole share (7 + 13 + 2 of shard 2)
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ds = wds.WebDataset(
        urls, shardshuffle=False, sample_counts=SIZES, handler=wds.ignore_and_continue
    )
    with pytest.raises(ShardError, match=r"none of the 22 samples .* rather than hang") as info:
        list(ds)
    assert "shard-000000.tar" in str(info.value)


@pytest.mark.parametrize("k", [3, 9, 14, 20])
def test_a_restore_after_a_failed_shard_is_exact(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """The repeats count in the reader's position: a checkpoint taken among them restores
    to the rest of them, and the rank still yields its share."""
    shards = make_shards(SIZES)
    truncate(shards.paths[1])
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    def build() -> Any:
        ds = wds.WebDataset(
            urls, shardshuffle=True, seed=1, sample_counts=SIZES, handler=wds.ignore_and_continue
        )
        return StatefulDataLoader(ds.shuffle(4), batch_size=None, num_workers=0)

    everything = [s["__key__"] for s in build()]
    assert stopped_and_restored(build, k) == everything
    assert len(everything) == 22


@pytest.mark.parametrize("fault", ["truncated", "missing", "both"])
def test_a_restore_at_any_point_of_a_faulty_share_is_exact(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """At every stop point, shard boundaries and the sample right before a shortfall
    included: the restored reader reads the last sample again (quietly), so a shortfall
    after it repeats the same sample, and the repeats already given are not given again."""
    shards = make_shards(SIZES)
    if fault in ("truncated", "both"):
        truncate(shards.paths[1])
    if fault in ("missing", "both"):
        shards.paths[2].unlink()
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    def build() -> Any:
        ds = wds.WebDataset(
            urls, shardshuffle=False, sample_counts=SIZES, handler=wds.ignore_and_continue
        )
        return StatefulDataLoader(ds, batch_size=None, num_workers=0)

    everything = [s["__key__"] for s in build()]
    assert len(everything) == 22
    for k in range(22):
        assert stopped_and_restored(build, k) == everything, k


def test_a_repeat_is_the_sample_as_read_not_as_a_later_stage_changed_it(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """map_dict changes a sample in place: a repeat made from the changed one would go
    through it twice (json.loads of a dict: TypeError)."""
    import json

    shards = make_shards(SIZES)
    truncate(shards.paths[1])
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ds = wds.WebDataset(
        urls, shardshuffle=False, sample_counts=SIZES, handler=wds.ignore_and_continue
    ).map_dict(json=json.loads)
    samples = list(ds)
    assert len(samples) == 22
    assert all(isinstance(s["json"], dict) for s in samples)


def test_a_handler_that_stops_ends_the_pass_without_repeats(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([5] * 8)
    shards.paths[1].unlink()
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ds = wds.WebDataset(
        urls, shardshuffle=False, sample_counts=[5] * 8, handler=wds.ignore_and_stop
    )
    assert [s["__key__"] for s in ds] == [f"s0000_{i:06d}" for i in range(5)]


@pytest.mark.parametrize("fault", ["truncated", "missing"])
def test_an_elastic_restore_over_a_faulty_shard_gives_every_new_rank_the_same_count(
    make_shards: Any, fault: str
) -> None:
    """2 ranks' states restored on 3: the samples the epoch had left include some of a
    truncated (or missing) shard's that cannot be read; the new rank that owes them repeats
    instead."""
    sizes = [9, 14, 5, 20, 11, 7, 13, 16]
    shards = make_shards(sizes)
    if fault == "truncated":
        truncate(shards.paths[3])
    else:
        shards.paths[3].unlink()
    urls = [str(p) for p in shards.paths]

    def dataset(rank: int, world: int) -> Any:
        ds = wds.WebDataset(
            urls,
            shardshuffle=False,
            seed=7,
            rank=rank,
            world_size=world,
            sample_counts=sizes,
            handler=wds.ignore_and_continue,
        )
        ds.set_epoch(3)
        return ds.shuffle(10)

    states = []
    for rank in range(2):
        loader = StatefulDataLoader(dataset(rank, 2), batch_size=None, num_workers=0)
        it = iter(loader)
        for _ in range(30):
            next(it)
        states.append(loader.state_dict())
        del it
    counts = []
    for rank in range(3):
        loader = wds.StatefulLoader(dataset(rank, 3), batch_size=None, num_workers=0)
        loader.load_state_dict({"cloudshards_ranks": states, "world_size": 2})
        counts.append(len(list(loader)))
    assert counts[0] > 0
    assert counts == [counts[0]] * 3  # one was 4 short, and its rank would hang


def test_a_shard_holding_more_samples_than_its_count_is_named(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A shard rewritten with more samples since it was counted (a node's counts key a remote
    shard by its URL alone): balancing still reads its count of them, the same on every rank,
    but a warning names the shard and how to count again, where its samples were once left
    out silently."""
    shards = make_shards(SIZES)
    bigger = shards.paths[1]  # 13 by the counts, all read by rank 0
    make_shards([7, 20], directory=bigger.parent / "more")  # keys of a shard 1, 20 of them
    (bigger.parent / "more" / "shard-000001.tar").replace(bigger)
    urls = [str(p) for p in shards.paths]
    with caplog.at_level(logging.WARNING):
        ranks = per_rank(urls, monkeypatch)
    assert [len(keys) for keys in ranks] == [22, 22]
    assert all(len(set(keys)) == 22 for keys in ranks)
    warned = [r.getMessage() for r in caplog.records if "more samples than" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "shard-000001.tar holds more samples than the 13 its count says" in warned[0]
    assert "CLOUDSHARDS_COUNTS_DIR" in warned[0]


def test_a_shard_that_ends_where_its_count_says_is_not_named(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards(SIZES)
    with caplog.at_level(logging.WARNING):
        ranks = per_rank([str(p) for p in shards.paths], monkeypatch)
    assert [len(keys) for keys in ranks] == [22, 22]
    assert "more samples than" not in caplog.text
