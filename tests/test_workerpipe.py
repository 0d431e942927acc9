"""The loaders' worker result pipe: widened, and read one message at a time into one buffer,
with multiprocessing's framing and errors."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import pickle
import struct
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import cloudshards as wds
from cloudshards.workerpipe import PIPE_BYTES, speed_up_result_pipe

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ")


class _Iterator:
    """Stands for a DataLoader's multiprocessing iterator: what the function reads of one."""

    def __init__(self, queue: Any) -> None:
        self._worker_result_queue = queue


def _sped_up_queue() -> Any:
    queue = multiprocessing.get_context("fork").Queue()
    assert speed_up_result_pipe(_Iterator(queue))
    return queue


def _put_from_child(queue: Any, items: list[Any]) -> None:
    process = multiprocessing.get_context("fork").Process(target=_put_all, args=(queue, items))
    process.start()
    received = [queue.get(timeout=30) for _ in items]
    process.join(30)
    assert received == items


def _put_all(queue: Any, items: list[Any]) -> None:
    for item in items:
        queue.put(item)
    queue.close()
    queue.join_thread()


@pytest.mark.parametrize("size", [0, 1, 65_535, 65_536, 65_537, PIPE_BYTES + 17, 3 << 20])
def test_messages_of_every_size_cross_whole(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    _put_from_child(_sped_up_queue(), [payload, {"key": "a", "bin": payload}, [payload] * 3])


@linux_only
def test_the_pipe_is_widened() -> None:
    queue = _sped_up_queue()
    assert fcntl.fcntl(queue._reader.fileno(), fcntl.F_GETPIPE_SZ) >= PIPE_BYTES


def test_a_message_past_2_gib_keeps_its_framing() -> None:
    """multiprocessing frames messages past 2 GiB as -1 and an 8-byte size; checked on a small
    payload framed that way (the reader cannot tell the difference)."""
    queue = _sped_up_queue()
    body = b"payload"
    os.write(queue._writer.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body)
    assert bytes(queue._recv_bytes()) == body


def test_end_of_file_at_a_message_start_is_eof_and_within_one_an_oserror() -> None:
    queue = _sped_up_queue()
    queue._writer.close()
    with pytest.raises(EOFError):
        queue._recv_bytes()
    queue = _sped_up_queue()
    os.write(queue._writer.fileno(), struct.pack("!i", 10) + b"short")
    queue._writer.close()
    with pytest.raises(OSError, match="end of file during message"):
        queue._recv_bytes()
    queue = _sped_up_queue()  # a whole header, then nothing: as multiprocessing says, EOF
    os.write(queue._writer.fileno(), struct.pack("!i", 10))
    queue._writer.close()
    with pytest.raises(EOFError):
        queue._recv_bytes()


def test_anything_but_a_multiprocessing_queue_is_left_alone() -> None:
    assert not speed_up_result_pipe(object())
    assert not speed_up_result_pipe(_Iterator(None))
    assert not speed_up_result_pipe(_Iterator(object()))


class _Numbers(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        start = info.id if info is not None else 0
        step = info.num_workers if info is not None else 1
        for i in range(start, 64, step):
            yield {"i": i, "blob": bytes([i % 256]) * 200_000}


def test_a_webloader_with_workers_gets_every_batch_whole() -> None:
    loader = wds.WebLoader(_Numbers(), batch_size=4, num_workers=2)
    for _ in range(2):  # a second epoch gets a new iterator, sped up too
        batches = list(loader)
        assert sorted(int(i) for b in batches for i in b["i"]) == list(range(64))
        assert all(
            blob == bytes([int(i) % 256]) * 200_000
            for b in batches
            for i, blob in zip(b["i"], b["blob"], strict=True)
        )


def test_a_loader_iterated_with_workers_still_pickles_and_copies() -> None:
    """A loader keeps its last iterator's queues (to let their threads end before the next
    fork): they belong to this process, and a copy (pickle, deepcopy) goes without them,
    as webdataset's WebLoader copies after an epoch."""
    import copy

    # (torchdata's StatefulDataLoader keeps its iterator and a sampler generator: it cannot
    # be copied after an epoch whatever cloudshards does.)
    loader = wds.WebLoader(_Numbers(), batch_size=4, num_workers=2)
    assert len(list(loader)) == 16
    for clone in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert len(list(clone)) == 16
    assert len(list(loader)) == 16  # the original too, after its copies


@linux_only
def test_the_loaders_widen_their_pipes_and_plain_dataloaders_keep_theirs() -> None:
    sizes = {}
    for name, loader in {
        "web": wds.WebLoader(_Numbers(), batch_size=4, num_workers=1).pipeline[0],
        "stateful": wds.StatefulLoader(_Numbers(), batch_size=4, num_workers=1),
        "plain": DataLoader(_Numbers(), batch_size=4, num_workers=1),
    }.items():
        iterator = iter(loader)
        fd = iterator._worker_result_queue._reader.fileno()
        sizes[name] = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        assert len(list(iterator)) == 16
    assert sizes["web"] >= PIPE_BYTES
    assert sizes["stateful"] >= PIPE_BYTES
    assert sizes["plain"] < PIPE_BYTES


def _pipe_size(loader: Any) -> int:
    iterator = iter(loader)
    size = fcntl.fcntl(iterator._worker_result_queue._reader.fileno(), fcntl.F_GETPIPE_SZ)
    list(iterator)
    return int(size)


@linux_only
def test_a_plain_dataloader_over_a_cloudshards_dataset_is_sped_up_too(make_shards: Any) -> None:
    """Programs written for webdataset hand its dataset to torch's own DataLoader."""
    shards = make_shards([3, 3])
    dataset = wds.WebDataset(shards.spec(), shardshuffle=False).to_tuple("__key__", "bin")
    loader = DataLoader(dataset, batch_size=2, num_workers=2)
    assert _pipe_size(loader) >= PIPE_BYTES
    keys = sorted(
        key for batch in DataLoader(dataset, batch_size=2, num_workers=2) for key in batch[0]
    )
    assert keys == sorted(shards.keys)
    assert _pipe_size(DataLoader(_Numbers(), batch_size=4, num_workers=1)) < PIPE_BYTES


@linux_only
def test_fast_pipe_0_leaves_every_loader_as_torch_made_it(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_FAST_PIPE", "0")
    shards = make_shards([2])
    dataset = wds.WebDataset(shards.spec(), shardshuffle=False)
    assert _pipe_size(DataLoader(dataset, batch_size=None, num_workers=1)) < PIPE_BYTES
    assert (
        _pipe_size(wds.WebLoader(dataset, batch_size=None, num_workers=1).pipeline[0]) < PIPE_BYTES
    )
    queue = multiprocessing.get_context("fork").Queue()
    assert not speed_up_result_pipe(_Iterator(queue))


class _Nameless(IterableDataset):  # type: ignore[type-arg]
    """A dataset class whose module is unknown (as for one made by type() in exec)."""

    def __iter__(self) -> Any:
        return iter(range(4))


_Nameless.__module__ = None  # type: ignore[assignment]


def test_datasets_of_classes_without_a_module_load_as_before(make_shards: Any) -> None:
    wds.WebDataset(make_shards([1]).spec(), shardshuffle=False)  # the wrapper is in place
    loader = DataLoader(_Nameless(), batch_size=2, num_workers=1)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]


_UNPICKLE_AND_LOAD = """
import fcntl, pickle, sys
from torch.utils.data import DataLoader
dataset = pickle.loads(sys.stdin.buffer.read())
iterator = iter(DataLoader(dataset, batch_size=None, num_workers=1))
reader = iterator._worker_result_queue._reader
print(fcntl.fcntl(reader.fileno(), fcntl.F_GETPIPE_SZ), len(list(iterator)))
"""


@linux_only
def test_a_process_that_only_unpickles_a_dataset_is_sped_up_too(make_shards: Any) -> None:
    """A spawned rank gets its dataset pickled: it never makes one, nor imports cloudshards."""
    shards = make_shards([2, 1])
    dataset = wds.WebDataset(shards.spec(), shardshuffle=False)
    done = subprocess.run(
        [sys.executable, "-c", _UNPICKLE_AND_LOAD],
        input=pickle.dumps(dataset),
        capture_output=True,
        check=True,
        timeout=120,
    )
    pipe_bytes, samples = map(int, done.stdout.split())
    assert pipe_bytes >= PIPE_BYTES
    assert samples == 3
