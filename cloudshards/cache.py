"""Per-node shard cache on local disk, shared by every rank and worker on the machine.

Layout under the cache directory::

    data/<name>            complete entries        data/<name>.partial   downloads in flight
    meta/<name>.json       size, ETag, URL         locks/<name>.lock     download locks (flock)
    stats/<host>-<pid>.json per-process counters   cache.lock            budget/eviction lock

``<name>`` is a hash of the URL (credentials and signing parameters removed) plus a sanitised
basename, so no URL can name a path outside the directory and no secret reaches a file name.
Exactly one process downloads a shard (it holds the entry's flock, which dies with it); it
serves its own consumer while writing ``.partial``, verifies length (and an MD5 when the store
guarantees one, see :mod:`cloudshards._cachefacts`), then renames into place. Other processes
follow the growing file, or take over if the downloader dies. Entries in use hold a shared
flock, which eviction respects. A full or read-only disk never fails a read: the shard is
streamed from the store instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from cloudshards import _cachelock
from cloudshards._cachefacts import distrust_checksums, entry_name, remote_facts, store_endpoint
from cloudshards._cachefollow import FollowStream
from cloudshards._cachelock import (
    CacheStats,
    DownloadLock,
    is_disk_full,
    is_locked,
    warn_disk_full,
)
from cloudshards._cachestreams import TeeStream
from cloudshards._membertable import MemberTable, load_table, write_table
from cloudshards.errors import CacheError, ConfigError
from cloudshards.fetch import open_remote
from cloudshards.io import OpenOptions, ShardStream, discard, open_shard
from cloudshards.redact import redact_url
from cloudshards.types import ByteSource
from cloudshards.urls import protocol_of

__all__ = ["CacheStats", "ShardCache", "cache_info", "clear_cache", "entry_name"]

logger = logging.getLogger(__name__)

#: The endpoint that is part of an entry's key (see :func:`store_endpoint`).
_endpoint = store_endpoint


class ShardCache:
    """A cache directory on local disk shared by all processes on this node.

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
        self._stats: CacheStats | None = None
        self._stats_pid = -1
        self._ready = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_stats=None, _stats_pid=-1, _ready=False)
        return state

    @property
    def stats(self) -> CacheStats:
        """This process's counters for this directory (fresh in each DataLoader worker),
        shared by every ShardCache of the process on the same directory: they are saved to
        one file per process, so separate counters would overwrite each other's."""
        if self._stats is None or self._stats_pid != os.getpid():
            self._stats = _PROCESS_STATS.setdefault(self.directory, CacheStats())
            self._stats_pid = os.getpid()
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
        except OSError as exc:
            if is_disk_full(exc):
                raise  # the caller streams without caching
            raise CacheError(f"cannot create cache directory {self.directory}: {exc}") from exc
        self._ready = True

    # --- opening --------------------------------------------------------------------------

    def open(
        self,
        url: str,
        options: OpenOptions | None = None,
        *,
        shard_index: int | None = None,
        wait_s: float = 120.0,
        open_store: Callable[[], ByteSource] | None = None,
    ) -> Any:
        """Open a shard through the cache: a hit reads the local file, a miss downloads once
        per node while streaming, a download in flight elsewhere is followed.

        Local paths and ``pipe:`` URLs are opened directly (caching them gains nothing).

        Args:
            url: The shard URL.
            options: Storage options.
            shard_index: Position in the epoch (for errors).
            wait_s: How long to wait for another process's download to start writing.
            open_store: Opens the shard in the store on a miss (e.g. as parallel ranged
                GETs); default: one streaming GET that resumes after failures.

        A full or read-only cache disk (ENOSPC, EDQUOT, EFBIG, EROFS wherever the cache writes)
        streams the shard from the store instead, with one warning per process.

        Raises:
            CacheError: Another process holds the download but wrote nothing for ``wait_s``.
        """
        options = options or OpenOptions()
        if protocol_of(url) in ("file", "pipe"):
            return open_shard(url, options, shard_index=shard_index)
        try:
            self._ensure_ready()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            return self._stream_uncached(url, options, shard_index, open_store, exc)
        name = entry_name(url, store_endpoint(url, options))
        deadline = time.monotonic() + wait_s
        delay = 0.002
        own = name in self.stats._ahead  # downloaded ahead by this process: counted as a miss
        self.stats._ahead.discard(name)
        while True:
            hit = self._open_hit(name, url, shard_index, counted=not own)
            if hit is not None:
                return hit
            try:
                lock = self._claim(name)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise CacheError(
                        f"cannot lock a cache entry for {redact_url(url)}: {exc}"
                    ) from exc
                return self._stream_uncached(url, options, shard_index, open_store, exc)
            if lock is not None:
                return self._download(
                    url, name, options, shard_index, lock, skip=0, open_store=open_store
                )
            try:
                fd = os.open(self._path("data", name + ".partial"), os.O_RDONLY)
            except FileNotFoundError:
                # The downloader has the lock but has not created its file yet (first byte
                # latency, retries, waiting for the budget lock), or just finished: look again.
                if time.monotonic() > deadline:
                    raise CacheError(
                        f"another process holds the download of {redact_url(url)} but wrote "
                        f"nothing for {wait_s:.0f} s"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                continue
            if not own:
                self.stats.waits += 1
            follow = FollowStream(
                fd,
                url,
                entry=self._path("data", name),
                lock_path=self._path("locks", name + ".lock"),
                stats=CacheStats() if own else self.stats,
                take_over=lambda offset: self._take_over(url, name, options, shard_index, offset),
                on_close=self._save_stats,
            )
            follow.table_path = self._table_path(name)
            return follow

    def download_ahead(
        self,
        url: str,
        options: OpenOptions,
        *,
        shard_index: int | None = None,
        open_store: Callable[[], ByteSource] | None = None,
        cancel: threading.Event | None = None,
    ) -> threading.Thread | None:
        """Start downloading a shard that will be read soon, in a background thread.

        The thread writes the entry at the store's speed, independently of any consumer; the
        consumer later calls :meth:`open` as usual and reads the growing file (or the finished
        entry), as every other process on the node does. Nothing starts (None) when the entry
        is complete, another process is downloading it, the URL is local, or the shard cannot
        be cached (budget, disk): :meth:`open` then handles it as before. A failure in the
        thread abandons the partial file; whoever reads it takes the download over.
        """
        stats = self.stats
        if (
            protocol_of(url) in ("file", "pipe")
            or self.max_bytes is not None
            or not stats._committed_one
            or stats._disk_full
        ):
            # Under a byte budget, entries downloaded ahead would compete for room with the
            # ones in use; before this process has cached anything, or once the disk is full,
            # a download ahead may not be cacheable: the consumer downloads those itself.
            return None
        name = entry_name(url, store_endpoint(url, options))
        try:
            self._ensure_ready()
            if os.path.exists(self._path("data", name)):
                return None
            lock = self._claim(name)
        except OSError as exc:  # the consumer opens it as usual, and deals with the disk
            logger.debug("cache: no download ahead of %s: %s", redact_url(url), exc)
            return None
        if lock is None:
            return None
        try:
            stream = self._download(
                url, name, options, shard_index, lock, skip=0, open_store=open_store
            )
        except Exception as exc:  # the consumer opens it again and reports what fails
            logger.debug("cache: no download ahead of %s: %s", redact_url(url), exc)
            return None
        if not isinstance(stream, TeeStream):  # not cacheable: the consumer streams it
            self.stats.uncached -= 1  # counted when the consumer streams it
            self._save_stats()
            stream.close()
            return None

        def cancelled() -> None:
            # Nobody reads a cancelled download ahead: it is no miss (dropping the partial file
            # took that back), nor a shard streamed uncached; a later open of it is no longer
            # this process's own download, and counts as usual.
            stats.uncached -= 1
            stats._ahead.discard(name)
            self._save_stats()

        thread = threading.Thread(
            target=_download_in_background,
            args=(stream, cancel, cancelled),
            name="cloudshards-cache-ahead",
            daemon=True,
        )
        self.stats._ahead.add(name)
        thread.start()
        return thread

    def _claim(self, name: str) -> DownloadLock | None:
        """Take the download lock of an entry that is not complete; None if it is complete
        or another process holds the lock."""
        _cachelock._checkpoint("before_claim")
        lock = DownloadLock(self._path("locks", name + ".lock"))
        if not lock.try_acquire():
            return None
        if os.path.exists(self._path("data", name)):
            lock.release()
            return None
        return lock

    def _take_over(
        self, url: str, name: str, options: OpenOptions, shard_index: int | None, offset: int
    ) -> Any:
        try:
            lock = self._claim(name)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            warn_disk_full(self.stats, exc)
            lock = None
        if lock is not None:
            return self._download(url, name, options, shard_index, lock, skip=offset)
        # Someone else took over first (or finished), or the disk is full: stream this one
        # directly from the store.
        stream = open_remote(url, options, shard_index=shard_index)
        discard(stream, offset)
        return stream

    def _open_hit(
        self, name: str, url: str, shard_index: int | None, *, counted: bool = True
    ) -> ShardStream | None:
        entry = self._path("data", name)
        try:
            fd = os.open(entry, os.O_RDONLY)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # in use: eviction skips it
        info = os.fstat(fd)
        meta = self._read_meta(name)
        try:
            same = os.stat(entry).st_ino == info.st_ino
        except FileNotFoundError:
            same = False
        if not same:  # evicted between open and lock
            os.close(fd)
            return None
        if meta is None or meta.get("size") != info.st_size:
            os.close(fd)
            logger.warning(
                "cache: entry for %s is corrupt or truncated; refetching", redact_url(url)
            )
            with contextlib.suppress(OSError):  # a read-only disk: it is streamed instead
                self._remove_entry(name)
            return None
        with contextlib.suppress(OSError):
            os.utime(entry)  # least-recently-used order
        if counted:
            self.stats.hits += 1
        raw = os.fdopen(fd, "rb", buffering=0)
        return _CachedFile(raw, url, self, shard_index, self._table_path(name), counted=counted)

    def _download(
        self,
        url: str,
        name: str,
        options: OpenOptions,
        shard_index: int | None,
        lock: DownloadLock,
        *,
        skip: int,
        open_store: Callable[[], ByteSource] | None = None,
    ) -> Any:
        endpoint = store_endpoint(url, options)
        try:
            if open_store is not None:
                remote = open_store()
            else:
                remote = open_remote(url, options, shard_index=shard_index)
            size, md5 = remote_facts(remote, url, options, endpoint)
        except BaseException:
            lock.release()
            raise
        partial = self._path("data", name + ".partial")
        stats = self.stats

        def abandon() -> None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            lock.release()

        try:
            reserved = self._reserve(name, size, lock)
        except OSError as exc:
            abandon()
            return self._degrade(remote, skip, exc, f"cannot reserve room for {partial}")
        if reserved != "ok":
            lock.release()
            if reserved == "full":
                self._warn_once("cache: budget full of entries in use; streaming without caching")
            stats.uncached += 1
            self._save_stats()
            discard(remote, skip)
            return remote

        tee: TeeStream | None = None

        def commit(nbytes: int) -> bool:
            written: list[str] = []
            try:
                written.append(self._path("meta", name + ".json"))
                self._write_meta(name, {"url": redact_url(url), "size": nbytes, "md5": md5})
                table = tee.member_table if tee is not None else None
                if table is not None:
                    written.append(self._table_path(name))
                    write_table(self._table_path(name), table, nbytes)
                else:  # never leave an older entry's table next to this one
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._table_path(name))
                _cachelock._checkpoint("before_rename")
                os.replace(partial, self._path("data", name))
                _cachelock._checkpoint("after_rename")
            except OSError as exc:
                for path in (partial, *written):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                if is_disk_full(exc):
                    warn_disk_full(stats, exc)
                else:
                    logger.warning("cache: cannot commit %s (%s); not cached", redact_url(url), exc)
                return False
            finally:
                lock.release()  # only now: a free lock means "entry in place, or none"
            _cachelock._checkpoint("after_unlock")
            stats._committed_one = True
            return True

        try:
            stats.misses += 1
            tee = TeeStream(
                remote,
                partial,
                commit=commit,
                abandon=abandon,
                on_close=self._save_stats,
                stats=stats,
                expected_size=size,
                expected_md5=md5,
                skip=skip,
                refetch=lambda: open_remote(url, options, shard_index=shard_index),
                distrust=lambda: distrust_checksums(url, endpoint),
            )
            tee.table_path = self._table_path(name)
            return tee
        except OSError as exc:
            stats.misses -= 1
            abandon()
            return self._degrade(remote, skip, exc, f"cannot create cache file {partial}")

    def _degrade(self, remote: Any, skip: int, exc: OSError, what: str) -> Any:
        """Serve ``remote`` without caching when the disk took no more; raise otherwise."""
        if not is_disk_full(exc):
            with contextlib.suppress(Exception):
                remote.close()
            raise CacheError(f"{what}: {exc}") from exc
        warn_disk_full(self.stats, exc)
        self.stats.uncached += 1
        self._save_stats()
        discard(remote, skip)
        return remote

    def _stream_uncached(
        self,
        url: str,
        options: OpenOptions,
        shard_index: int | None,
        open_store: Callable[[], ByteSource] | None,
        exc: OSError,
    ) -> Any:
        """Open the shard in the store, not through the cache: its disk is full or read-only."""
        remote = (
            open_store()
            if open_store is not None
            else open_remote(url, options, shard_index=shard_index)
        )
        return self._degrade(remote, 0, exc, f"cannot use the cache in {self.directory}")

    # --- budget -----------------------------------------------------------------------------

    def _reserve(self, name: str, size: int | None, lock: DownloadLock) -> str:
        """Make room for ``size`` bytes under the budget; record the reservation.

        Returns ``"ok"``, ``"too_big"`` (unknown size or larger than the budget) or ``"full"``
        (everything that could make room is in use).
        """
        os.ftruncate(lock.fd, 0)
        os.pwrite(lock.fd, str(size or 0).encode(), 0)
        if self.max_bytes is None:
            return "ok"
        if size is None:
            self._warn_once("cache: a shard's size is unknown; streaming it without caching")
            return "too_big"
        if size > self.max_bytes:
            self._warn_once(
                f"cache: a {size}-byte shard exceeds the {self.max_bytes}-byte budget; "
                "streaming it without caching"
            )
            return "too_big"
        with self._global_lock():
            entries, in_flight = self._scan(exclude=name)
            used = sum(s for _, s, _ in entries) + in_flight
            for entry, entry_size, _ in sorted(entries, key=lambda e: e[2]):
                if used + size <= self.max_bytes:
                    break
                if self._evict(entry):
                    used -= entry_size
            if used + size > self.max_bytes:
                return "full"
            # Visible to other reservers from now on, before we release the global lock.
            with open(self._path("data", name + ".partial"), "wb"):
                pass
        return "ok"

    def _scan(self, exclude: str = "") -> tuple[list[tuple[str, int, float]], int]:
        """Complete entries as (name, size, mtime), and bytes reserved by live downloads.

        Partial files whose downloader is gone are removed on the way.
        """
        entries: list[tuple[str, int, float]] = []
        in_flight = 0
        with os.scandir(self._path("data")) as it:
            for item in it:
                if not item.name.endswith(".partial"):
                    with contextlib.suppress(FileNotFoundError):
                        st = item.stat()
                        entries.append((item.name, st.st_size, st.st_mtime))
                    continue
                name = item.name[: -len(".partial")]
                if name == exclude:
                    continue
                lock_path = self._path("locks", name + ".lock")
                if is_locked(lock_path):
                    in_flight += _reserved_size(lock_path, item)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.path)  # left by a crashed downloader
        return entries, in_flight

    def _evict(self, name: str) -> bool:
        entry = self._path("data", name)
        try:
            fd = os.open(entry, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False  # in use
        try:
            self._remove_entry(name)
            self.stats.evictions += 1
            logger.debug("cache: evicted %s", name)
        finally:
            os.close(fd)
        return True

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

    # --- metadata and stats ----------------------------------------------------------------

    def _read_meta(self, name: str) -> dict[str, Any] | None:
        try:
            with open(self._path("meta", name + ".json")) as f:
                value = json.load(f)
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _write_meta(self, name: str, meta: dict[str, Any]) -> None:
        path = self._path("meta", name + ".json")
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(meta, f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _save_stats(self) -> None:
        path = self._path("stats", f"{socket.gethostname()}-{os.getpid()}.json")
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.stats.as_dict(), f)
            os.replace(tmp, path)
        except OSError:  # counters are best effort: a full disk must not fail a read
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _warn_once(self, message: str) -> None:
        if message not in self.stats._warned:
            self.stats._warned.add(message)
            logger.warning("%s", message)

    def info(self) -> dict[str, Any]:
        """Entries, bytes and summed per-process counters of this cache directory."""
        return cache_info(self.directory)


def _download_in_background(
    tee: TeeStream, cancel: threading.Event | None, on_cancelled: Callable[[], None]
) -> None:
    """Read ``tee`` to its end (it writes the entry and commits it), unless cancelled or it
    can no longer be cached (the consumer then streams the shard itself).

    Cancelled, it stops at once and abandons the partial file (then ``on_cancelled``), however
    little is left: completing it, as closing a consumer's stream does, would go on fetching
    after the iterator was closed, and race the prefetcher shutting its pool down."""
    try:
        while cancel is None or not cancel.is_set():
            if not tee.read(4 << 20):
                break
            if tee.partial_dropped:
                tee.stats.uncached -= 1  # counted again when the consumer streams it
                break
    except Exception as exc:
        logger.debug("cache: download ahead of %s stopped: %s", redact_url(tee.url), exc)
    finally:
        with contextlib.suppress(Exception):
            if cancel is None or not cancel.is_set():
                tee.close()
            elif tee.cancel():
                on_cancelled()


#: This process's counters per cache directory (see :attr:`ShardCache.stats`).
_PROCESS_STATS: dict[str, CacheStats] = {}
os.register_at_fork(after_in_child=_PROCESS_STATS.clear)


class _CachedFile(ShardStream):
    """A complete entry; counts its bytes and releases its shared lock on close. Its member
    table (see :mod:`cloudshards._membertable`) lets the reader slice members by offset."""

    def __init__(
        self,
        raw: Any,
        url: str,
        cache: ShardCache,
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


def _reserved_size(lock_path: str, partial: os.DirEntry[str]) -> int:
    try:
        with open(lock_path, "rb") as f:
            reserved = int(f.read() or b"0")
    except (OSError, ValueError):
        reserved = 0
    with contextlib.suppress(FileNotFoundError):
        reserved = max(reserved, partial.stat().st_size)
    return reserved


def cache_info(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a cache directory: entries, bytes, partial downloads, summed counters."""
    directory = os.path.abspath(os.fspath(directory))
    data = os.path.join(directory, "data")
    result: dict[str, Any] = {"directory": directory, "entries": 0, "bytes": 0, "partial": 0}
    if os.path.isdir(data):
        for item in os.scandir(data):
            if item.name.endswith(".partial"):
                result["partial"] += 1
            else:
                result["entries"] += 1
                result["bytes"] += item.stat().st_size
    totals: dict[str, int] = {}
    stats_dir = os.path.join(directory, "stats")
    if os.path.isdir(stats_dir):
        for item in os.scandir(stats_dir):
            if item.name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError), open(item.path) as f:
                    for key, value in json.load(f).items():
                        totals[key] = totals.get(key, 0) + int(value)
    result["counters"] = totals
    return result


def clear_cache(directory: str | os.PathLike[str]) -> int:
    """Remove every entry not in use (and stale partial files); returns entries removed."""
    cache = ShardCache(directory)
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
