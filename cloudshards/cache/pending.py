"""A shard's member table on its way to disk beside a cache entry being committed (see
:mod:`cloudshards.cache.membertable`): the reader finishes its table on its own thread, the
download commits the entry on its own, and the table must be written exactly once, beside
the file it describes."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

from cloudshards.cache.files import inode_at
from cloudshards.cache.membertable import MemberTable

__all__ = ["PendingTable"]


class PendingTable:
    """A shard's member table on its way to disk beside an entry being committed: the reader
    gives it (from its thread) before, during or after the commit (the download's thread),
    and exactly one of the two writes it, with the entry or once the entry is in place."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: MemberTable | None = None
        self._taken: MemberTable | None = None
        self._committed = False
        self._entry: tuple[str, int, Any] | None = None  # (path, fd, its finalizer)

    def pin(self, entry: str | None, fd: int) -> None:
        """The file open at ``fd`` is being committed as ``entry``: hold it open (its inode
        cannot be reused by another file while held), to tell later whether ``entry`` is
        still this file (see :meth:`in_place`); :meth:`unpin` (or the collector) lets it go.
        Not pinned (no table saved after the commit): ``entry`` None, or no descriptor."""
        self.unpin()
        if entry is not None:
            with contextlib.suppress(OSError):
                held = os.dup(fd)
                self._entry = (entry, held, weakref.finalize(self, _close_quietly, held))

    def in_place(self) -> bool:
        """The pinned file is still the entry (not evicted, nor cached again since)."""
        pinned = self._entry
        try:
            return pinned is not None and inode_at(pinned[0]) == os.fstat(pinned[1]).st_ino
        except OSError:  # cannot tell: no table is safer than a wrong one
            return False

    def unpin(self) -> None:
        """Let the pinned file go (never raises)."""
        pinned, self._entry = self._entry, None
        if pinned is not None:
            pinned[2]()  # closes it, once

    def give(self, table: MemberTable) -> bool:
        """The reader's table; True: the entry is in place, and the caller writes it now."""
        with self._lock:
            self._table = table
            return self._committed

    def take(self) -> MemberTable | None:
        """The table the commit saves with the entry (None: the reader has none yet)."""
        with self._lock:
            self._taken = self._table
            return self._taken

    def committed(self) -> MemberTable | None:
        """The entry is in place: the table given since :meth:`take`, for the caller to
        write (None: there is none, or the commit saved it)."""
        with self._lock:
            self._committed = True
            return self._table if self._table is not self._taken else None


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
