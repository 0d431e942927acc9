"""cloudshards.StatefulLoader: torchdata's StatefulDataLoader whose state holds every rank's
(gathered in a multi-rank job; one rank here, see integration/test_lightning.py for two), and
that can describe the position before the batches a training loop fetched ahead."""

from __future__ import annotations

from typing import Any

import pytest
from test_state import keys

import cloudshards as wds
from cloudshards.errors import StateMismatchError


def _loader(spec: str, workers: int, prefetched: int = 0) -> Any:
    dataset = wds.WebDataset(spec, shardshuffle=True, seed=3).shuffle(20).batched(3)
    dataset.set_epoch(1)
    return wds.StatefulLoader(dataset, batch_size=None, num_workers=workers, prefetched=prefetched)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("prefetched", [0, 1, 2])
def test_a_loop_that_fetches_ahead_resumes_after_what_it_trained(
    make_shards: Any, workers: int, prefetched: int
) -> None:
    shards = make_shards([9, 14, 5, 20, 11])
    everything = keys(_loader(shards.spec(), workers))
    first = _loader(shards.spec(), workers, prefetched)
    it = iter(first)
    fetched = [next(it) for _ in range(6 + prefetched)]  # trained 6, fetched `prefetched` more
    state = first.state_dict()
    del it
    second = _loader(shards.spec(), workers, prefetched)
    second.load_state_dict(state)
    assert keys(fetched[:6]) + keys(second) == everything


def test_one_rank_saves_its_own_state_and_a_gathered_one_must_match_the_world(
    make_shards: Any,
) -> None:
    shards = make_shards([5, 5])
    loader = _loader(shards.spec(), 0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert "cloudshards_ranks" not in state  # one rank: torchdata's own state
    gathered = {"cloudshards_ranks": [state], "world_size": 1}
    again = _loader(shards.spec(), 0)
    again.load_state_dict(gathered)  # a gathered state from one rank restores that rank
    assert keys(again) == keys(_loader(shards.spec(), 0))[3:]
    with pytest.raises(StateMismatchError, match="3 ranks"):
        _loader(shards.spec(), 0).load_state_dict(
            {"cloudshards_ranks": [state] * 3, "world_size": 3}
        )


def test_a_webloader_restored_from_its_state_still_iterates(make_shards: Any) -> None:
    """Lightning saves and restores any train loader with state_dict/load_state_dict (a
    WebLoader has them, as a pipeline); a restore once left it failing on iter()
    ('NoneType' object has no attribute 'begin'). It starts its epoch again, as webdataset's
    WebLoader (which Lightning leaves alone) does."""
    shards = make_shards([4, 4])
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).to_tuple("__key__").batched(2)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    fresh = wds.WebLoader(ds, batch_size=None, num_workers=0)
    fresh.load_state_dict(state)
    assert [key for (batch,) in fresh for key in batch] == sorted(shards.keys)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_webloader_with_epoch_restores_to_the_start_of_its_epoch_and_says_so(
    make_shards: Any, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``with_epoch`` WebLoader's state kept its batch count while the dataset under it
    started its epoch again: the restored epoch trained its first batches twice and never
    trained those after the save. Its state is the start of the epoch (the epoch is trained
    whole again, in the same order), and saving it mid-epoch warns once."""

    def loader() -> Any:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5).shuffle(10).batched(4)
        return wds.WebLoader(ds, batch_size=None, num_workers=workers).with_epoch(5)

    shards = make_shards([9, 14, 5, 20])
    epoch = keys(loader())
    first = loader()
    it = iter(first)
    trained = [next(it) for _ in range(3)]
    assert keys(trained) == epoch[:12]
    with caplog.at_level("WARNING", logger="cloudshards"):
        state = first.state_dict()
        assert first.state_dict() == state
    told = [r.getMessage() for r in caplog.records if "WebLoader.state_dict" in r.getMessage()]
    assert len(told) == 1
    assert "StatefulLoader" in told[0]
    del it
    again = loader()
    again.load_state_dict(state)
    assert keys(again) == epoch  # the whole epoch once more: no batch lost, none doubled


def test_a_datasets_state_asked_while_dataloader_workers_read_it_warns(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain DataLoader with workers: the dataset in the main process is never iterated, so
    its state said "epoch not started" without a word, and a restore trained the epoch again."""
    import torch

    shards = make_shards([6, 6])
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5).batched(2)
    with caplog.at_level("WARNING", logger="cloudshards"):
        assert ds.state_dict()["seed"] is None  # nothing read: nothing to warn about
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        it = iter(loader)
        next(it)
        for _ in range(2):
            assert ds.state_dict()["seed"] is None
        del it
    told = [r.getMessage() for r in caplog.records if "DataLoader worker" in r.getMessage()]
    assert len(told) == 1
    assert "StatefulLoader" in told[0]


