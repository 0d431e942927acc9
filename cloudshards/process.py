"""Per-process values: state that each process (a forked DataLoader worker above all) must
build afresh, such as I/O and cache counters, open files and fsspec filesystems. The one
fork-reset scheme of the package."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from cloudshards.workerpipe import speed_up_result_pipe

__all__ = [
    "PerProcess",
    "SettledFork",
    "freeze_inherited_objects",
    "frozen_for_fork",
    "in_dataloader_worker",
    "settle_queue_threads",
]

T = TypeVar("T")


class PerProcess(Generic[T]):
    """A value made by ``factory`` on first use in each process.

    A forked child never sees its parent's value: every instance is dropped right after a
    fork, and (for processes started otherwise, or values read across a fork by another
    thread) the process id is checked on each :meth:`get`. A parent's value stays referenced
    in the child, never finalized there: an fsspec filesystem, say, would close sessions of
    an event loop whose thread the child does not have. A pickled instance unpickles empty.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._pid = -1
        self._value: T | None = None
        self._lock = threading.Lock()
        _INSTANCES.add(self)

    def get(self) -> T:
        """This process's value (made now if it has none yet)."""
        value = self._value
        if value is None or self._pid != os.getpid():
            with self._lock:
                if self._value is None or self._pid != os.getpid():
                    _abandon(self._value)
                    self._value = self._factory()
                    self._pid = os.getpid()
                value = self._value
        return value

    def pop(self) -> T | None:
        """Forget this process's value and return it (None when it has none); the next
        :meth:`get` makes a new one."""
        with self._lock:
            value, pid = self._value, self._pid
            self._value, self._pid = None, -1
        if pid == os.getpid():
            return value
        _abandon(value)
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        # The value never crosses a pickle: the copy makes its own where it is used.
        return (PerProcess, (self._factory,))

    def _reset(self) -> None:
        _abandon(self._value)
        self._value = None
        self._pid = -1
        self._lock = threading.Lock()  # a lock held by another thread at fork stays held


_INSTANCES: weakref.WeakSet[PerProcess[Any]] = weakref.WeakSet()

#: Values a forked child inherited from its parent: kept, so the child never finalizes them.
_INHERITED: list[Any] = []


def _abandon(value: object) -> None:
    if value is not None:
        _INHERITED.append(value)


def _reset_after_fork() -> None:
    for instance in list(_INSTANCES):
        instance._reset()


os.register_at_fork(after_in_child=_reset_after_fork)


#: The process that last asked :func:`freeze_inherited_objects` (it acts once per process).
_FREEZE_ASKED_BY = -1


def in_dataloader_worker() -> bool:
    """Whether this process is a torch DataLoader worker (asked without importing torch)."""
    data = sys.modules.get("torch.utils.data")  # a worker has it: no import just to ask
    return data is not None and data.get_worker_info() is not None


def freeze_inherited_objects() -> None:
    """In a DataLoader worker, take every object it has so far (those inherited from the
    parent above all) out of the cyclic garbage collector's reach, with ``gc.freeze()``;
    once per process, the first time a cloudshards dataset is iterated there.

    A forked worker inherits the parent's whole heap (torch alone brings ~150,000 objects)
    with the parent's collector counters, which often call for a full collection soon: that
    collection walks every inherited object and writes into its header, copying each page
    of the parent's heap (copy-on-write). Measured here: one such collection per worker and
    epoch, 0.09 s each, a quarter of the CPU of a warm epoch with 2 workers. Frozen objects
    are still freed by reference counting; only reference cycles among them are never
    collected, in a process that lives for an epoch (or for the run, with persistent workers).
    Objects made after the freeze are collected as usual. Nothing happens outside a
    DataLoader worker, or with ``CLOUDSHARDS_GC_FREEZE=0``.
    """
    global _FREEZE_ASKED_BY
    pid = os.getpid()
    if pid == _FREEZE_ASKED_BY:
        return
    _FREEZE_ASKED_BY = pid
    if not in_dataloader_worker():
        return
    from cloudshards.config import env_bool

    if env_bool("GC_FREEZE", True):
        gc.freeze()


