"""A cache directory's layout: its paths, entry metadata, member tables, counters, and the
reader of a complete entry.

Layout under the cache directory::

    data/<name>            complete entries        data/<name>.partial   downloads in flight
    meta/<name>.json       size, ETag, URL         locks/<name>.lock     download locks (flock)
    meta/<name>.members.json member table          stats/<host>-<pid>.json per-process counters
    cache.lock             budget/eviction lock
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

from cloudshards.cache.files import check_directory, open_file, replace_with
from cloudshards.cache.lock import DownloadLock, is_disk_full
from cloudshards.cache.membertable import MemberTable, load_table, write_table
from cloudshards.cache.stats import CacheStats, process_stats, save_stats, stats_file_name
from cloudshards.errors import CacheError, ConfigError
from cloudshards.logs import warn_once
from cloudshards.source import ShardStream

__all__ = ["EntryStore"]

logger = logging.getLogger(__name__)


class EntryStore:
    """The files of a cache directory: where each entry, its metadata and lock live.

    Cheap to construct and picklable: directories, locks and files are touched on first use.

    Args:
        directory: Cache directory (created if missing).
        max_bytes: Byte budget (least recently used entries not in use are evicted); None or
            a value <= 0 for no limit.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int | None = None):
        if not str(directory):
            raise ConfigError("cache directory must not be empty")
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        self.max_bytes = max_bytes if max_bytes is not None and max_bytes > 0 else None
        #: The counters this object last used (see :attr:`stats`); never pickled.
        self._stats: CacheStats | None = None
        self._ready = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_stats=None, _ready=False)
        return state

    @property
    def stats(self) -> CacheStats:
        """This process's counters for this directory (fresh in each DataLoader worker),
        shared by every ShardCache of the process on the same directory: they are saved to
        one file per process, so separate counters would overwrite each other's."""
        self._stats = process_stats(self.directory)
        return self._stats

    def _path(self, *parts: str) -> str:
        path = os.path.join(self.directory, *parts)
        # Names are hashes and sanitised suffixes; this guards the invariant anyway.
        if os.path.commonpath([self.directory, os.path.abspath(path)]) != self.directory:
            raise CacheError(f"cache path escapes {self.directory}: {path!r}")
        return path

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        try:
            for sub in ("data", "meta", "locks", "stats"):
                os.makedirs(self._path(sub), exist_ok=True)
                check_directory(self._path(sub))
        except OSError as exc:
            if is_disk_full(exc):
                raise  # the caller streams without caching
            raise CacheError(f"cannot create cache directory {self.directory}: {exc}") from exc
        self._ready = True

    def _table_path(self, name: str) -> str:
        return self._path("meta", name + ".members.json")

    def _remove_entry(self, name: str) -> None:
        for path in (
            self._path("data", name),
            self._path("meta", name + ".json"),
            self._table_path(name),
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _global_lock(self) -> DownloadLock:
        return DownloadLock(self._path("cache.lock"))

    def _read_meta(self, name: str) -> dict[str, Any] | None:
        try:
            with os.fdopen(open_file(self._path("meta", name + ".json"), os.O_RDONLY)) as f:
                value = json.load(f)
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _write_meta(self, name: str, meta: dict[str, Any]) -> None:
        replace_with(self._path("meta", name + ".json"), json.dumps(meta).encode())

    def _save_stats(self) -> None:
        save_stats(self._path("stats", stats_file_name()), self.stats)

    def _warn_once(self, message: str) -> None:
        warn_once(logger, self.stats._warned, "%s", message, key=message)


class _CachedFile(ShardStream):
    """A complete entry; counts its bytes and releases its shared lock on close. Its member
    table (see :mod:`cloudshards.cache.membertable`) lets the reader slice members by offset."""

    def __init__(
        self,
        raw: Any,
        url: str,
        cache: EntryStore,
        shard_index: int | None,
        table_path: str,
        *,
        counted: bool = True,
    ) -> None:
        super().__init__(raw, url, shard_index=shard_index)
        self._cache = cache
        self._table_path = table_path
        self._counted = counted

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def member_table(self) -> MemberTable | None:
        """The saved table of this entry, if there is a valid one."""
        return load_table(self._table_path, os.fstat(self.fileno()).st_size)

    def save_member_table(self, table: MemberTable) -> None:
        """Save the table of this entry (recorded by a complete parse)."""
        write_table(self._table_path, table, os.fstat(self.fileno()).st_size)

    def count_bytes(self, nbytes: int) -> None:
        """Count bytes read through the member table (they bypass ``read``)."""
        self.offset += nbytes

    def close(self) -> None:
        if not self.closed:
            if self._counted:
                self._cache.stats.bytes_disk += self.offset
            self._cache._save_stats()
        super().close()
