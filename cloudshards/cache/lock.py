"""The node cache's locks (a ``flock`` that dies with its holder), how a full disk or a bad
download is recognised, and the named checkpoints of the commit path (for tests)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from cloudshards.cache.files import open_file

#: Errors that mean "the disk cannot take this entry": degrade to uncached streaming.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})

#: The mode of a partial file whose bytes failed verification. Readers following it hold it
#: open (it is unlinked when abandoned), so they see the mode of that very inode: a partial
#: file is created 0o644 (less the umask) and never has an execute bit otherwise.
POISONED_MODE = 0o700


def _checkpoint(point: str) -> None:
    """Do nothing: a named point in the cache's commit path, for tests.

    Tests monkeypatch this module attribute to pause a thread at one point (an Event wait) or
    to look at the cache's state there, which makes the ordering rules observable without
    relying on timing. Callers use ``_cachelock._checkpoint(...)`` (after ``from
    cloudshards.cache import lock as _cachelock``; never a ``from`` import of the function),
    so a patch reaches them. Points, in the order a download meets them:

    - ``"before_claim"``: ``ShardCache._claim``, before it tries the download lock (the
      caller has just found no complete entry).
    - ``"before_rename"``: the commit, the entry verified and its metadata written, before
      ``os.replace`` puts it in place; the download lock is held.
    - ``"after_rename"``: the entry is in place; the download lock is still held.
    - ``"after_unlock"``: the commit succeeded and released the download lock.
    - ``"follower_caught_up"``: a FollowStream read nothing new (it caught up with the
      writer), before it checks whether the entry was committed or its downloader is gone.

    Called once per commit or claim and once per follower poll: a no-op call costs nothing
    next to the file operations around it.
    """


def is_disk_full(exc: BaseException) -> bool:
    """The cache's disk is full, over quota, or read-only (not a bug, not a store error)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def is_poisoned(fd: int) -> bool:
    """Whether the partial file open at ``fd`` was marked as failing verification."""
    return bool(os.fstat(fd).st_mode & stat.S_IXUSR)


class DownloadLock:
    """An exclusive ``flock`` on a lock file: released by the kernel if the process dies.

    ``with DownloadLock(path):`` waits for the lock; :meth:`try_acquire` does not.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def try_acquire(self, *, wait: bool = False) -> bool:
        """Take the lock (without waiting unless ``wait``); True on success."""
        fd = open_file(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                return False
            raise
        self.fd = fd
        return True

    def __enter__(self) -> DownloadLock:
        self.try_acquire(wait=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def is_locked(path: str) -> bool:
    """True when another process holds the download lock at ``path``.

    Opens the lock file read-only and never creates it: this works on a full or read-only
    disk (a missing lock file is held by no one).
    """
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock we may just have taken
    return False
