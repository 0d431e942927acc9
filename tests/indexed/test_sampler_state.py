"""DistributedChunkedSampler's state: a map-style epoch restored from a checkpoint continues
with exactly the indices the interrupted run had left, and a checkpoint of another order (seed,
chunks, ranks, dataset) is refused instead of read as if it were this one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import Shards
from torchdata.stateful_dataloader import StatefulDataLoader

from cloudshards.errors import StateMismatchError
from cloudshards.indexed import DistributedChunkedSampler, IndexedDataset, build_index


def keys(batch: list[dict[str, Any]]) -> list[str]:
    return [sample["__key__"] for sample in batch]


def loader(dataset: Any, sampler: Any, workers: int) -> StatefulDataLoader:
    return StatefulDataLoader(
        dataset, sampler=sampler, batch_size=3, num_workers=workers, collate_fn=keys
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restored_epoch_continues_exactly_and_the_next_reshuffles_alike(
    make_shards: Callable[..., Shards], workers: int
) -> None:
    with IndexedDataset(build_index(make_shards([7, 9, 6, 8]).spec())) as dataset:
        resume_exactly(dataset, workers)


def resume_exactly(dataset: Any, workers: int) -> None:
    def sampler() -> DistributedChunkedSampler:
        return DistributedChunkedSampler(dataset, num_replicas=2, rank=1, seed=5, chunk_size=4)

    reference = sampler()
    first = loader(dataset, reference, workers)
    epochs = []
    for epoch in (3, 4):
        reference.set_epoch(epoch)
        epochs.append([batch for batch in first])
    interrupted = sampler()
    interrupted.set_epoch(3)
    stopped = loader(dataset, interrupted, workers)
    it = iter(stopped)
    got = [next(it), next(it)]
    state = stopped.state_dict()
    del it
    restored_sampler = sampler()  # a new process: its epoch is set from the state
    restored = loader(dataset, restored_sampler, workers)
    restored.load_state_dict(state)
    got += [batch for batch in restored]
    assert got == epochs[0]
    restored_sampler.set_epoch(4)
    assert [batch for batch in restored] == epochs[1]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"seed": 6}, "seed"),
        ({"chunk_size": 5}, "chunks"),
        ({"rank": 0}, "rank"),
        ({"num_replicas": 3}, "num_replicas"),
        ({"shuffle": False}, "shuffle"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else "",
)
def test_a_checkpoint_of_another_order_is_refused(
    make_shards: Callable[..., Shards], change: dict[str, Any], named: str
) -> None:
    kw: dict[str, Any] = {"num_replicas": 2, "rank": 1, "seed": 5, "chunk_size": 4}
    with IndexedDataset(build_index(make_shards([7, 9, 6, 8]).spec())) as dataset:
        saved = loader(dataset, DistributedChunkedSampler(dataset, **kw), 0)
        next(iter(saved))
        state = saved.state_dict()
        other = loader(dataset, DistributedChunkedSampler(dataset, **{**kw, **change}), 0)
        other.load_state_dict(state)
        with pytest.raises(StateMismatchError, match=f"differs in .*{named}"):
            next(iter(other))


def test_a_checkpoint_of_another_dataset_is_refused(make_shards: Callable[..., Shards]) -> None:
    with IndexedDataset(build_index(make_shards([7, 9]).spec())) as saved_on:
        saved = loader(saved_on, DistributedChunkedSampler(saved_on, num_replicas=1, rank=0), 0)
        next(iter(saved))
        state = saved.state_dict()
    with IndexedDataset(build_index(make_shards([9, 7]).spec())) as other:
        restored = loader(other, DistributedChunkedSampler(other, num_replicas=1, rank=0), 0)
        restored.load_state_dict(state)
        with pytest.raises(StateMismatchError, match="chunks"):
            next(iter(restored))


def test_moving_to_another_epoch_before_a_restored_one_ended_is_refused(
    make_shards: Callable[..., Shards],
) -> None:
    """After an epoch that had ended, set_epoch moves on to a fresh one; before it ended, the
    indices left would be another epoch's."""
    with IndexedDataset(build_index(make_shards([7, 9]).spec())) as dataset:
        sampler = DistributedChunkedSampler(dataset, num_replicas=1, rank=0)
    state = {**sampler.state_dict(), "yielded": 4}
    sampler.load_state_dict(state)
    sampler.set_epoch(1)
    with pytest.raises(StateMismatchError, match="epoch 0"):
        list(sampler)
    sampler.load_state_dict({**state, "yielded": len(sampler)})  # the epoch had ended
    sampler.set_epoch(1)
    assert sorted(sampler) == list(range(16))
