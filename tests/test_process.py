"""PerProcess: the one fork-reset scheme (counters, open files, filesystems per process)."""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

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


def _freeze_count_after_reading(batch: list[object]) -> list[int]:
    import gc

    return [gc.get_freeze_count()]


def _worker_freeze_counts(urls: list[str], workers: int) -> Any:
    import gc

    import cloudshards as wds

    dataset = wds.WebDataset(urls, shardshuffle=False)
    loader = wds.WebLoader(
        dataset, batch_size=2, num_workers=workers, collate_fn=_freeze_count_after_reading
    )
    return [count for batch in loader for count in batch], gc.get_freeze_count()


@pytest.mark.parametrize("setting", [None, "0"], ids=["default", "turned-off"])
def test_dataloader_workers_freeze_what_they_inherited(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    """A worker's first iteration freezes the objects it inherited from the parent (no full
    collection then walks, and copies, the parent's heap); the parent's own collector and a
    process without workers are left alone; CLOUDSHARDS_GC_FREEZE=0 turns it off."""
    import gc

    if setting is None:
        monkeypatch.delenv("CLOUDSHARDS_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("CLOUDSHARDS_GC_FREEZE", setting)
    shards = make_shards([4, 4])
    urls = [str(p) for p in shards.paths]
    before = gc.get_freeze_count()
    in_workers, in_parent = _worker_freeze_counts(urls, 2)
    assert len(in_workers) == 4  # one count per batch of 2, 8 samples
    assert in_parent == before
    if setting is None:
        assert all(count > 1000 for count in in_workers)
    else:
        assert in_workers == [before] * 4
    in_process, _ = _worker_freeze_counts(urls, 0)
    assert in_process == [before] * 4  # no worker: nothing frozen


#: While a test records: the feeder threads alive at each fork of this process.
_FEEDERS_AT_FORK: list[list[int]] = []
_RECORDING: list[bool] = []


def _record_feeders_at_fork() -> None:
    if _RECORDING:
        _FEEDERS_AT_FORK.append(
            [t.ident or 0 for t in threading.enumerate() if t.name == "QueueFeederThread"]
        )


os.register_at_fork(before=_record_feeders_at_fork)


class _Numbers(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        yield from range(info.id if info else 0, 8, info.num_workers if info else 1)


@pytest.mark.parametrize("loader_class", ["WebLoader", "StatefulLoader"])
def test_next_epochs_workers_fork_after_the_last_epochs_threads_ended(
    monkeypatch: pytest.MonkeyPatch, loader_class: str
) -> None:
    """A forked child can hang for good if another thread was ending as it forked (CPython
    3.8-3.11 before the fix for gh-112275): cloudshards' loaders fork an epoch's workers only
    after the index-queue threads of the last epoch's iterator (closed at its end, never
    joined by torch) have ended. Here they take 0.5 s to end."""
    import multiprocessing.queues

    import cloudshards as wds

    feed = multiprocessing.queues.Queue._feed

    def slow_feed(*args: Any) -> None:
        feed(*args)
        time.sleep(0.5)  # a thread that ends late (a loaded machine)

    monkeypatch.setattr(multiprocessing.queues.Queue, "_feed", staticmethod(slow_feed))
    loader = getattr(wds, loader_class)(_Numbers(), batch_size=None, num_workers=2)
    assert sorted(loader) == list(range(8))
    _FEEDERS_AT_FORK.clear()
    _RECORDING.append(True)
    try:
        assert sorted(loader) == list(range(8))
    finally:
        _RECORDING.clear()
    assert len(_FEEDERS_AT_FORK) == 2  # the second epoch's two workers
    assert _FEEDERS_AT_FORK == [[], []]  # no thread of the first epoch was still ending


class _FreezeCount(IterableDataset):  # type: ignore[type-arg]
    """A plain torch dataset (nothing of cloudshards freezes in it) that yields the count of
    frozen objects as its worker starts."""

    def __iter__(self) -> Any:
        import gc

        yield gc.get_freeze_count()


def _counts(loader: Any) -> tuple[list[int], list[int]]:
    """What each worker saw as it started, and the parent's count while it read."""
    import gc

    seen, parent = [], []
    for count in loader:
        seen.append(int(count))
        parent.append(gc.get_freeze_count())
    return seen, parent


@pytest.mark.parametrize("loader_class", ["WebLoader", "StatefulLoader"])
def test_workers_fork_with_the_parents_objects_frozen(
    monkeypatch: pytest.MonkeyPatch, loader_class: str
) -> None:
    """cloudshards' loaders fork their workers with the parent's objects frozen (Python's
    recipe for fork without exec), so a worker starts with no full collection to run over the
    parent's heap, whatever dataset it reads; the parent unfreezes at once."""
    import gc

    import cloudshards as wds

    monkeypatch.delenv("CLOUDSHARDS_GC_FREEZE", raising=False)
    before = gc.get_freeze_count()
    make = getattr(wds, loader_class)
    seen, parent = _counts(make(_FreezeCount(), batch_size=None, num_workers=2))
    assert len(seen) == 2
    assert all(count > 1000 for count in seen), seen
    assert parent == [before] * 2
    assert gc.get_freeze_count() == before
    # torch's own DataLoader does not: the workers start with nothing frozen.
    seen, _ = _counts(DataLoader(_FreezeCount(), batch_size=None, num_workers=2))
    assert seen == [before] * 2


class _Collector:
    """The gc functions frozen_for_fork uses, on a count of its own: the real freeze count is
    the whole process's, which other threads' loaders (left by other tests) may change."""

    def __init__(self, frozen: int = 0) -> None:
        self.frozen = frozen
        self.calls: list[str] = []

    def get_freeze_count(self) -> int:
        return self.frozen

    def freeze(self) -> None:
        self.calls.append("freeze")
        self.frozen += 5000

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")
        self.frozen = 0


def test_freezing_for_fork_leaves_what_the_user_froze_and_other_start_methods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cloudshards.process as process

    monkeypatch.delenv("CLOUDSHARDS_GC_FREEZE", raising=False)
    collector = _Collector()
    monkeypatch.setattr(process, "gc", collector)
    with process.frozen_for_fork(2, "spawn"):
        assert collector.frozen == 0  # a spawned worker inherits no heap
    with process.frozen_for_fork(0):
        assert collector.frozen == 0  # no workers
    assert collector.calls == []
    with process.frozen_for_fork(2, "fork"):
        assert collector.frozen == 5000
    assert collector.calls == ["freeze", "unfreeze"]
    assert collector.frozen == 0
    theirs = _Collector(frozen=123)  # the user's own freeze: kept as it is
    monkeypatch.setattr(process, "gc", theirs)
    with process.frozen_for_fork(2, "fork"):
        pass
    assert (theirs.frozen, theirs.calls) == (123, [])
    switched_off = _Collector()
    monkeypatch.setattr(process, "gc", switched_off)
    monkeypatch.setenv("CLOUDSHARDS_GC_FREEZE", "0")
    with process.frozen_for_fork(2, "fork"):
        pass
    assert switched_off.calls == []


def test_freezing_for_fork_leaves_the_start_method_to_the_program() -> None:
    """Asking which start method the workers use does not fix the default: the program can
    still choose one afterwards (set_start_method raises once the default is fixed)."""
    import subprocess
    import sys

    code = (
        "import multiprocessing\n"
        "from cloudshards.process import frozen_for_fork\n"
        "with frozen_for_fork(2):\n"
        "    pass\n"
        "assert multiprocessing.get_start_method(allow_none=True) is None\n"
        "multiprocessing.set_start_method('spawn')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
