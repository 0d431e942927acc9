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
from collections.abc import Iterator
from typing import Any

from cloudshards.cache.files import (
    DirectoryId,
    check_directory,
    open_directory,
    open_file,
    replace_with,
    unlink_partial,
)
from cloudshards.cache.lock import DownloadLock, is_disk_full
from cloudshards.cache.membertable import MemberTable, load_table, write_table
from cloudshards.cache.stats import CacheStats, process_stats, save_stats, stats_file_name
from cloudshards.errors import CacheError, ConfigError
from cloudshards.logs import warn_once
from cloudshards.source import ShardStream

__all__ = ["SUBDIRECTORIES", "EntryStore"]

#: The subdirectories of a cache directory (see the layout above).
SUBDIRECTORIES = ("data", "meta", "locks", "stats")

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
        #: Each subdirectory's identity when this process first checked it (see _check_dirs).
        self._dir_ids: dict[str, DirectoryId] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_stats=None, _ready=False, _dir_ids={})
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
        """Create the subdirectories on first use; after that, check them again (each call):
        another user of a shared directory may have swapped one for a symlink since."""
        if self._ready:
            self._check_dirs(*SUBDIRECTORIES)
            return
        try:
            for sub in SUBDIRECTORIES:
                os.makedirs(self._path(sub), exist_ok=True)
                self._dir_ids[sub] = check_directory(self._path(sub))
        except OSError as exc:
            if is_disk_full(exc):
                raise  # the caller streams without caching
            raise CacheError(f"cannot create cache directory {self.directory}: {exc}") from exc
        self._ready = True

    def _check_dirs(self, *subs: str) -> None:
        """Raise :class:`CacheError` naming the first of ``subs`` that is no longer a real
        directory (a symlink swapped in since): checked right before the cache creates or
        renames files there. One removed (``rm -rf`` of the cache while a job runs) is made
        again, and one replaced by another real directory is taken as it is: both stay inside
        the cache. The identity found is what renames then hold to (:meth:`_rename_partial`),
        so a swap between this check and a rename is refused."""
        for sub in subs:
            path = self._path(sub)
            try:
                self._dir_ids[sub] = check_directory(path)
            except FileNotFoundError:
                try:
                    os.makedirs(path, exist_ok=True)
                    self._dir_ids[sub] = check_directory(path)
                except FileNotFoundError as exc:
                    raise CacheError(f"cache directory {path} is gone: {exc}") from exc

    @contextlib.contextmanager
    def _checked(self, sub: str) -> Iterator[int]:
        """A descriptor of subdirectory ``sub`` as last checked (checked now if this process
        has not yet): names resolved against it (``dir_fd=``) stay in that directory, so a
        symlink swapped in for it since is refused, never followed (:func:`open_directory`)."""
        if sub not in self._dir_ids:
            self._check_dirs(sub)
        fd = open_directory(self._path(sub), self._dir_ids[sub])
        try:
            yield fd
        finally:
            os.close(fd)

    def _rename_partial(self, name: str) -> None:
        """Put a download's partial file in place as its entry, both names resolved in the
        very data directory checked at start, whatever is at its path now."""
        with self._checked("data") as fd:
            os.replace(name + ".partial", name, src_dir_fd=fd, dst_dir_fd=fd)

    def _open_data(self, filename: str, flags: int) -> int:
        """:func:`open_file` of ``data/<filename>``, resolved in the data directory checked
        last: a symlink swapped in for ``data/`` since the check is refused, not followed."""
        with self._checked("data") as fd:
            return open_file(self._path("data", filename), flags, dir_fd=fd)

    def _remove_partial(self, name: str) -> None:
        """Remove a download's partial file, never through a swapped data directory (one
        swapped in since is left alone: the file is in the directory moved away)."""
        self._unlink_in("data", name + ".partial")

    def _clear_partial(self, name: str) -> None:
        """:func:`unlink_partial` of ``name``'s partial file, in the data directory checked
        last (raises :class:`CacheError` if it was swapped since, or a directory is there)."""
        with self._checked("data") as fd:
            unlink_partial(self._path("data", name + ".partial"), dir_fd=fd)

    def _unlink_in(self, sub: str, filename: str) -> None:
        """Remove ``sub/filename`` from the subdirectory checked last; nothing through one
        swapped since, and nothing where a directory (or nothing) is at that name."""
        try:
            with self._checked(sub) as fd, contextlib.suppress(OSError):
                os.unlink(filename, dir_fd=fd)
        except OSError as exc:  # CacheError too: swapped for a symlink, or gone
            logger.debug("cache: leaving %s in place: %s", self._path(sub, filename), exc)

    def _table_path(self, name: str) -> str:
        return self._path("meta", name + ".members.json")

    def _remove_entry(self, name: str) -> None:
        for sub, filename in (
            ("data", name),
            ("meta", name + ".json"),
            ("meta", os.path.basename(self._table_path(name))),
        ):
            self._unlink_in(sub, filename)

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
        try:
            self._check_dirs("stats")
        except OSError:
            return  # best effort, as saving is; never through a replaced directory
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
