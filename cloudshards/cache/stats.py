"""The node cache's per-process counters: one :class:`CacheStats` per cache directory in each
process (fresh in each DataLoader worker), saved to one file per process."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass, field

from cloudshards.cache.files import replace_with
from cloudshards.cache.handoff import Handoff
from cloudshards.logs import warn_once
from cloudshards.process import PerProcess

__all__ = ["CacheStats", "process_stats", "save_stats", "warn_disk_full"]

logger = logging.getLogger(__name__)


@dataclass
class CacheStats:
    """Per-process cache counters.

    Attributes:
        hits: Shards served from a complete entry.
        misses: Shards this process downloaded (and cached), itself or ahead in the background.
        waits: Shards read by following another process's download.
        uncached: Shards streamed without caching (disk full or read-only, over budget, early
            stop, failed verification).
        bytes_network: Bytes this process downloaded for cache entries (a download that
            stopped part-way, at a full disk say, included). A shard streamed past the cache
            from its first byte (``uncached``: over the budget, disk full) is not counted here.
        bytes_disk: Bytes read from cache files (a shard this process downloaded ahead counts
            as a miss only: reading it back is part of that download, not a hit).
        evictions: Entries this process evicted.
    """

    hits: int = 0
    misses: int = 0
    waits: int = 0
    uncached: int = 0
    bytes_network: int = 0
    bytes_disk: int = 0
    evictions: int = 0
    _warned: set[str] = field(default_factory=set, repr=False)
    #: Entries this process downloaded ahead that its consumer has not opened yet, with the
    #: blocks held in memory for that consumer.
    _ahead: dict[str, Handoff] = field(default_factory=dict, repr=False)
    #: Downloads ahead start once this process has committed an entry, and never after the
    #: disk filled up: they must not cost a second download of what cannot be cached.
    _committed_one: bool = field(default=False, repr=False)
    #: Downloads this process's readers claimed, run in background threads, each with the
    #: event its reader sets when closed (see :meth:`ShardCache.open_entry`).
    _downloads: list[tuple[threading.Thread, threading.Event]] = field(
        default_factory=list, repr=False
    )
    _disk_full: bool = field(default=False, repr=False)

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def warn_disk_full(stats: CacheStats, exc: OSError) -> None:
    """Note that the disk took no more, with one warning per process and cache directory."""
    stats._disk_full = True
    warn_once(
        logger,
        stats._warned,
        "cache disk full or read-only (%s); streaming shards without caching until there "
        "is room (free space there, or give cache_dir another disk)",
        exc.strerror or exc,
        key="disk full",
    )


#: This process's counters per cache directory (see :attr:`ShardCache.stats`).
_PROCESS_STATS: PerProcess[dict[str, CacheStats]] = PerProcess(dict)


def process_stats(directory: str) -> CacheStats:
    """This process's counters for the cache in ``directory``, shared by every ShardCache of
    the process on it: they are saved to one file per process, so separate counters would
    overwrite each other's."""
    return _PROCESS_STATS.get().setdefault(directory, CacheStats())


def save_stats(path: str, stats: CacheStats) -> None:
    """Write ``stats`` to ``path`` (best effort: a full disk must not fail a read)."""
    with contextlib.suppress(OSError):
        replace_with(path, json.dumps(stats.as_dict()).encode())


def stats_file_name() -> str:
    """The name of this process's counters file."""
    return f"{socket.gethostname()}-{os.getpid()}.json"
