"""PerProcess: the one fork-reset scheme (counters, open files, filesystems per process)."""

from __future__ import annotations

import os
import pickle
import threading
import weakref

from cloudshards.process import PerProcess


class Value:
    """A factory product that can be weakly referenced and counts its instances."""

    made = 0

    def __init__(self) -> None:
        Value.made += 1


def test_one_value_per_process_until_popped() -> None:
    values = PerProcess(Value)
    first = values.get()
    assert values.get() is first
    assert values.pop() is first
    assert values.pop() is None
    assert values.get() is not first


def test_a_pickled_instance_unpickles_empty() -> None:
    values = PerProcess(Value)
    made = values.get()
    copy = pickle.loads(pickle.dumps(values))
    assert isinstance(copy, PerProcess)
    assert copy.get() is not made


def test_a_forked_child_makes_its_own_value_and_keeps_its_parents() -> None:
    values = PerProcess(Value)
    lock = PerProcess(threading.Lock)
    parent = values.get()
    lock.get().acquire()  # held at fork: the child must get a free lock of its own
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the test framework
        try:
            inherited = weakref.ref(parent)
            del parent
            ok = values.get() is not inherited() and inherited() is not None
            ok = ok and lock.get().acquire(timeout=1)
            os.write(writer, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(writer)
    try:
        assert os.read(reader, 1) == b"1"
    finally:
        os.close(reader)
        os.waitpid(pid, 0)
        lock.get().release()
    assert values.get() is parent
