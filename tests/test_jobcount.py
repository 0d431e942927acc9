"""Counting once per job: each node counts its part and takes the others' from the job's store
(a real TCPStore here, with "nodes" as threads)."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch.distributed

from cloudshards import jobcount

KEYS = [f"shard-{i}" for i in range(11)]
COUNTS = [100 + i for i in range(11)]


@pytest.fixture
def store() -> Any:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    master = torch.distributed.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10)
    )
    return master


def client(store: Any) -> Any:
    return torch.distributed.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


class Counter:
    """Counts by table lookup and remembers which shards it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, positions: Sequence[int]) -> list[int]:
        with self.lock:
            self.asked.extend(positions)
        return [COUNTS[i] for i in positions]


def test_each_node_counts_its_part_and_gets_the_rest(store: Any) -> None:
    nodes = 3
    counters = [Counter() for _ in range(nodes)]
    results: list[Any] = [None] * nodes

    def node(k: int) -> None:
        results[k] = jobcount.count_once_per_job(
            KEYS, counters[k], position=(k, nodes), store=client(store)
        )

    threads = [threading.Thread(target=node, args=(k,)) for k in range(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for k in range(nodes):
        counts, counted = results[k]
        assert counts == COUNTS
        assert sorted(counters[k].asked) == list(range(k, len(KEYS), nodes))
        assert counted == len(counters[k].asked)
    # The shards were counted once in the job: no node read another's part.
    assert sorted(i for c in counters for i in c.asked) == list(range(len(KEYS)))


def test_a_node_that_never_shares_is_counted_for_after_the_wait(
    store: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(jobcount, "WAIT_S", 0.3)
    counter = Counter()
    with caplog.at_level(logging.WARNING, logger="cloudshards.balance"):
        counts, counted = jobcount.count_once_per_job(
            KEYS, counter, position=(0, 2), store=client(store)
        )
    assert counts == COUNTS
    assert counted == len(KEYS)
    assert sorted(counter.asked) == list(range(len(KEYS)))
    assert "nodes [1] did not share their sample counts in time" in caplog.text


def test_counts_a_node_already_had_are_taken_without_counting(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobcount, "_shared", set())
    jobcount.share_counts(KEYS, COUNTS, client(store))  # node 1 read them from its counts file
    counter = Counter()
    counts, counted = jobcount.count_once_per_job(
        KEYS, counter, position=(0, 2), store=client(store)
    )
    assert (counts, counted, counter.asked) == (COUNTS, 0, [])
    # Another dataset's counts are its own.
    other = jobcount.count_once_per_job(KEYS[:3], counter, position=(0, 1), store=client(store))
    assert other == (COUNTS[:3], 3)


def test_without_a_job_this_node_counts_everything() -> None:
    counter = Counter()
    assert jobcount.count_once_per_job(KEYS, counter) == (COUNTS, len(KEYS))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"GROUP_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, (1, 2)),
        ({"GROUP_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, None),  # one node
        ({"SLURM_NODEID": "3", "SLURM_NNODES": "4"}, (3, 4)),
        ({"SLURM_NODEID": "x", "SLURM_NNODES": "4"}, None),
        ({}, None),
    ],
)
def test_node_position_from_the_launcher(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: Any
) -> None:
    for name in ("GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NODEID", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert jobcount.node_position() == expected
