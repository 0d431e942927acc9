"""Per-process values: state that each process (a forked DataLoader worker above all) must
build afresh, such as I/O and cache counters, open files and fsspec filesystems. The one
fork-reset scheme of the package."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerProcess"]

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
