"""Cache writes past the page cache (``O_DIRECT``), for a node cache larger than the node's
memory: ``CLOUDSHARDS_CACHE_O_DIRECT=1``.

Written through the page cache (the default), every byte of a cold epoch also takes a page of
memory until write-back, pushing other pages out, and a writer that outruns the disk waits in
the kernel's dirty-page throttling. When the cache holds more than memory, the next epoch
cannot find those pages anyway. With ``CLOUDSHARDS_CACHE_O_DIRECT=1`` the downloads write from
one reused, page-aligned buffer straight to the disk, and a reader of an entry asks the disk
for all of it when it opens it (:func:`read_ahead`), so the slices it takes wait less.

Measured on this project's 2-core VMs (memory handed back to the host once freed, so every
fresh page costs), for 418 MB of shards: about 0.1-0.2 s of CPU for the writes against 1.1-1.3 s
through the page cache, and a cold epoch through the cache 5-10% faster at 0 DataLoader
workers. But a warm epoch then reads pages the disk filled, which the same VMs map slower
than pages written by the CPU: 23,000-35,000 against 54,000-89,000 samples/s at 0 workers in
three side-by-side runs (``benchmarks/bench_s3.py --setups direct --against``), whether or
not the finished entries were read back into memory at once. So it is off by default, for
caches that fit in memory.

Python has no aligned-buffer or direct-I/O helper in the libraries the project uses, hence
this module. A filesystem that refuses ``O_DIRECT`` (tmpfs on older kernels, some FUSE
mounts), at open or at the first write, is written through the page cache instead.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading

from cloudshards import config

__all__ = ["PartialWriter", "direct_writes", "read_ahead"]

logger = logging.getLogger(__name__)

#: Offsets, lengths and the buffer of a direct write are multiples of this (a page, and of
#: every disk's logical block size in practice).
ALIGN = 4096
#: The aligned buffer each download copies its bytes through (reused across downloads).
STAGE_BYTES = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)

_free_stages: list[mmap.mmap] = []  # kept for the next download: a fresh one costs page faults
_stages_lock = threading.Lock()
_KEEP_STAGES = 4


def direct_writes() -> bool:
    """Whether the cache writes past the page cache (``CLOUDSHARDS_CACHE_O_DIRECT=1``)."""
    return bool(_O_DIRECT) and config.env_bool("CACHE_O_DIRECT", False)


def _take_stage() -> mmap.mmap:
    with _stages_lock:
        if _free_stages:
            return _free_stages.pop()
    return mmap.mmap(-1, STAGE_BYTES)  # anonymous: page-aligned


def _give_stage(stage: mmap.mmap) -> None:
    with _stages_lock:
        if len(_free_stages) < _KEEP_STAGES:
            _free_stages.append(stage)
            return
    stage.close()


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the filesystem refuses it."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError as exc:
        logger.debug("cache: O_DIRECT %s refused (%s)", "on" if on else "off", exc)
        return False
    return True


#: The most one write through the page cache hands the kernel. A longer write lets it fill
#: the file with 2 MiB folios, each of which must be found (compacted) and cleared whole: on
#: a VM that gives its free memory back to the host, 400 MB written 2 MiB or more at a time
#: cost 1.0-1.3 s of system time, and 0.08-0.16 s written 1 MiB at a time (or 64 KiB, or
#: 512 KiB); reading the file back costs the same either way (measured on ext4, Linux 6.18).
PAGE_CACHE_WRITE = 1 << 20


class PartialWriter:
    """Appends to the partial file open at ``fd``; :attr:`written` counts every byte handed
    over. With ``O_DIRECT``, up to :data:`ALIGN` - 1 bytes wait in the buffer for the next
    write (followers of the file see them then), and :meth:`finish` writes them.

    Raises from :meth:`write` and :meth:`finish`: ``OSError`` as ``os.write`` does.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0
        self._stage: mmap.mmap | None = None
        self._staged = 0  # bytes at the start of the stage, not yet on disk
        if direct_writes() and _set_direct(fd, True):
            self._stage = _take_stage()

    @property
    def direct(self) -> bool:
        return self._stage is not None

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._stage is None:
            self._write_all(view)
        else:
            self._stage_and_write(view, self._stage)
        self.written += len(view)

    def _stage_and_write(self, view: memoryview, stage: mmap.mmap) -> None:
        while view:
            count = min(len(view), STAGE_BYTES - self._staged)
            stage[self._staged : self._staged + count] = view[:count]
            self._staged += count
            view = view[count:]
            whole = self._staged - self._staged % ALIGN
            if whole:
                self._write_direct(memoryview(stage)[:whole])
                # The unaligned rest moves to the front, for the next write.
                stage.move(0, whole, self._staged - whole)
                self._staged -= whole

    def _write_direct(self, block: memoryview) -> None:
        try:
            written = os.write(self.fd, block)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            written = 0  # accepted at open, refused at write (some FUSE filesystems)
        if written != len(block):  # a short or refused direct write: the page cache from here
            self._fall_back()
            self._write_all(block[written:])

    def _fall_back(self) -> None:
        logger.debug("cache: direct writes refused; writing through the page cache")
        _set_direct(self.fd, False)
        # The stage stays: its unaligned rest is written by finish().

    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self.fd, view[:PAGE_CACHE_WRITE]) :]

    def finish(self) -> None:
        """Write what waits in the buffer (through the page cache: it is not aligned)."""
        if self._stage is None or not self._staged:
            return
        _set_direct(self.fd, False)
        staged, self._staged = self._staged, 0
        self._write_all(memoryview(self._stage)[:staged])

    def release(self) -> None:
        """Give the buffer back (the file is finished or dropped); the fd stays open."""
        stage, self._stage = self._stage, None
        if stage is not None:
            _give_stage(stage)


#: One ``posix_fadvise`` reads at most the larger of the device's read-ahead window and its
#: largest request (128 KiB each by default): a longer range is asked for in steps this long.
_ADVISE_STEP = 128 << 10


def read_ahead(fd: int, size: int) -> None:
    """Ask the kernel to read the file open at ``fd`` (``size`` bytes) into the page cache,
    in the background (the disk fills those pages; no copy by this process): the slices a
    reader takes of a cache entry written past the page cache then wait for the disk less.
    About 8 ms for 420 MB already in the page cache. Best effort."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        for offset in range(0, size, _ADVISE_STEP):
            advise(fd, offset, _ADVISE_STEP, os.POSIX_FADV_WILLNEED)
    except OSError as exc:
        logger.debug("cache: read-ahead not started (%s)", exc)
