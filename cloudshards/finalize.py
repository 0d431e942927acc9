"""Closing what an abandoned reader holds when the garbage collector finalizes it.

A loop that raises, caught by the program, leaves its iterator in a reference cycle (through
the traceback's frames). Python's cyclic garbage collector finalizes it later, in whatever
thread happens to allocate at that moment, wherever that thread is: inside
``ThreadPoolExecutor.submit`` holding the executor's locks, inside a counter's lock, or in one
of the prefetcher's own pool threads. Closing a remote reader there (shutting its pool down,
joining its threads, closing streams that cancel or fetch their rest) could wait forever for
threads that need those very locks, or try to join the current thread.

So while a collection runs, each such close runs on a short-lived thread of its own, outside
any lock the collecting thread holds. Everywhere else (the end of an epoch, a ``break``,
``close()``) they run at once, as before. Written here because neither the standard library
nor a library we use offers a deferred close for generator finalizers.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["close_safely"]

logger = logging.getLogger(__name__)

_collections = 0  # garbage collections under way (never two at once: one thread collects)


def _phase(phase: str, info: dict[str, Any]) -> None:
    global _collections
    _collections = _collections + 1 if phase == "start" else max(0, _collections - 1)


gc.callbacks.append(_phase)


def close_safely(close: Callable[[], object]) -> None:
    """Run ``close`` now; during a garbage collection, on a thread of its own instead (see
    the module doc), which ends when ``close`` returns."""
    if sys.is_finalizing():
        # The interpreter is going away (a reader left open in a global, or its last
        # collections): a new thread would never run, and start() would wait for it forever;
        # modules are being torn down (a close importing one fails), daemon threads cannot
        # be joined. The process's end closes what it held (the kernel drops a cache's locks;
        # its partial files are cleaned up later).
        return
    if not _collections:
        close()
        return
    thread = threading.Thread(target=_quietly, args=(close,), name="cloudshards-close")
    thread.daemon = True
    thread.start()


def _quietly(close: Callable[[], object]) -> None:
    try:
        close()
    except Exception as exc:  # an abandoned reader: nobody is left to tell
        logger.debug("closing an abandoned reader: %s", exc)


def _forget_in_child() -> None:
    global _collections
    _collections = 0


os.register_at_fork(after_in_child=_forget_in_child)
