"""Shard order per epoch, splitting by rank and worker, resampling."""

from __future__ import annotations

from collections import Counter

import pytest

from cloudshards.dist import WorkerInfo
from cloudshards.shards import (
    ResampledShards,
    ShardList,
    SimpleShardList,
    epoch_shard_order,
    non_empty,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from cloudshards.stages.base import IterationContext, iteration_context

URLS = [f"s3://b/shard-{i:03d}.tar" for i in range(40)]


def test_epoch_order_is_a_permutation_stable_per_seed_and_new_per_epoch() -> None:
    e0 = epoch_shard_order(40, seed=7, epoch=0)
    assert sorted(e0) == list(range(40))
    assert e0 == epoch_shard_order(40, seed=7, epoch=0)
    assert e0 != epoch_shard_order(40, seed=7, epoch=1)
    assert e0 != epoch_shard_order(40, seed=8, epoch=0)


def _urls(source: object, context: IterationContext) -> list[str]:
    with iteration_context(context):
        return [shard["url"] for shard in source]  # type: ignore[attr-defined]


def test_shard_list_shuffles_by_context_epoch() -> None:
    shard_list = ShardList(URLS, shuffle=True)
    epoch0 = _urls(shard_list, IterationContext(seed=1, epoch=0, info=WorkerInfo()))
    epoch1 = _urls(shard_list, IterationContext(seed=1, epoch=1, info=WorkerInfo()))
    assert sorted(epoch0) == sorted(URLS)
    assert epoch0 != epoch1
    assert epoch0 == _urls(shard_list, IterationContext(seed=1, epoch=0, info=WorkerInfo()))
    assert _urls(ShardList(URLS), IterationContext(seed=1, epoch=5, info=WorkerInfo())) == URLS


def test_shard_list_marks_shard_indices() -> None:
    shards = list(ShardList(URLS[:3]))
    assert [s["shard_index"] for s in shards] == [0, 1, 2]


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_split_by_node_partitions_the_epoch_order(world_size: int) -> None:
    seen: Counter[str] = Counter()
    for rank in range(world_size):
        info = WorkerInfo(rank=rank, world_size=world_size)
        context = IterationContext(seed=3, epoch=2, info=info)
        with iteration_context(context):
            seen.update(s["url"] for s in split_by_node(iter(ShardList(URLS, shuffle=True))))
    assert seen == Counter(URLS)


def test_split_by_worker_uses_context_worker() -> None:
    got: list[str] = []
    for worker in range(3):
        context = IterationContext(seed=0, epoch=0, info=WorkerInfo(worker=worker, num_workers=3))
        with iteration_context(context):
            part = [s["url"] for s in split_by_worker(iter(ShardList(URLS)))]
        assert part == URLS[worker::3]
        got.extend(part)
    assert sorted(got) == sorted(URLS)


def test_split_by_node_reads_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert [s["url"] for s in split_by_node(iter(ShardList(URLS)))] == URLS[1::4]


def test_worker_info_reads_slurm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    info = WorkerInfo.detect()
    assert (info.rank, info.world_size, info.local_rank) == (5, 8, 1)


def test_single_node_only_refuses_multi_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list(single_node_only(iter([1, 2]))) == [1, 2]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="nodesplitter"):
        list(single_node_only(iter([1, 2])))


def test_resampled_shards_are_deterministic_and_differ_per_epoch_and_worker() -> None:
    def draw(epoch: int, worker: int) -> list[str]:
        shards = ResampledShards(URLS, nshards=50, seed=11, worker_seed=lambda: worker)
        context = IterationContext(seed=0, epoch=epoch, info=WorkerInfo())
        return _urls(shards, context)

    assert draw(0, 0) == draw(0, 0)
    assert draw(0, 0) != draw(1, 0)
    assert draw(0, 0) != draw(0, 1)
    assert set(draw(0, 0)) <= set(URLS)
    assert len(draw(0, 0)) == 50


def test_resampled_shards_have_no_length_as_in_webdataset() -> None:
    # The draws never end: len() of the number of URLs would let a sampler or a progress
    # bar believe an epoch is that many shards.
    with pytest.raises(TypeError):
        len(ResampledShards(URLS))


def test_simple_shard_list_matches_webdataset_semantics() -> None:
    assert [s["url"] for s in SimpleShardList("a-{0..2}.tar")] == ["a-0.tar", "a-1.tar", "a-2.tar"]
    seeded = SimpleShardList(URLS, seed=4)
    first = [s["url"] for s in seeded]
    assert first == [s["url"] for s in seeded]
    assert first != URLS


def test_non_empty() -> None:
    assert list(non_empty(iter([1]))) == [1]
    with pytest.raises(ValueError, match="no data"):
        list(non_empty(iter([])))
