"""Per-node shard cache on local disk, shared by every rank and worker on the machine: opening
a shard through it (a hit, a download, following another process's download).

Its files are described in :mod:`cloudshards.cache.layout`.
``<name>`` is a hash of the URL (credentials and signing parameters removed) plus a sanitised
basename, so no URL can name a path outside the directory and no secret reaches a file name.
Exactly one process downloads a shard (it holds the entry's flock, which dies with it); it
serves its own consumer while writing ``.partial``, verifies length (and a checksum when the
store guarantees one, see :mod:`cloudshards.cache.facts`), then renames into place. Other processes
follow the growing file, or take over if the downloader dies. Entries in use hold a shared
flock, which eviction respects. A full or read-only disk never fails a read: the shard is
streamed from the store instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from typing import Any

from cloudshards.cache import ahead
from cloudshards.cache import lock as _cachelock
from cloudshards.cache.budget import CacheBudget
from cloudshards.cache.direct import direct_writes, read_ahead
from cloudshards.cache.facts import distrust_checksums, remote_facts
from cloudshards.cache.files import inode_at
from cloudshards.cache.follow import FollowStream
from cloudshards.cache.keys import entry_name, store_endpoint
from cloudshards.cache.layout import _CachedFile
from cloudshards.cache.lock import DownloadLock, is_disk_full
from cloudshards.cache.membertable import write_table
from cloudshards.cache.stats import CacheStats, warn_disk_full
from cloudshards.cache.tee import TeeStream
from cloudshards.errors import CacheError
from cloudshards.redact import redact_url
from cloudshards.source import (
    OpenOptions,
    ShardSource,
    StoreOpener,
    is_local,
    open_remote,
    open_shard,
)

__all__ = ["ShardCache"]

logger = logging.getLogger(__name__)


class ShardCache(CacheBudget):
    """A cache directory on local disk shared by all processes on this node.

    Cheap to construct and picklable: directories, locks and files are touched on first use.

    Args:
        directory: Cache directory (created if missing).
        max_bytes: Byte budget (least recently used entries not in use are evicted); None or
            a value <= 0 for no limit.
    """

    # --- opening --------------------------------------------------------------------------

    def open(
        self,
        url: str,
        options: OpenOptions | None = None,
        *,
        shard_index: int | None = None,
        wait_s: float = 120.0,
        open_store: StoreOpener | None = None,
    ) -> ShardSource:
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
        if is_local(url):
            return open_shard(url, options, shard_index=shard_index)
        return self.open_entry(
            url, options, shard_index=shard_index, wait_s=wait_s, open_store=open_store
        )

    def open_entry(
        self,
        url: str,
        options: OpenOptions,
        *,
        shard_index: int | None,
        wait_s: float,
        open_store: StoreOpener | None,
        cancel: threading.Event | None = None,
        keep_bytes: int = 0,
        expect_size: int | None = None,
    ) -> ShardSource:
        """Open a remote shard through the cache (see :meth:`open`; this is what
        :func:`~cloudshards.source.open_source` calls for a remote shard). With ``cancel``
        (set when the reader is closed), a download it claims runs as a download ahead does
        (see :func:`cloudshards.cache.ahead.run_in_background`). ``expect_size``: the size
        the caller knows the object has now (an index's); an entry of another size is an
        older copy, removed and fetched again."""
        try:
            self._ensure_ready()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            return self._stream_uncached(url, options, shard_index, open_store, exc)
        name = entry_name(url, store_endpoint(url, options))
        deadline = time.monotonic() + wait_s
        delay = 0.002
        # Downloaded ahead by this process: counted as a miss; its blocks still in memory are
        # handed to this reader (see cache.handoff).
        handoff = self.stats._ahead.pop(name, None)
        own = handoff is not None
        while True:
            hit = self._open_hit(name, url, shard_index, counted=not own, expect_size=expect_size)
            if hit is not None:
                if handoff is not None:
                    handoff.clear()
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
                stream = self._download(
                    url, name, options, shard_index, lock, open_store=open_store
                )
                own_download = None
                if cancel is not None and isinstance(stream, TeeStream):
                    own_download = ahead.follow_own(self, name, stream, cancel, keep_bytes)
                if own_download is None:
                    return stream
                (fd, handoff), own = own_download, True  # followed like a download ahead
            else:
                try:
                    fd = self._open_data(name + ".partial", os.O_RDONLY)
                except FileNotFoundError:
                    # The downloader has the lock but has not created its file yet (first
                    # byte latency, retries, the budget lock), or just finished: look again.
                    if time.monotonic() > deadline:
                        raise CacheError(
                            f"another process holds the download of {redact_url(url)} but "
                            f"wrote nothing for {wait_s:.0f} s"
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
                take_over=lambda: self._take_over(url, name, options, shard_index),
                on_close=self._save_stats,
                handoff=handoff,
            )
            follow.table_path = self._table_path(name)
            return follow

    def join_downloads(self, cancel: threading.Event, timeout: float) -> None:
        """Wait for the downloads :meth:`open_entry` ran for readers closed with ``cancel``."""
        ahead.join_downloads(self.stats, cancel, timeout)

    def download_ahead(self, url: str, options: OpenOptions, **kw: Any) -> threading.Thread | None:
        """Start downloading a shard that will be read soon, in a background thread (see
        :func:`cloudshards.cache.ahead.download_ahead`); None when nothing started."""
        return ahead.download_ahead(self, url, options, **kw)

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
        self, url: str, name: str, options: OpenOptions, shard_index: int | None
    ) -> ShardSource:
        """The shard from its first byte, downloaded into a new file when the lock is free
        (the follower checks it against what it read, see FollowStream)."""
        try:
            lock = self._claim(name)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            warn_disk_full(self.stats, exc)
            lock = None
        if lock is not None:
            return self._download(url, name, options, shard_index, lock)
        # Someone else took over first (or finished), or the disk is full: stream this one
        # directly from the store.
        return open_remote(url, options, shard_index=shard_index)

    def _open_hit(
        self,
        name: str,
        url: str,
        shard_index: int | None,
        *,
        counted: bool = True,
        expect_size: int | None = None,
    ) -> _CachedFile | None:
        entry = self._path("data", name)
        try:
            fd = self._open_data(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except CacheError as exc:  # not a regular file: planted, never read or followed
            raise CacheError(f"the cache entry of {redact_url(url)}: {exc}") from None
        fcntl.flock(fd, fcntl.LOCK_SH)  # in use: eviction skips it
        info = os.fstat(fd)
        meta = self._read_meta(name)
        if inode_at(entry) != info.st_ino:  # evicted between open and lock
            os.close(fd)
            return None
        stale = expect_size is not None and info.st_size != expect_size
        if meta is None or meta.get("size") != info.st_size or stale:
            os.close(fd)
            logger.warning(
                "cache: entry for %s is %s; refetching",
                redact_url(url),
                f"{info.st_size} bytes, the object {expect_size} (an older copy)"
                if stale
                else "corrupt or truncated",
            )
            with contextlib.suppress(OSError):  # a read-only disk: it is streamed instead
                self._remove_entry(name)
            return None
        with contextlib.suppress(OSError):
            os.utime(entry)  # least-recently-used order
        if direct_writes():  # written past the page cache: the disk starts on all of it now
            read_ahead(fd, info.st_size)
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
        open_store: StoreOpener | None = None,
        count_uncached: bool = True,
    ) -> ShardSource:
        endpoint = store_endpoint(url, options)
        try:
            if open_store is not None:
                remote = open_store()
            else:
                remote = open_remote(url, options, shard_index=shard_index)
            size, checksum = remote_facts(remote, url, options, endpoint)
        except BaseException:
            lock.release()
            raise
        partial = self._path("data", name + ".partial")
        stats = self.stats

        def abandon() -> None:
            self._remove_partial(name)
            lock.release()

        try:
            self._check_dirs("data", "locks")  # swapped for a symlink since the last shard?
            self._clear_partial(name)
            reserved = self._reserve(name, size, lock)
        except OSError as exc:
            abandon()
            return self._degrade(
                remote, exc, f"cannot reserve room for {partial}", counted=count_uncached
            )
        if reserved != "ok":
            lock.release()
            if reserved == "full":
                self._warn_once("cache: budget full of entries in use; streaming without caching")
            if count_uncached:
                stats.uncached += 1
            self._save_stats()
            return remote

        tee: TeeStream | None = None
        # What the entry was verified against: "crc32c:<hex>", "md5:<hex>" or None.
        meta = {"url": redact_url(url), "checksum": None if checksum is None else str(checksum)}

        def commit(nbytes: int) -> bool:
            written: list[str] = []
            try:
                self._check_dirs("data", "meta")
                written.append(self._path("meta", name + ".json"))
                self._write_meta(name, {**meta, "size": nbytes})
                table = tee.tables.take() if tee is not None else None
                if table is not None:
                    written.append(self._table_path(name))
                    write_table(self._table_path(name), table, nbytes)
                else:  # never leave an older entry's table next to this one
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._table_path(name))
                _cachelock._checkpoint("before_rename")
                self._rename_partial(name)  # in the data directory checked, whatever is there
                _cachelock._checkpoint("after_rename")
            except OSError as exc:
                self._remove_partial(name)
                for path in written:
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
            self._check_dirs("data")  # the partial file is created there
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            tee = TeeStream(
                remote,
                partial,
                commit=commit,
                abandon=abandon,
                on_close=self._save_stats,
                stats=stats,
                expected_size=size,
                checksum=checksum,
                refetch=lambda: open_remote(url, options, shard_index=shard_index),
                distrust=lambda: distrust_checksums(url, endpoint),
                fd=self._open_data(name + ".partial", flags),
            )
            tee.table_path, tee.entry = self._table_path(name), self._path("data", name)
            return tee
        except OSError as exc:
            abandon()
            return self._degrade(
                remote, exc, f"cannot create cache file {partial}", counted=count_uncached
            )

    def info(self) -> dict[str, Any]:
        """Entries, bytes and summed per-process counters of this cache directory."""
        from cloudshards.cache.admin import cache_info

        return cache_info(self.directory)
