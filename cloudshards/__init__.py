"""cloudshards: train PyTorch models directly from WebDataset tar shards in object storage.

``import cloudshards as wds`` runs code written for ``import webdataset as wds``.

The names load lazily (PEP 562): ``import cloudshards`` imports no submodule, so the command
line and torch-free code never pay for torch. ``_EXPORTS`` says which module defines each name;
webdataset's own names are forwarded from :mod:`cloudshards.webdataset`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cloudshards import config

# Type checkers and IDEs see the names of __all__ (the others are Any, through __getattr__);
# tests/test_public_api.py checks this block against _EXPORTS.
if TYPE_CHECKING:
    from cloudshards.cache import CacheStats, ShardCache, cache_info, clear_cache
    from cloudshards.clips import AudioClip, VideoClip
    from cloudshards.dataset import WebDataset, WebLoader
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
        ShardNotFoundError,
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
    from cloudshards.loader import StatefulLoader
    from cloudshards.mix import RandomMix, RoundRobin, WeightedMix
    from cloudshards.multishard import MultiShardSample
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
    from cloudshards.source import open_shard
    from cloudshards.stages.base import PipelineStage, pipelinefilter
    from cloudshards.stages.batch import batched, default_collation_fn, unbatched, unlisted
    from cloudshards.stages.epoch import repeatedly
    from cloudshards.stages.fields import (
        extract_keys,
        getfirst,
        rename,
        rename_keys,
        to_tuple,
        transform_with,
        xdecode,
    )
    from cloudshards.stages.shuffle import detshuffle, shuffle
    from cloudshards.stages.transform import (
        associate,
        decode,
        map_dict,
        map_tuple,
        rsample,
    )
    from cloudshards.urls import expand_urls
    from cloudshards.webdataset import gopen, install_as_webdataset
    from cloudshards.webdataset.compat import check_empty
    from cloudshards.webdataset.extradatasets import with_epoch, with_length
    from cloudshards.webdataset.tariterators import tarfile_samples, tarfile_to_samples
    from cloudshards.writers import ShardWriter, TarWriter

__version__ = "0.1.0"

#: Module -> the names it gives the package. Core names come from the core modules;
#: webdataset's names that only webdataset code uses come from :mod:`cloudshards.webdataset`.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "cloudshards.cache": ("CacheStats", "ShardCache", "cache_info", "clear_cache"),
    "cloudshards.dataset": ("WebDataset", "WebLoader"),
    "cloudshards.loader": ("StatefulLoader",),
    "cloudshards.clips": ("AudioClip", "VideoClip"),
    "cloudshards.decoders": (
        "Continue",
        "Decoder",
        "DecodingError",
        "allow_unsafe_decoders",
        "gzfilter",
        "handle_extension",
        "imagehandler",
        "register_decoder",
        "torch_audio",
        "torch_loads",
        "torch_video",
    ),
    "cloudshards.dist": (
        "WorkerInfo",
        "check_same_length",
        "pytorch_worker_info",
        "pytorch_worker_seed",
    ),
    "cloudshards.errors": (
        "CacheError",
        "CloudShardsError",
        "ConfigError",
        "DecodeError",
        "ShardError",
        "ShardFormatError",
        "ShardNotFoundError",
        "ShardOpenError",
        "StateMismatchError",
        "UnsupportedError",
    ),
    "cloudshards.handlers": (
        "ignore_and_continue",
        "ignore_and_stop",
        "reraise_exception",
        "warn_and_continue",
        "warn_and_stop",
    ),
    "cloudshards.indexed": (
        "DistributedChunkedSampler",
        "IndexedDataset",
        "build_index",
        "load_index",
        "write_index",
    ),
    "cloudshards.mix": ("RandomMix", "RoundRobin", "WeightedMix"),
    "cloudshards.multishard": ("MultiShardSample",),
    "cloudshards.pipeline": ("DataPipeline", "FluidInterface", "FluidWrapper"),
    "cloudshards.shards": (
        "ResampledShards",
        "SimpleShardList",
        "non_empty",
        "resampled",
        "single_node_only",
        "split_by_node",
        "split_by_worker",
    ),
    "cloudshards.source": ("open_shard",),
    "cloudshards.stages.base": ("PipelineStage", "pipelinefilter"),
    "cloudshards.stages.batch": ("batched", "default_collation_fn", "unbatched", "unlisted"),
    "cloudshards.stages.epoch": ("repeatedly", "slice"),
    "cloudshards.stages.fields": (
        "extract_keys",
        "getfirst",
        "rename",
        "rename_keys",
        "to_tuple",
        "transform_with",
        "xdecode",
    ),
    "cloudshards.stages.shuffle": ("detshuffle", "shuffle"),
    "cloudshards.stages.transform": (
        "associate",
        "decode",
        "info",
        "map",
        "map_dict",
        "map_tuple",
        "rsample",
        "select",
    ),
    "cloudshards.urls": ("expand_urls",),
    "cloudshards.webdataset": (
        "Cached",
        "LMDBCached",
        "LRUCleanup",
        "MockDataset",
        "autodecode",
        "compat",
        "extradatasets",
        "filters",
        "gopen",
        "gopen_schemes",
        "install_as_webdataset",
        "install_from_env",
        "numpy_dumps",
        "pipe_cleaner",
        "pytorch",
        "pytorch_weights_only",
        "shardlists",
        "shardspec",
        "tariterators",
        "tenbin",
        "torch_dumps",
        "utils",
        "writer",
    ),
    "cloudshards.webdataset.compat": ("check_empty",),
    "cloudshards.webdataset.extradatasets": ("with_epoch", "with_length"),
    "cloudshards.webdataset.tariterators": ("tarfile_samples", "tarfile_to_samples"),
    "cloudshards.writers": ("ShardWriter", "TarWriter"),
}

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

#: ``map``, ``slice``, ``select`` and ``info`` are attributes (``wds.map(f)`` in a
#: ``DataPipeline``) but not in ``__all__``: ``from cloudshards import *`` must not shadow the
#: builtins (or the ``select`` module).
__all__ = [
    "AudioClip",
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
    "ShardNotFoundError",
    "ShardOpenError",
    "ShardWriter",
    "SimpleShardList",
    "StateMismatchError",
    "StatefulLoader",
    "TarWriter",
    "UnsupportedError",
    "VideoClip",
    "WebDataset",
    "WebLoader",
    "WeightedMix",
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
    "install_as_webdataset",
    "load_index",
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
    "shuffle",
    "single_node_only",
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


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use (or the submodule ``name``)."""
    module = _MODULE_OF.get(name)
    if module is None:
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        # ``cloudshards.<submodule>`` after a bare ``import cloudshards``, as before names
        # were lazy (the eager imports left every submodule set on the package).
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


# CLOUDSHARDS_AS_WEBDATASET=1 (set by install_as_webdataset for child processes) turns the
# webdataset switch on in every process that imports cloudshards.
if config.env_bool("AS_WEBDATASET"):
    from cloudshards.webdataset import install_from_env as _install_from_env

    _install_from_env()
