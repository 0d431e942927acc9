"""The cache's byte budget: reservations for downloads, least-recently-used eviction of the
entries not in use (readers hold a shared ``flock`` on an entry, which eviction respects), and
streaming past the cache when its disk takes no more."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os

from cloudshards.cache.layout import EntryStore
from cloudshards.cache.lock import DownloadLock, is_disk_full, is_locked
from cloudshards.cache.stats import warn_disk_full
from cloudshards.errors import CacheError
from cloudshards.source import OpenOptions, ShardSource, StoreOpener, open_remote

__all__ = ["CacheBudget"]

logger = logging.getLogger(__name__)


class CacheBudget(EntryStore):
    """A cache directory under a byte budget (``max_bytes``; None: no limit)."""

    def keeps(self, size: int) -> bool:
        """Whether a shard of ``size`` bytes fits the budget at all (one larger is streamed
        without being kept)."""
        return self.max_bytes is None or size <= self.max_bytes

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
            os.close(self._open_data(name + ".partial", os.O_WRONLY | os.O_CREAT))
        return "ok"

    def _scan(self, exclude: str = "") -> tuple[list[tuple[str, int, float]], int]:
        """Complete entries as (name, size, mtime), and bytes reserved by live downloads.

        Partial files whose downloader is gone are removed on the way. Anything that is not
        a regular file (a symlink, FIFO or directory planted there) is no entry of ours: it
        is skipped with one warning naming it, never opened, followed or removed.
        """
        entries: list[tuple[str, int, float]] = []
        in_flight = 0
        with os.scandir(self._path("data")) as it:
            for item in it:
                try:
                    regular = item.is_file(follow_symlinks=False)
                except OSError:
                    regular = False
                if not regular:
                    # Planted by someone else (a symlink, FIFO, directory): not ours to
                    # count, open or remove; one warning names it, and eviction carries on.
                    self._warn_once(
                        f"cache: skipping {item.path}: not a regular file (a symlink, "
                        "directory, FIFO or device); never followed, evicted or removed"
                    )
                    continue
                if not item.name.endswith(".partial"):
                    with contextlib.suppress(FileNotFoundError):
                        st = item.stat(follow_symlinks=False)
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
            fd = self._open_data(name, os.O_RDONLY)
        except FileNotFoundError:
            return True
        except CacheError as exc:  # replaced by a symlink or FIFO since the scan: skip it
            self._warn_once(f"cache: not evicting {entry}: {exc}")
            return False
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

    def _degrade(
        self, remote: ShardSource, exc: OSError, what: str, *, counted: bool = True
    ) -> ShardSource:
        """Serve ``remote`` without caching when the disk took no more; raise otherwise.
        ``counted``: it counts as a shard streamed uncached."""
        if not is_disk_full(exc):
            with contextlib.suppress(Exception):
                remote.close()
            raise CacheError(f"{what}: {exc}") from exc
        warn_disk_full(self.stats, exc)
        if counted:
            self.stats.uncached += 1
        self._save_stats()
        return remote

    def _stream_uncached(
        self,
        url: str,
        options: OpenOptions,
        shard_index: int | None,
        open_store: StoreOpener | None,
        exc: OSError,
    ) -> ShardSource:
        """Open the shard in the store, not through the cache: its disk is full or read-only."""
        remote = (
            open_store()
            if open_store is not None
            else open_remote(url, options, shard_index=shard_index)
        )
        return self._degrade(remote, exc, f"cannot use the cache in {self.directory}")


def _reserved_size(lock_path: str, partial: os.DirEntry[str]) -> int:
    try:
        with open(lock_path, "rb") as f:
            reserved = int(f.read() or b"0")
    except (OSError, ValueError):
        reserved = 0
    with contextlib.suppress(FileNotFoundError):
        reserved = max(reserved, partial.stat().st_size)
    return reserved