def _epochs_loader(spec: str, workers: int, prefetched: int = 0) -> Any:
    dataset = wds.WebDataset(spec, shardshuffle=True, seed=7).shuffle(10).batched(4)
    loader = wds.StatefulLoader(
        dataset, batch_size=None, num_workers=workers, prefetched=prefetched
    )
    return dataset, loader


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("set_epoch", [True, False])
@pytest.mark.parametrize("prefetched", [0, 1])
def test_a_state_saved_at_an_epochs_end_restores_the_next_epoch(
    make_shards: Any, workers: int, set_epoch: bool, prefetched: int
) -> None:
    """Lightning checkpoints after the loader ran out (its fetcher one batch ahead:
    ``prefetched=1``). The restored job runs the next epoch, in the order the uninterrupted
    job gave it (with 0 workers torchdata makes an iterator, drops it and makes another: the
    next epoch once ran as the one after; fetched ahead, the state once said "the end of the
    epoch, not finished", and the restored epoch was empty)."""
    spec = make_shards([9, 14, 5, 20, 11]).spec()
    dataset, loader = _epochs_loader(spec, workers, prefetched)
    dataset.set_epoch(0)
    keys(loader)
    state = loader.state_dict()
    dataset.set_epoch(1)
    expected = keys(loader)
    dataset, restored = _epochs_loader(spec, workers, prefetched)
    if set_epoch:
        dataset.set_epoch(1)
    restored.load_state_dict(state)
    assert keys(restored) == expected
    dataset.set_epoch(2)
    assert keys(restored) != expected  # the epoch after it has an order of its own


@pytest.mark.parametrize(("saved_with", "restored_with"), [(2, 1), (1, 2), (0, 2), (2, 0)])
def test_a_state_saved_at_an_epochs_end_restores_the_next_epoch_on_another_layout(
    make_shards: Any, saved_with: int, restored_with: int
) -> None:
    """An elastic restore of an ended epoch has nothing of it left to share: the whole next
    epoch runs on the new layout (it once re-read some of the ended epoch instead)."""
    shards = make_shards([9, 14, 5, 20, 11])
    _, loader = _epochs_loader(shards.spec(), saved_with)
    keys(loader)
    state = loader.state_dict()
    fresh, reference = _epochs_loader(shards.spec(), restored_with)
    fresh.set_epoch(1)
    expected = keys(reference)
    _, restored = _epochs_loader(shards.spec(), restored_with)
    restored.load_state_dict(state)
    got = keys(restored)
    assert sorted(got) == sorted(shards.keys)
    assert got == expected