#: Longest wait for the threads the previous epoch's DataLoader iterator left ending.
SETTLE_TIMEOUT_S = 2.0
#: After they ended: time for their last teardown in C, which takes the interpreter's
#: thread-list lock after ``join()`` has already returned.
_SETTLE_PAUSE_S = 0.002


def settle_queue_threads(queues: list[Any]) -> None:
    """Wait (at most :data:`SETTLE_TIMEOUT_S`) for the feeder threads of the closed
    multiprocessing queues among ``queues`` to end: the queues of a DataLoader iterator that
    was shut down, whose threads end on their own, unjoined.

    Forking while another thread ends can hang the child for good: on CPython 3.8-3.11 before
    the fix for gh-112275 (3.11.7 among them; 3.12 is not affected) the child takes the
    interpreter's thread-list lock, inherited as the ending thread held it, before it resets
    it. Seen in CI: a 2-rank Lightning run whose next epoch's worker never returned from
    ``fork()`` (its rank waiting for it in the iterator's reset, the other rank in a
    collective), as the last epoch's index-queue threads were ending.
    """
    waited = False
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    for queue in queues:
        thread = getattr(queue, "_thread", None)
        if thread is None or not getattr(queue, "_closed", False):
            continue  # never fed, or still open (its iterator lives on): not ending
        thread.join(max(0.0, deadline - time.monotonic()))
        waited = True
    if waited:
        time.sleep(_SETTLE_PAUSE_S)


@contextlib.contextmanager
def frozen_for_fork(workers: int, context: Any = None) -> Iterator[None]:
    """Around the start of a DataLoader's forked workers: every object of the parent is
    frozen (``gc.freeze()``) while they fork, and unfrozen in the parent after. Python's own
    recipe for fork without exec: the workers start with the parent's heap out of their
    collector's reach, so no full collection walks it and copies its pages.
    :func:`freeze_inherited_objects` does the same from inside a worker, but only once a
    cloudshards dataset is iterated there, and a worker often ran its first full collection
    before (measured here: one per worker and epoch, 90 ms each, at every warm epoch with 2
    workers, a fifth of their CPU).

    Does nothing for start methods that do not fork, without workers, where the user froze
    objects already (unfreezing would undo theirs), or with ``CLOUDSHARDS_GC_FREEZE=0``. In
    the parent the unfreeze puts the young objects in the oldest generation: cycles among
    them wait for the next full collection.
    """
    if workers <= 0 or gc.get_freeze_count() or _start_method(context) != "fork":
        yield
        return
    from cloudshards.config import env_bool

    if not env_bool("GC_FREEZE", True):
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _start_method(context: Any) -> str | None:
    if context is None:
        # Without fixing the default as get_context() would (a later set_start_method
        # would then fail): the first of get_all_start_methods() is the default.
        return (
            multiprocessing.get_start_method(allow_none=True)
            or (multiprocessing.get_all_start_methods()[0])
        )
    if isinstance(context, str):
        return context
    method = getattr(context, "get_start_method", None)
    return method() if callable(method) else None


class SettledFork:
    """A mixin for torch DataLoaders: an iterator forks its workers once the threads the
    previous one left ending have ended (:func:`settle_queue_threads`), with the parent's
    objects frozen (:func:`frozen_for_fork`)."""

    num_workers: int
    multiprocessing_context: Any

    def _get_iterator(self) -> Any:
        settle_queue_threads(self.__dict__.pop("_previous_queues", []))
        with frozen_for_fork(self.num_workers, self.multiprocessing_context):
            iterator = super()._get_iterator()  # type: ignore[misc]
        if self.num_workers > 0:
            speed_up_result_pipe(iterator)
            # The index queues, and the result queue (fed here when pin_memory's thread is
            # told to stop): the queues with feeder threads in this process.
            queues = [*getattr(iterator, "_index_queues", [])]
            queues.append(getattr(iterator, "_worker_result_queue", None))
            self.__dict__["_previous_queues"] = queues
        return iterator

    def __getstate__(self) -> dict[str, Any]:
        # The last iterator's queues belong to this process (and cannot be pickled): a copy
        # (pickle, copy.deepcopy, a spawned worker's) starts without them, as a new loader.
        state = dict(self.__dict__)
        state.pop("_previous_queues", None)
        return state
