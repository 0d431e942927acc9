"""Looking at and clearing a cache directory from outside (``cloudshards cache info|clear``)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from cloudshards.cache.budget import CacheBudget
from cloudshards.cache.files import open_file

__all__ = ["cache_info", "clear_cache"]


def cache_info(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a cache directory: entries, bytes, partial downloads, summed counters."""
    directory = os.path.abspath(os.fspath(directory))
    data = os.path.join(directory, "data")
    result: dict[str, Any] = {"directory": directory, "entries": 0, "bytes": 0, "partial": 0}
    if os.path.isdir(data):
        for item in os.scandir(data):
            if not item.is_file(follow_symlinks=False):
                continue  # planted there (a symlink, FIFO, directory): no entry, never followed
            if item.name.endswith(".partial"):
                result["partial"] += 1
            else:
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                    result["bytes"] += item.stat(follow_symlinks=False).st_size
                    result["entries"] += 1
    totals: dict[str, int] = {}
    stats_dir = os.path.join(directory, "stats")
    if os.path.isdir(stats_dir):
        for item in os.scandir(stats_dir):
            if item.name.endswith(".json"):
                # Best effort: a file that is not this process's counters is skipped.
                with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                    with os.fdopen(open_file(item.path, os.O_RDONLY)) as f:
                        counters = {key: int(value) for key, value in json.load(f).items()}
                    for key, value in counters.items():
                        totals[key] = totals.get(key, 0) + value
    result["counters"] = totals
    return result


def clear_cache(directory: str | os.PathLike[str]) -> int:
    """Remove every entry not in use (and stale partial files); returns entries removed."""
    cache = CacheBudget(directory)
    if not os.path.isdir(os.path.join(cache.directory, "data")):
        return 0
    cache._ensure_ready()
    removed = 0
    with cache._global_lock():
        entries, _ = cache._scan()
        for name, _, _ in entries:
            if cache._evict(name):
                removed += 1
    for item in os.scandir(cache._path("stats")):
        with contextlib.suppress(OSError):
            os.unlink(item.path)
    return removed
