"""The per-node shard cache on local disk, shared by every rank and worker on the machine.

:class:`ShardCache` opens shards through it (:mod:`~cloudshards.cache.shardcache`); the
directory's layout, budget, streams, entry keys and counters each have a module here.
"""

from __future__ import annotations

from cloudshards.cache.admin import cache_info, clear_cache
from cloudshards.cache.keys import entry_name
from cloudshards.cache.shardcache import ShardCache
from cloudshards.cache.stats import CacheStats

__all__ = ["CacheStats", "ShardCache", "cache_info", "clear_cache", "entry_name"]
