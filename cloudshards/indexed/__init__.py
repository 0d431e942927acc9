"""Indexed (map-style) mode: a tar index, ``IndexedDataset`` and ``DistributedChunkedSampler``.

An index (``cloudshards index URL...``) records every sample's byte range, so one sample is
one ranged GET, or a ``pread`` from the whole shard in the node cache.
"""

from __future__ import annotations

from cloudshards.indexed.build import build_index
from cloudshards.indexed.dataset import IndexedDataset
from cloudshards.indexed.files import default_index_url, load_index, write_index
from cloudshards.indexed.format import (
    DatasetIndex,
    IndexedMember,
    IndexedSample,
    ShardIndex,
    read_index,
    shard_sample_counts,
)
from cloudshards.indexed.sampler import DistributedChunkedSampler

__all__ = [
    "DatasetIndex",
    "DistributedChunkedSampler",
    "IndexedDataset",
    "IndexedMember",
    "IndexedSample",
    "ShardIndex",
    "build_index",
    "default_index_url",
    "load_index",
    "read_index",
    "shard_sample_counts",
    "write_index",
]
