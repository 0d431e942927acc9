"""webdataset 1.0.2's module layout, backed by cloudshards.

After :func:`cloudshards.install_as_webdataset`, ``import webdataset`` and
``import webdataset.<module>`` resolve here. The submodules mirror webdataset's
(``filters``, ``tariterators``, ``shardlists``, ``autodecode``, ...) and this package has
webdataset 1.0.2's top-level names; docs/migrating.md says which version's behaviour each
follows and what is left out.
"""

from __future__ import annotations

from cloudshards.webdataset import (
    autodecode,
    cache,
    compat,
    extradatasets,
    filters,
    handlers,
    mix,
    pipeline,
    pytorch,
    shardlists,
    tariterators,
    tenbin,
    utils,
    writer,
)
from cloudshards.webdataset._install import install_as_webdataset as install_as_webdataset
from cloudshards.webdataset._install import install_from_env as install_from_env
from cloudshards.webdataset.autodecode import (
    Continue,
    Decoder,
    DecodingError,
    gzfilter,
    handle_extension,
    imagehandler,
    pytorch_weights_only,
    torch_audio,
    torch_loads,
    torch_video,
)
from cloudshards.webdataset.cache import LRUCleanup, pipe_cleaner
from cloudshards.webdataset.compat import FluidInterface, FluidWrapper, WebDataset, WebLoader
from cloudshards.webdataset.extradatasets import MockDataset, with_epoch, with_length
from cloudshards.webdataset.filters import (
    Cached,
    LMDBCached,
    associate,
    batched,
    decode,
    detshuffle,
    extract_keys,
    getfirst,
    info,
    map,
    map_dict,
    map_tuple,
    pipelinefilter,
    rename,
    rename_keys,
    rsample,
    select,
    shuffle,
    slice,
    to_tuple,
    transform_with,
    unbatched,
    xdecode,
)

# After the submodule imports above, so that `gopen` names the function, as in webdataset.
from cloudshards.webdataset.gopen import gopen, gopen_schemes
from cloudshards.webdataset.handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from cloudshards.webdataset.mix import RandomMix, RoundRobin
from cloudshards.webdataset.pipeline import DataPipeline
from cloudshards.webdataset.shardlists import (
    MultiShardSample,
    ResampledShards,
    SimpleShardList,
    non_empty,
    resampled,
    shardspec,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from cloudshards.webdataset.tariterators import tarfile_samples, tarfile_to_samples
from cloudshards.webdataset.utils import PipelineStage, repeatedly
from cloudshards.webdataset.writer import ShardWriter, TarWriter, numpy_dumps, torch_dumps

#: The webdataset API version this package follows (``cloudshards.__version__`` is ours).
__version__ = "1.0.2"

__all__ = [
    "Cached",
    "Continue",
    "DataPipeline",
    "Decoder",
    "DecodingError",
    "FluidInterface",
    "FluidWrapper",
    "LMDBCached",
    "LRUCleanup",
    "MockDataset",
    "MultiShardSample",
    "PipelineStage",
    "RandomMix",
    "ResampledShards",
    "RoundRobin",
    "ShardWriter",
    "SimpleShardList",
    "TarWriter",
    "WebDataset",
    "WebLoader",
    "associate",
    "autodecode",
    "batched",
    "cache",
    "compat",
    "decode",
    "detshuffle",
    "extract_keys",
    "extradatasets",
    "filters",
    "getfirst",
    "gopen",
    "gopen_schemes",
    "gzfilter",
    "handle_extension",
    "handlers",
    "ignore_and_continue",
    "ignore_and_stop",
    "imagehandler",
    "info",
    "map",
    "map_dict",
    "map_tuple",
    "mix",
    "non_empty",
    "numpy_dumps",
    "pipe_cleaner",
    "pipeline",
    "pipelinefilter",
    "pytorch",
    "pytorch_weights_only",
    "rename",
    "rename_keys",
    "repeatedly",
    "reraise_exception",
    "resampled",
    "rsample",
    "select",
    "shardlists",
    "shardspec",
    "shuffle",
    "single_node_only",
    "slice",
    "split_by_node",
    "split_by_worker",
    "tarfile_samples",
    "tarfile_to_samples",
    "tariterators",
    "tenbin",
    "to_tuple",
    "torch_audio",
    "torch_dumps",
    "torch_loads",
    "torch_video",
    "transform_with",
    "unbatched",
    "utils",
    "warn_and_continue",
    "warn_and_stop",
    "with_epoch",
    "with_length",
    "writer",
    "xdecode",
]
