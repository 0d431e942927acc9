"""Bytes of a download ahead handed to this process's own reader from memory.

A download ahead (:mod:`cloudshards.cache.ahead`) writes the entry's ``.partial`` file for
every process on the node. Its own process's reader would otherwise read those bytes back
from the file (a second copy of each byte through the kernel) and poll the file for growth.
Instead the downloading thread publishes each block here right after writing it, and the
reader (a :class:`~cloudshards.cache.follow.FollowStream`) takes the blocks it reaches while
they are still held, reads the file for the rest, and is woken when a block arrives.

Memory stays bounded: at most ``keep_bytes`` of blocks the reader has not passed are held (the
first ones of the shard until the reader starts, then those just ahead of it); a block
published while that much is held is not kept (it is on disk, and the reader reads it there).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

__all__ = ["Handoff"]


class Handoff:
    """Blocks of one download ahead, in order, for this process's reader of it.

    The downloading thread calls :meth:`publish` for every block after writing it to the
    partial file, then :meth:`finish`; the reader calls :meth:`take` and :meth:`wait`.

    Args:
        keep_bytes: Most bytes held at once (blocks beyond it are read from the file).
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._cond = threading.Condition()
        self._blocks: deque[tuple[int, bytes | memoryview]] = deque()  # (offset, block)
        self._held = 0
        self._end = 0  # bytes published (all of them written to the partial file)
        self._finished = False
        self._complete = False  # every byte of the object was published
        self._released = False  # the reader is gone (see release)
        self._read_to = 0  # where the reader is, and when it last read (see pace)
        self._read_at = time.monotonic()
        #: The download's own stream, the reader's from :attr:`end` on (see :meth:`hand_over`).
        self.stream: Any = None
        #: What ended the download, the reader's to raise at :attr:`end` (see :meth:`fail`).
        self.error: BaseException | None = None
        #: The download (a TeeStream), which saves the reader's member table as it commits.
        self.tee: Any = None

    @property
    def end(self) -> int:
        """Bytes published so far."""
        return self._end

    @property
    def finished(self) -> bool:
        """No more blocks will come."""
        return self._finished

    @property
    def complete(self) -> bool:
        """Every byte of the object was published: the reader's end of it is the end."""
        return self._complete

    @property
    def released(self) -> bool:
        """The reader is gone (closed, or done with the shard): the download stops keeping
        blocks, and a download of the reader's own stops as its reader's stream would."""
        return self._released

    def reader_at(self, offset: int) -> None:
        """The reader has read up to ``offset``."""
        with self._cond:
            self._read_to, self._read_at = offset, time.monotonic()
            self._cond.notify_all()

    def pace(self, idle_s: float) -> None:
        """Wait while the download is ``keep_bytes`` or more ahead of a reader that read in
        the last ``idle_s`` seconds: a reader that stops early (a shard cut by balancing, a
        ``slice``) then leaves little fetched in vain, as when it pulled the download itself,
        while a reader that waits (in a collective, for a follower of this download on
        another rank) holds nothing back for longer than ``idle_s``."""
        with self._cond:
            while (
                not self._released
                and self._end - self._read_to >= self.keep_bytes
                and time.monotonic() - self._read_at <= idle_s
            ):
                self._cond.wait(idle_s / 4)

    def release(self) -> Any:
        """The reader is gone: drop the blocks; return the stream handed over to it, if one
        was (the caller closes it: nobody else will)."""
        with self._cond:
            self._released = True
            self._blocks.clear()
            self._held = 0
            stream, self.stream = self.stream, None
            return stream

    def publish(self, block: bytes | memoryview) -> None:
        """Record the next ``len(block)`` bytes of the download (already in the file)."""
        with self._cond:
            if block and not self._released and self._held + len(block) <= self.keep_bytes:
                self._blocks.append((self._end, block))
                self._held += len(block)
            self._end += len(block)
            self._cond.notify_all()

    def hand_over(self, block: bytes | memoryview, stream: Any) -> bool:
        """The partial file was given up (a full disk): ``block``, read but not written, is
        held whatever its size, and ``stream`` (the rest of the download) is the reader's.
        False (nothing handed over) once the reader is gone."""
        with self._cond:
            if self._released:
                return False
            if block:
                self._blocks.append((self._end, block))
                self._held += len(block)
                self._end += len(block)
            self.stream = stream
            self._cond.notify_all()
            return True

    def fail(self, error: BaseException) -> None:
        """The download failed with ``error``: the reader raises it once it has the bytes
        published before (instead of fetching the shard again for the same failure)."""
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def finish(self, *, complete: bool = False) -> None:
        """No more blocks will come (the download completed, failed or was cancelled);
        ``complete``: it published the whole object."""
        with self._cond:
            self._finished = True
            self._complete = complete
            self._cond.notify_all()

    def take(self, offset: int, size: int) -> bytes | memoryview | None:
        """Up to ``size`` bytes (``size`` < 0: the rest of a block) from ``offset`` if they
        are held, dropping every block before them; None if they are not (read the file)."""
        with self._cond:
            blocks = self._blocks
            while blocks and blocks[0][0] + len(blocks[0][1]) <= offset:
                self._held -= len(blocks.popleft()[1])
            if not blocks or blocks[0][0] > offset:
                return None
            start, block = blocks[0]
            begin = offset - start
            end = len(block) if size < 0 else min(len(block), begin + size)
            if begin == 0 and end == len(block):
                return block
            return memoryview(block)[begin:end]

    def wait(self, offset: int, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until bytes past ``offset`` are published or the
        download is finished."""
        with self._cond:
            self._cond.wait_for(lambda: self._end > offset or self._finished, timeout)

    def wait_finished(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the download has ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished, timeout)

    def clear(self) -> None:
        """Drop every held block (the reader is done, or never came)."""
        with self._cond:
            self._blocks.clear()
            self._held = 0
