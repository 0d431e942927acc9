"""webdataset 1.0.2's ``webdataset.tariterators``: shards -> opened streams -> files -> samples.

``url_opener`` opens through cloudshards (any fsspec URL, prefetch, ranged reads, retries, the
node cache named by ``CLOUDSHARDS_CACHE_DIR``/``WDS_CACHE``); ``tar_file_iterator`` runs on
cloudshards' tar reader. ``tar_file_expander`` follows webdataset 0.2.x: no ``{}`` end-of-shard
marker unless ``eof_value={}`` (1.0.2's marker breaks programs that group files themselves);
``group_by_keys`` ends a sample at a new shard either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import braceexpand

from cloudshards.handlers import reraise_exception
from cloudshards.stages.base import make_rng
from cloudshards.stages.read import (
    base_plus_ext,
    group_by_keys,
    tar_file_expander,
    tar_file_iterator,
    tarfile_samples,
    tarfile_to_samples,
    url_opener,
    valid_sample,
)

__all__ = [
    "base_plus_ext",
    "group_by_keys",
    "meta_prefix",
    "meta_suffix",
    "reraise_exception",
    "shardlist",
    "tar_file_expander",
    "tar_file_iterator",
    "tarfile_samples",
    "tarfile_to_samples",
    "trace",
    "url_opener",
    "valid_sample",
]

#: webdataset's debugging switch; cloudshards logs at DEBUG instead.
trace = False
#: Top-level members named ``__...__`` are metadata and skipped.
meta_prefix = "__"
meta_suffix = "__"


def shardlist(urls: str | Iterable[str], *, shuffle: bool = False) -> Iterator[dict[str, Any]]:
    """Yield ``{"url": url}`` for each URL of a brace spec or list, shuffled if asked."""
    expanded = list(braceexpand.braceexpand(urls)) if isinstance(urls, str) else list(urls)
    if shuffle:
        make_rng("shardlist").shuffle(expanded)
    for url in expanded:
        yield {"url": url}
