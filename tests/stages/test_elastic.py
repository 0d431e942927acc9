"""Elastic resume: an epoch checkpointed on N ranks x W DataLoader workers continues on M x V.

The old ranks run here one after another in this process (``rank=``/``world_size=`` given to
the dataset, as torchrun would detect them); each stops after the same number of batches, as
ranks in lockstep do, and saves its ``StatefulDataLoader`` state. The new ranks restore every
old rank's state (gathered, as :class:`cloudshards.StatefulLoader` saves it) and run the rest
of the epoch. Checked: together the two runs deliver exactly the uninterrupted epoch's samples,
each once; every new rank gets the same number of batches; the next epoch is the new world's
normal one. integration/test_distributed.py does the same with torchrun.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from test_state import keys
from torchdata.stateful_dataloader import StatefulDataLoader

import cloudshards as wds
from cloudshards.errors import StateMismatchError

SIZES = [9, 14, 5, 20, 11, 7, 13, 16]  # 95 samples, uneven shards


def dataset(
    spec: str, rank: int, world: int, buffer: int, batch: int, partial: bool = True, **kw: Any
) -> Any:
    data = wds.WebDataset(spec, shardshuffle=True, seed=7, rank=rank, world_size=world, **kw)
    data = data.shuffle(buffer) if buffer else data
    data = data.batched(batch, partial=partial)
    data.set_epoch(3)
    return data


def run_old_world(
    spec: str, world: int, workers: int, batches: int, buffer: int, batch: int, **kw: Any
) -> tuple[list[str], list[str], dict[str, Any]]:
    """(the uninterrupted epoch's keys, the keys delivered before the checkpoint, the gathered
    checkpoint) of ``world`` ranks x ``workers`` stopped after ``batches`` batches each."""
    everything: list[str] = []
    before: list[str] = []
    states = []
    for rank in range(world):
        data = dataset(spec, rank, world, buffer, batch, **kw)
        everything += keys(StatefulDataLoader(data, batch_size=None, num_workers=workers))
        loader = StatefulDataLoader(data, batch_size=None, num_workers=workers)
        it = iter(loader)
        before += keys(next(it) for _ in range(batches))
        states.append(loader.state_dict())
        del it
    return everything, before, {"cloudshards_ranks": states, "world_size": world}


def run_new_world(
    spec: str, checkpoint: Any, world: int, workers: int, buffer: int, batch: int, **kw: Any
) -> list[list[Any]]:
    """Each new rank's batches after restoring ``checkpoint``."""
    result = []
    for rank in range(world):
        data = dataset(spec, rank, world, buffer, batch, **kw)
        loader = wds.StatefulLoader(data, batch_size=None, num_workers=workers)
        loader.load_state_dict(checkpoint)
        result.append(list(loader))
    return result


@pytest.mark.parametrize(
    ("old", "new", "buffer"),
    [
        ((2, 2), (1, 2), 30),
        ((2, 2), (3, 1), 30),
        ((2, 2), (4, 2), 0),
        ((1, 2), (2, 2), 20),
        ((3, 1), (2, 2), 40),
    ],
    ids=["2x2-1x2", "2x2-3x1", "2x2-4x2", "1x2-2x2", "3x1-2x2"],
)
def test_every_remaining_sample_once_with_equal_batches_per_rank(
    make_shards: Any, old: tuple[int, int], new: tuple[int, int], buffer: int
) -> None:
    shards = make_shards(SIZES)
    everything, before, checkpoint = run_old_world(shards.spec(), *old, 3, buffer, 4)
    assert not [k for k, n in Counter(everything).items() if n > 1]
    after = run_new_world(shards.spec(), checkpoint, *new, buffer, 4)
    delivered = before + [k for batches in after for k in keys(batches)]
    assert not [k for k, n in Counter(delivered).items() if n > 1], "a sample twice"
    assert sorted(delivered) == sorted(everything)
    assert len({len(batches) for batches in after}) == 1, [len(b) for b in after]