@pytest.mark.parametrize(("saved_with", "restored_with"), [(2, 1), (1, 2), (0, 2), (2, 0)])
def test_a_state_saved_after_an_epochs_last_batch_restores_nothing_of_it_on_another_layout(
    make_shards: Any, saved_with: int, restored_with: int
) -> None:
    """Saved right after the epoch's last batch (a checkpoint every k steps landing there),
    before the loop asked for one more: on another layout the rest of that epoch is empty,
    and the next epoch follows in its own order (the whole next epoch once ran in its place,
    and then again: every sample of it twice)."""
    shards = make_shards([9, 14, 5, 20, 11])  # 59 samples: the last batch of 4 is partial
    dataset, loader = _epochs_loader(shards.spec(), saved_with)
    dataset.set_epoch(0)
    batches = len(list(loader))
    dataset.set_epoch(0)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = loader.state_dict()
    del it
    fresh, reference = _epochs_loader(shards.spec(), restored_with)
    fresh.set_epoch(1)
    expected = keys(reference)
    dataset, restored = _epochs_loader(shards.spec(), restored_with)
    dataset.set_epoch(0)  # a loop that saved its epoch with the state sets it again
    restored.load_state_dict(state)
    assert keys(restored) == []
    dataset.set_epoch(1)
    assert keys(restored) == expected


def test_fresh_workers_reshuffle_each_epoch_without_set_epoch(make_shards: Any) -> None:
    """Non-persistent workers copy the dataset each epoch; without set_epoch every epoch once
    repeated epoch 0's order (Lightning calls no set_epoch on a dataset). The loader counts
    the epochs itself, as a loader without workers does: the orders set_epoch would give."""
    spec = make_shards([9, 14, 5, 20, 11]).spec()
    dataset, counted = _epochs_loader(spec, 2)
    orders = [keys(counted) for _ in range(3)]
    reference, loader = _epochs_loader(spec, 2)
    expected = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        expected.append(keys(loader))
    assert orders == expected
    assert len({tuple(order) for order in orders}) == 3
    dataset.set_epoch(7)  # an epoch the user sets wins, and the count goes on from it
    reference.set_epoch(7)
    assert keys(counted) == keys(loader)
    reference.set_epoch(8)
    assert keys(counted) == keys(loader)


def test_a_restore_without_set_epoch_goes_on_with_the_next_epoch(make_shards: Any) -> None:
    spec = make_shards([9, 14, 5, 20, 11]).spec()
    reference, loader = _epochs_loader(spec, 2)
    reference.set_epoch(1)
    it = iter(loader)
    trained = [next(it) for _ in range(4)]
    state = loader.state_dict()
    del it
    reference.set_epoch(1)
    epoch1 = keys(loader)
    reference.set_epoch(2)
    epoch2 = keys(loader)
    _, restored = _epochs_loader(spec, 2)
    restored.load_state_dict(state)
    assert keys(trained) + keys(restored) == epoch1
    assert keys(restored) == epoch2


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_made_and_dropped_spends_no_epoch(make_shards: Any, workers: int) -> None:
    """Lightning calls iter() once on a loader that is not a torch DataLoader (a WebLoader)
    to check it, and drops it: the epochs after run as if it had not (one once repeated)."""
    spec = make_shards([9, 14, 5, 20, 11]).spec()

    def webloader() -> Any:
        dataset = wds.WebDataset(spec, shardshuffle=True, seed=7).shuffle(10).batched(4)
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)

    reference = webloader()
    expected = [keys(reference) for _ in range(3)]
    checked = webloader()
    iter(checked)
    assert [keys(checked) for _ in range(3)] == expected
    assert len({tuple(order) for order in expected}) == 3


def test_an_epoch_set_after_a_dropped_iterator_is_the_one_run(make_shards: Any) -> None:
    spec = make_shards([9, 14, 5, 20, 11]).spec()
    reference = wds.WebDataset(spec, shardshuffle=True, seed=7).shuffle(10)
    reference.set_epoch(1)
    dataset = wds.WebDataset(spec, shardshuffle=True, seed=7).shuffle(10)
    dataset.set_epoch(0)
    iter(dataset)
    dataset.set_epoch(1)
    assert keys(dataset) == keys(reference)
