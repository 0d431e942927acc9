"""A faster way home for DataLoader workers' batches: the result pipe of the loaders'
multiprocessing iterators is widened, and its messages are read straight into one buffer.

A worker's batch reaches the training process as one pickled message on a pipe. Python's
``multiprocessing`` reads such a message in pieces of at most the pipe's size (64 KiB by
default), allocating a new ``bytes`` of the whole remaining size for every piece and copying
each piece again into an ``io.BytesIO``; the worker blocks whenever the 64 KiB are full. For
batches of raw samples (32 x 20 KiB: 640 KiB a message) that made the parent's receiving the
limit of a warm epoch with workers. Here the pipe holds up to 1 MiB (``F_SETPIPE_SZ``, Linux's
default ceiling for unprivileged processes), so a message usually crosses in one write and one
read, and the parent reads each message once, into a buffer of its size, with ``readv``.

``WebLoader`` and ``StatefulLoader`` do this for every iterator they make. So that programs
written for webdataset's plain ``torch.utils.data.DataLoader`` get it too, importing the modules
of cloudshards' datasets (to make one, or to unpickle one) wraps ``DataLoader._get_iterator``
once (:func:`serve_plain_dataloaders`): the wrapper does it for loaders whose dataset is a
cloudshards one and leaves every other DataLoader exactly as it was.
``CLOUDSHARDS_FAST_PIPE=0`` turns all of this off.

Hand-written because no library replaces multiprocessing's pipe reader: it is the one private
seam (``Queue._recv_bytes``, the bound ``Connection.recv_bytes`` every CPython since 3.3 calls
in ``Queue.get``) that a loader can reach without replacing torch's worker machinery. Where
that seam or the pipe is not what is expected (another platform, another queue), nothing
changes.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from cloudshards.dist import one_reader_for_all_ranks

__all__ = ["serve_plain_dataloaders", "speed_up_result_pipe"]

logger = logging.getLogger(__name__)

#: The pipe size asked for: Linux's default /proc/sys/fs/pipe-max-size.
PIPE_BYTES = 1 << 20


def speed_up_result_pipe(iterator: Any) -> bool:
    """Widen the result pipe of a DataLoader's multiprocessing ``iterator`` and read its
    messages directly; True where it did (a POSIX pipe behind a ``multiprocessing.Queue``).

    Safe at any time, workers running or not: the pipe's size is the kernel object's, and
    ``Queue.get`` looks the reader up at each call, so a ``get`` under way finishes its message
    with the reader it began with, and each reader reads whole messages."""
    queue = getattr(iterator, "_worker_result_queue", None)
    reader = getattr(queue, "_reader", None)
    if queue is None or reader is None or sys.platform == "win32":
        return False
    recv = getattr(queue, "_recv_bytes", None)
    if not callable(recv):
        return False  # not the multiprocessing.Queue whose seam this module knows
    if getattr(recv, "_cloudshards", False):
        return True  # done already (a loader of ours over the wrapped DataLoader)
    from cloudshards.config import env_bool

    if not env_bool("FAST_PIPE", True):
        return False
    try:
        fd = reader.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    if sys.platform.startswith("linux"):
        _widen(fd)
    queue._recv_bytes = _message_reader(fd)
    return True


def _widen(fd: int) -> None:
    import fcntl

    try:
        if fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) < PIPE_BYTES:  # named on Linux from 3.10
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError as exc:  # EPERM past the user's pipe quota; EBUSY; not a pipe
        logger.debug("worker result pipe stays at its size: %s", exc)


def _message_reader(fd: int) -> Callable[[], bytearray]:
    """``Connection.recv_bytes`` for the pipe ``fd``: the same framing (a 4-byte big-endian
    size, or -1 and an 8-byte size past 2 GiB), the same errors (``EOFError`` where the end
    of file comes before a header or a body has begun, ``OSError`` within one), the message
    read into one buffer."""

    def fill(buffer: bytearray) -> bytearray:
        view = memoryview(buffer)
        done = 0
        while done < len(buffer):
            count = os.readv(fd, [view[done:]])
            if count == 0:
                if done == 0:
                    raise EOFError
                raise OSError("got end of file during message")
            done += count
        return buffer

    def recv_bytes() -> bytearray:
        (size,) = struct.unpack("!i", fill(bytearray(4)))
        if size == -1:
            (size,) = struct.unpack("!Q", fill(bytearray(8)))
        return fill(bytearray(max(size, 0)))  # a negative size reads nothing, as there

    recv_bytes._cloudshards = True  # type: ignore[attr-defined]
    return recv_bytes


_served = False
_serving_lock = threading.Lock()


def serve_plain_dataloaders() -> None:
    """Wrap ``torch.utils.data.DataLoader._get_iterator`` (once per process) so that an
    iterator with workers over a cloudshards dataset gets :func:`speed_up_result_pipe`.

    Called when the modules of cloudshards' datasets are imported, to make a dataset or to
    unpickle one (a spawned rank or worker that never makes one). A DataLoader over anything
    else is left as it was; a class that overrides ``_get_iterator`` (torchdata's
    StatefulDataLoader) is not reached (``wds.StatefulLoader`` does it itself)."""
    global _served
    if _served:
        return
    with _serving_lock:
        if _served:
            return
        _served = True
        from torch.utils.data import DataLoader

        original = DataLoader.__dict__.get("_get_iterator")
        if not callable(original):
            return

        @functools.wraps(original)
        def _get_iterator(self: Any) -> Any:
            ours = _is_ours(self.dataset)
            if ours:  # before its workers copy it
                one_reader_for_all_ranks(self.dataset, sys._getframe(1))
            iterator = original(self)
            if self.num_workers > 0 and ours:
                speed_up_result_pipe(iterator)
                if getattr(self.dataset, "__dict__", {}).get(_IN_WORKERS) is None:
                    self.dataset.__dict__[_IN_WORKERS] = True  # see warn_if_read_in_workers
            return iterator

        DataLoader._get_iterator = _get_iterator  # type: ignore[method-assign]


#: Set on a dataset a plain DataLoader's worker processes read (True; "told" once warned).
_IN_WORKERS = "_read_in_workers"


def warn_if_read_in_workers(dataset: Any) -> None:
    """Warn (once per dataset) that the ``state_dict()`` asked of ``dataset`` in the main
    process says nothing of its position: a plain DataLoader's workers read copies of it."""
    if dataset.__dict__.get(_IN_WORKERS) is True:
        dataset.__dict__[_IN_WORKERS] = "told"
        logger.warning(
            "state_dict() of a dataset that DataLoader worker processes read: it describes "
            "the start of an epoch, not what the workers delivered (a restore reads the "
            "epoch again). Save the loader's state instead: cloudshards.StatefulLoader, or "
            "torchdata's StatefulDataLoader (docs/distributed.md, 'Resuming training')"
        )


def _is_ours(dataset: Any) -> bool:
    for cls in type(dataset).__mro__:
        module = getattr(cls, "__module__", None)  # a class made by type() may have none
        if isinstance(module, str) and module.split(".")[0] == "cloudshards":
            return True
    return False