def test_a_checkpoint_during_the_resumed_epoch_restores_on_the_same_world_and_another(
    make_shards: Any,
) -> None:
    spec = make_shards(SIZES).spec()
    everything, before, checkpoint = run_old_world(spec, 2, 2, 2, 25, 3)
    # The new world (3 x 1) stops after 4 batches per rank and saves its states.
    middle: list[str] = []
    states = []
    full = []
    for rank in range(3):
        data = dataset(spec, rank, 3, 25, 3)
        loader = wds.StatefulLoader(data, batch_size=None, num_workers=0)
        loader.load_state_dict(checkpoint)
        full.append(keys(loader))
        loader = wds.StatefulLoader(data, batch_size=None, num_workers=0)
        loader.load_state_dict(checkpoint)
        it = iter(loader)
        middle += keys(next(it) for _ in range(4))
        states.append(loader.state_dict())
        assert "plan" in states[-1]["dataset_state"]  # its share travels with its state
    again = {"cloudshards_ranks": states, "world_size": 3}
    # Same world: each rank continues its own sequence exactly.
    for rank in range(3):
        data = dataset(spec, rank, 3, 25, 3)
        loader = wds.StatefulLoader(data, batch_size=None, num_workers=0)
        loader.load_state_dict(states[rank])
        assert keys(loader) == full[rank][12:]
    # Another world again (2 x 2): the rest, once.
    after = run_new_world(spec, again, 2, 2, 25, 3)
    delivered = before + middle + [k for batches in after for k in keys(batches)]
    assert sorted(delivered) == sorted(everything)


def test_the_next_epoch_is_the_new_worlds_own(make_shards: Any) -> None:
    spec = make_shards(SIZES).spec()
    _, _, checkpoint = run_old_world(spec, 2, 2, 3, 10, 4)
    data = dataset(spec, 0, 1, 10, 4)
    loader = wds.StatefulLoader(data, batch_size=None, num_workers=2)
    loader.load_state_dict(checkpoint)
    list(loader)
    data.set_epoch(4)
    fresh = dataset(spec, 0, 1, 10, 4)
    fresh.set_epoch(4)
    want = keys(StatefulDataLoader(fresh, batch_size=None, num_workers=2))
    assert keys(loader) == want


