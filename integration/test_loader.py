"""Multi-worker DataLoader over real servers: every sample exactly once per epoch, shards split
across workers by ``wds.split_by_worker`` by default, and the dataset survives pickling (spawn)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest
import torch.utils.data

import cloudshards as wds

if TYPE_CHECKING:
    from conftest import RemoteDataset

NUM_WORKERS = 2
# Python >= 3.12 warns when forking a process that has threads (fsspec's IO loop, our servers'
# upload clients); the DataLoader forks on purpose here. Not a cloudshards warning.
FORK_WARNING = pytest.mark.filterwarnings(
    r"ignore:This process \(pid=\d+\) is multi-threaded, use of fork\(\):DeprecationWarning"
)


def tag_worker(sample: dict[str, Any]) -> dict[str, Any]:
    """Record which DataLoader worker produced the sample (module-level: picklable)."""
    info = torch.utils.data.get_worker_info()
    return {**sample, "__worker__": -1 if info is None else info.id}


def make_loader(
    remote: RemoteDataset, context: str, *, persistent_workers: bool = False
) -> torch.utils.data.DataLoader[dict[str, Any]]:
    """A 2-worker DataLoader yielding single samples tagged with their worker id."""
    dataset = wds.WebDataset(
        remote.url, shardshuffle=False, storage_options=remote.storage_options
    ).map(tag_worker)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=NUM_WORKERS,
        multiprocessing_context=context,
        persistent_workers=persistent_workers,
    )


def check_epoch(samples: list[dict[str, Any]], remote: RemoteDataset) -> None:
    """Each sample exactly once, intact, and each worker read shards[worker::NUM_WORKERS]."""
    local = remote.local
    keys = Counter(sample["__key__"] for sample in samples)
    expected_keys = Counter(list(local.samples))
    duplicated = sorted(k for k, n in keys.items() if n > 1)
    missing = sorted(expected_keys - keys)
    assert keys == expected_keys, f"duplicated: {duplicated}, missing: {missing}"
    for sample in samples:
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        assert fields == local.samples[sample["__key__"]], sample["__key__"]

    shard_urls = remote.shard_urls()
    urls_by_worker: dict[int, set[str]] = {}
    for sample in samples:
        urls_by_worker.setdefault(sample["__worker__"], set()).add(sample["__url__"])
    expected = {w: set(shard_urls[w::NUM_WORKERS]) for w in range(NUM_WORKERS)}
    assert urls_by_worker == expected, "shards are not split by wds.split_by_worker"


def test_split_by_worker_is_exported() -> None:
    """``wds.split_by_worker`` exists under webdataset's name."""
    assert callable(wds.split_by_worker)


@FORK_WARNING
@pytest.mark.timeout(120)
def test_each_sample_once_per_epoch(remote_dataset: RemoteDataset) -> None:
    """Two epochs over a 2-worker (fork) DataLoader each see every sample exactly once."""
    loader = make_loader(remote_dataset, "fork")
    for _epoch in range(2):
        check_epoch(list(loader), remote_dataset)


@FORK_WARNING
@pytest.mark.timeout(120)
def test_persistent_workers_reiterate(http_dataset: RemoteDataset) -> None:
    """With persistent workers the same worker processes iterate the dataset again."""
    loader = make_loader(http_dataset, "fork", persistent_workers=True)
    for _epoch in range(2):
        check_epoch(list(loader), http_dataset)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_spawn_workers_unpickle_dataset(s3_dataset: RemoteDataset) -> None:
    """Spawned workers rebuild the dataset (storage_options included) from a pickle."""
    loader = make_loader(s3_dataset, "spawn")
    check_epoch(list(loader), s3_dataset)
