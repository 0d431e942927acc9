"""cloudshards: train PyTorch models directly from WebDataset tar shards in object storage.

``import cloudshards as wds`` runs code written for ``import webdataset as wds``.
"""

from __future__ import annotations

from cloudshards.cache import CacheStats, ShardCache, cache_info, clear_cache
from cloudshards.compat import WebDataset, WebLoader, check_empty
from cloudshards.decoders import (
    Continue,
    Decoder,
    DecodingError,
    allow_unsafe_decoders,
    gzfilter,
    handle_extension,
    imagehandler,
    register_decoder,
    torch_audio,
    torch_loads,
    torch_video,
)
from cloudshards.dist import (
    WorkerInfo,
    check_same_length,
    pytorch_worker_info,
    pytorch_worker_seed,
)
from cloudshards.errors import (
    CacheError,
    CloudShardsError,
    ConfigError,
    DecodeError,
    ShardError,
    ShardFormatError,
    ShardOpenError,
    StateMismatchError,
    UnsupportedError,
)
from cloudshards.handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from cloudshards.indexed import (
    DistributedChunkedSampler,
    IndexedDataset,
    build_index,
    load_index,
    write_index,
)
from cloudshards.io import gopen, open_shard
from cloudshards.mix import RandomMix, RoundRobin
from cloudshards.pipeline import DataPipeline, FluidInterface, FluidWrapper
from cloudshards.shards import (
    ResampledShards,
    SimpleShardList,
    non_empty,
    resampled,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from cloudshards.stages.base import PipelineStage, pipelinefilter
from cloudshards.stages.batch import batched, default_collation_fn, unbatched, unlisted
from cloudshards.stages.epoch import repeatedly, slice
from cloudshards.stages.fields import (
    extract_keys,
    getfirst,
    rename,
    rename_keys,
    to_tuple,
    transform_with,
    xdecode,
)
from cloudshards.stages.read import tarfile_samples, tarfile_to_samples
from cloudshards.stages.shuffle import detshuffle, shuffle
from cloudshards.stages.transform import (
    associate,
    decode,
    info,
    map,
    map_dict,
    map_tuple,
    rsample,
    select,
)
from cloudshards.urls import expand_urls
from cloudshards.webdataset._install import install_as_webdataset, install_from_env
from cloudshards.webdataset.shardlists import MultiShardSample
from cloudshards.wrappers import with_epoch, with_length
from cloudshards.writers import ShardWriter, TarWriter

__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "CacheStats",
    "CloudShardsError",
    "ConfigError",
    "Continue",
    "DataPipeline",
    "DecodeError",
    "Decoder",
    "DecodingError",
    "DistributedChunkedSampler",
    "FluidInterface",
    "FluidWrapper",
    "IndexedDataset",
    "MultiShardSample",
    "PipelineStage",
    "RandomMix",
    "ResampledShards",
    "RoundRobin",
    "ShardCache",
    "ShardError",
    "ShardFormatError",
    "ShardOpenError",
    "ShardWriter",
    "SimpleShardList",
    "StateMismatchError",
    "TarWriter",
    "UnsupportedError",
    "WebDataset",
    "WebLoader",
    "WorkerInfo",
    "__version__",
    "allow_unsafe_decoders",
    "associate",
    "batched",
    "build_index",
    "cache_info",
    "check_empty",
    "check_same_length",
    "clear_cache",
    "decode",
    "default_collation_fn",
    "detshuffle",
    "expand_urls",
    "extract_keys",
    "getfirst",
    "gopen",
    "gzfilter",
    "handle_extension",
    "ignore_and_continue",
    "ignore_and_stop",
    "imagehandler",
    "info",
    "install_as_webdataset",
    "load_index",
    "map",
    "map_dict",
    "map_tuple",
    "non_empty",
    "open_shard",
    "pipelinefilter",
    "pytorch_worker_info",
    "pytorch_worker_seed",
    "register_decoder",
    "rename",
    "rename_keys",
    "repeatedly",
    "reraise_exception",
    "resampled",
    "rsample",
    "select",
    "shuffle",
    "single_node_only",
    "slice",
    "split_by_node",
    "split_by_worker",
    "tarfile_samples",
    "tarfile_to_samples",
    "to_tuple",
    "torch_audio",
    "torch_loads",
    "torch_video",
    "transform_with",
    "unbatched",
    "unlisted",
    "warn_and_continue",
    "warn_and_stop",
    "with_epoch",
    "with_length",
    "write_index",
    "xdecode",
]

# CLOUDSHARDS_AS_WEBDATASET=1 (set by install_as_webdataset for child processes) turns the
# webdataset switch on in every process that imports cloudshards.
install_from_env()
