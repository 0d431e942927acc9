"""The per-node shard cache on local disk, shared by every rank and worker on the machine.

:class:`ShardCache` opens shards through it (:mod:`~cloudshards.cache.shardcache`); the
directory's layout, budget, streams, entry keys and counters each have a module here.
"""

from __future__ import annotations

from typing import Any

from cloudshards.cache.admin import cache_info, clear_cache
from cloudshards.cache.keys import entry_name
from cloudshards.cache.shardcache import ShardCache
from cloudshards.cache.stats import CacheStats

__all__ = ["CacheStats", "ShardCache", "cache_info", "clear_cache", "entry_name"]


def __getattr__(name: str) -> Any:
    # ``wds.cache`` is this package, webdataset's ``wds.cache`` a module of its own: code
    # written for webdataset (``wds.cache.FileCache``, ``wds.cache.url_to_cache_name``) finds
    # its names here too, from cloudshards.webdataset.cache.
    from cloudshards.webdataset import cache as webdataset_cache

    if name.startswith("__") or name not in webdataset_cache.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(webdataset_cache, name)