def test_a_remainder_that_cannot_divide_is_dropped_or_padded_as_balance_says(
    make_shards: Any,
) -> None:
    # Batches of one sample: an extra sample is always an extra batch, so 3 ranks get
    # floor(R / 3) each ("drop") or ceil ("pad"), never unequal counts.
    spec = make_shards(SIZES).spec()
    for balance in ("drop", "pad"):
        everything, before, checkpoint = run_old_world(spec, 2, 1, 4, 0, 1, balance=balance)
        remaining = len(everything) - len(before)
        assert remaining % 3, "the test needs a remainder"
        after = run_new_world(spec, checkpoint, 3, 1, 0, 1, balance=balance)
        counts = {len(batches) for batches in after}
        assert len(counts) == 1
        delivered = before + [k for batches in after for k in keys(batches)]
        if balance == "drop":
            assert counts == {remaining // 3}
            assert not [k for k, n in Counter(delivered).items() if n > 1]
        else:
            assert counts == {-(-remaining // 3)}
            assert set(delivered) == set(everything)


def test_with_epoch_epochs_divide_their_remaining_items(make_shards: Any) -> None:
    # 2 ranks x 2 workers of with_epoch(24) items (batches of 4 in the loader) stop after 5
    # batches per rank: 96 - 40 = 56 items left, 3 new ranks x 1 worker: 19, 19, 18 would
    # need partial batches (19 = 4 x 4 + 3): every rank gets 5 batches, 56 items in all.
    spec = make_shards(SIZES).spec()

    def build(rank: int, world: int) -> Any:
        data = wds.WebDataset(spec, resampled=True, seed=1, rank=rank, world_size=world)
        data = data.with_epoch(24)
        data.set_epoch(2)
        return data

    states = []
    for rank in range(2):
        loader = wds.StatefulLoader(build(rank, 2), batch_size=4, num_workers=2)
        it = iter(loader)
        [next(it) for _ in range(5)]
        states.append(loader.state_dict())
        del it
    counts = []
    loaders = []
    for rank in range(3):
        data = build(rank, 3)
        loader = wds.StatefulLoader(data, batch_size=4, num_workers=1)
        loader.load_state_dict({"cloudshards_ranks": states, "world_size": 2})
        batches = list(loader)
        counts.append((len(batches), sum(len(b["__key__"]) for b in batches)))
        loaders.append((data, loader))
    assert [n for n, _ in counts] == [5, 5, 5]
    assert sum(items for _, items in counts) == 96 - 40
    data, loader = loaders[0]
    data.set_epoch(3)
    assert len(list(loader)) == 24 // 4  # the next epoch: the new world's own with_epoch(24)


def test_restores_that_cannot_be_divided_are_refused(make_shards: Any) -> None:
    spec = make_shards(SIZES).spec()
    data = wds.WebDataset(spec, seed=1, rank=0, world_size=2).repeat(2)
    loader = StatefulDataLoader(data, batch_size=None, num_workers=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    new = wds.StatefulLoader(wds.WebDataset(spec, seed=1, rank=0, world_size=3).repeat(2))
    new.load_state_dict({"cloudshards_ranks": [state], "world_size": 2})
    with pytest.raises(StateMismatchError, match="repeat"):
        list(new)
    other = wds.WebDataset(spec, seed=2, rank=0, world_size=3)
    with pytest.raises(StateMismatchError, match="different dataset or configuration"):
        wds.StatefulLoader(other, batch_size=None).load_state_dict(
            {"cloudshards_ranks": [state], "world_size": 2}
        )


def test_a_checkpoint_before_every_new_worker_delivered_keeps_their_shares(
    make_shards: Any,
) -> None:
    # Right after the elastic restore only worker 0 has delivered: worker 1's state is its
    # pending restore, which must restore its share again (same world) or be divided (another).
    spec = make_shards(SIZES).spec()
    everything, before, checkpoint = run_old_world(spec, 2, 2, 3, 20, 4)
    data = dataset(spec, 0, 1, 20, 4)
    loader = wds.StatefulLoader(data, batch_size=None, num_workers=2)
    loader.load_state_dict(checkpoint)
    it = iter(loader)
    middle = keys([next(it)])
    state = loader.state_dict()
    del it
    again = wds.StatefulLoader(dataset(spec, 0, 1, 20, 4), batch_size=None, num_workers=2)
    again.load_state_dict(state)
    assert sorted(before + middle + keys(again)) == sorted(everything)
    after = run_new_world(spec, state, 3, 1, 20, 4)
    delivered = before + middle + [k for batches in after for k in keys(batches)]
    assert sorted(delivered) == sorted(everything)
    assert len({len(batches) for batches in after}) == 1


def test_a_mix_by_counts_divides_what_each_dataset_had_left(
    make_shards: Any, tmp_path: Any
) -> None:
    # Three datasets (60, 40 and 48 samples), 40/24/16 of them per epoch over 2 ranks x 2
    # workers (10/6/4 each), stopped after 2 batches of 4 per rank; restored on 3 ranks x 1.
    sizes = {"a": [15, 15, 15, 15], "b": [10, 10, 10, 10], "c": [12, 12, 12, 12]}
    specs = {n: make_shards(s, directory=tmp_path / n).spec() for n, s in sizes.items()}

    def mix(rank: int, world: int) -> Any:
        sources = [
            wds.WebDataset(
                specs[n], shardshuffle=True, seed=i, rank=rank, world_size=world
            ).shuffle(5)
            for i, n in enumerate("abc")
        ]
        mixed = wds.WeightedMix(sources, counts=[40, 24, 16])
        data = wds.DataPipeline(mixed, wds.batched(4), seed=1, rank=rank, world_size=world)
        data.set_epoch(1)
        return data

    before: list[str] = []
    states = []
    for rank in range(2):
        loader = wds.StatefulLoader(mix(rank, 2), batch_size=None, num_workers=2)
        it = iter(loader)
        before += [name for _ in range(2) for name in _names(next(it))]
        states.append(loader.state_dict())
        del it
    after = []
    batches = []
    for rank in range(3):
        loader = wds.StatefulLoader(mix(rank, 3), batch_size=None, num_workers=1)
        loader.load_state_dict({"cloudshards_ranks": states, "world_size": 2})
        got = list(loader)
        batches.append(len(got))
        after.append([name for batch in got for name in _names(batch)])
    # 64 left for 3 ranks: 22, 21, 21 samples, the extra one in a partial batch: 6 batches each.
    assert batches == [6, 6, 6]
    assert sorted(len(paths) for paths in after) == [21, 21, 22]
    every = before + [p for paths in after for p in paths]
    for name, count in zip("abc", (40, 24, 16), strict=True):
        got = [p for p in every if p.startswith(name + ":")]
        assert len(got) == count, name  # the epoch's count of each dataset, exactly
        assert len(set(got)) == len(got), name  # none read twice (no dataset upsampled)
    for paths in after:  # each rank's part keeps the mixture
        shares = [sum(p.startswith(n + ":") for p in paths) for n in "abc"]
        for share, weight in zip(shares, (0.5, 0.3, 0.2), strict=True):
            assert abs(share - weight * len(paths)) <= 2, shares


def _names(batch: Any) -> list[str]:
    """``dataset:key`` of each sample of a batch (the dataset: its shards' directory)."""
    paths, keys = batch["__local_path__"], batch["__key__"]
    return [f"{p.split('/')[-2]}:{k}" for p, k in zip(paths, keys, strict=True)]


def test_a_mix_by_weights_needs_an_epoch_length_to_divide(make_shards: Any) -> None:
    spec = make_shards([6, 6]).spec()

    def mix(rank: int, world: int, kind: Any) -> Any:
        sources = [wds.WebDataset(spec, seed=n, rank=rank, world_size=world) for n in (1, 2)]
        return wds.DataPipeline(kind(sources), seed=1, rank=rank, world_size=world)

    for kind, error in (
        (lambda s: wds.WeightedMix(s, [1, 1]), "with_epoch"),
        (lambda s: wds.RandomMix(s, [1, 1]), "starts with RandomMix"),
    ):
        states = []
        for rank in (0, 1):  # every rank's state: an elastic restore needs them all
            loader = StatefulDataLoader(mix(rank, 2, kind), batch_size=None)
            next(iter(loader))
            states.append(loader.state_dict())
        restored = wds.StatefulLoader(mix(0, 1, kind), batch_size=None)
        restored.load_state_dict({"cloudshards_ranks": states, "world_size": 2})
        with pytest.raises(StateMismatchError, match=error):
            list(restored)


@pytest.mark.parametrize("given", ["gathered", "alone"])
def test_an_elastic_restore_without_some_ranks_state_is_refused(
    make_shards: Any, given: str
) -> None:
    """A 2-rank job's states, rank 1's lost (with its node): restored on 1 rank from rank 0's
    alone, rank 1's samples delivered before the save came again, without a word."""
    spec = make_shards(SIZES).spec()
    loader = StatefulDataLoader(
        wds.WebDataset(spec, shardshuffle=True, seed=3, rank=0, world_size=2), batch_size=None
    )
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    restored = wds.StatefulLoader(
        wds.WebDataset(spec, shardshuffle=True, seed=3, rank=0, world_size=1), batch_size=None
    )
    restored.load_state_dict({"cloudshards_ranks": [state]} if given == "gathered" else state)
    with pytest.raises(StateMismatchError, match=r"no state of rank\(s\) \[1\] of the 2"):
        list(restored)


def test_a_second_restore_divides_a_pending_share_by_the_loops_batch(make_shards: Any) -> None:
    # 2 x 2 -> 3 x 2, saved when only each rank's worker 0 had delivered (worker 1's state is
    # its restore, not begun) -> 2 x 1. Worker 1's share must be recomputed as the 3-rank run
    # divided it, by batches of .batched(4), not of the loader's batch_size=None.
    spec = make_shards(SIZES).spec()
    everything, before, checkpoint = run_old_world(spec, 2, 2, 2, 20, 4)
    middle: list[str] = []
    states = []
    for rank in range(3):
        loader = wds.StatefulLoader(dataset(spec, rank, 3, 20, 4), batch_size=None, num_workers=2)
        loader.load_state_dict(checkpoint)
        it = iter(loader)
        middle += keys([next(it)])
        states.append(loader.state_dict())
        del it
    after = run_new_world(spec, {"cloudshards_ranks": states, "world_size": 3}, 2, 1, 20, 4)
    delivered = before + middle + [k for batches in after for k in keys(batches)]
    assert not [k for k, n in Counter(delivered).items() if n > 1], "a sample twice"
    assert sorted(delivered) == sorted(everything)


def test_short_batches_dropped_still_give_every_rank_the_same_batches(make_shards: Any) -> None:
    # .batched(4, partial=False): a spare sample given to a worker's short batch could
    # complete it, one batch more on that rank than on the others (a DDP hang). Three
    # batches per rank before the checkpoint leave 71 samples, a remainder that once did.
    spec = make_shards(SIZES).spec()
    _, _, checkpoint = run_old_world(spec, 2, 2, 3, 0, 4, partial=False)
    after = run_new_world(spec, checkpoint, 3, 2, 0, 4, partial=False)
    assert all(len(keys([batch])) == 4 for batches in after for batch in batches)
    assert len({len(batches) for batches in after}) == 1, [len(b) for b in after]


@pytest.mark.parametrize("partial", [True, False])
def test_every_remainder_gives_every_rank_the_same_batches(partial: bool) -> None:
    """However many samples an epoch has left, the division gives every new rank the same
    number of batches: counting short batches (partial=True), or only full ones (False)."""
    from cloudshards.stages.division import batch_size, consumer_counts

    steps = [wds.batched(4, partial=partial)]
    batch = batch_size(steps, 1)
    for total in range(40, 300):
        for ranks, workers in ((3, 2), (2, 3), (4, 2)):
            counts, _ = consumer_counts(total, ranks, workers, batch, "drop")
            per_rank = [counts[r * workers : (r + 1) * workers] for r in range(ranks)]
            if partial:
                batches = {sum(-(-c // 4) for c in rank) for rank in per_rank}
            else:
                batches = {sum(c // 4 for c in rank) for rank in per_rank}
            assert len(batches) == 1, (total, ranks, workers, per_rank)
