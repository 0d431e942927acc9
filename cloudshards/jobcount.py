"""A counting pass once per job, split over its nodes.

Balanced epochs need each shard's sample count. When neither an index, nor metadata beside the
shards, nor the node's counts file has them, and the loader cannot run a count-free first
epoch (a plain ``torch.utils.data.DataLoader``), one process per node counts. Alone, each node
would read the whole dataset before its first sample: 16 nodes, 16 times the egress. Within a
multi-node job whose rendezvous store is reachable, node ``k`` of ``N`` counts only the shards
``k, k+N, ...``, publishes its counts in the store, and takes the other nodes' parts from it:
the job reads the dataset once, each node ``1/N`` of it. The full counts are published too, so
a node that had them already (its counts file) hands them to the others. A part that does not
arrive within :data:`WAIT_S` (plus the time the node's own part took) is counted by the
waiting node itself, so a node that never counts cannot hang the others.

The node's position: torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (or ``WORLD_SIZE /
LOCAL_WORLD_SIZE``), else SLURM's ``SLURM_NODEID`` and ``SLURM_NNODES``. The store: a client
of the one at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent store; with
``init_process_group("env://")`` rank 0's). Keys are a hash of the shard keys: no URL or
credential is written to the store.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cloudshards.listing import job_id

__all__ = ["WAIT_S", "count_once_per_job", "node_position", "share_counts"]

logger = logging.getLogger("cloudshards.balance")

#: Longest wait, beyond this node's own counting time, for another node's part.
WAIT_S = 60.0
_POLL_S = 0.2
_shared: set[str] = set()  # digests this process has published in full
_shared_lock = threading.Lock()

#: Counts the shards at the given positions of the list; returns their counts in order.
CountSome = Callable[[Sequence[int]], list[int]]


def node_position() -> tuple[int, int] | None:
    """``(node, nodes)`` of this process in a multi-node job, or None."""
    env = os.environ
    try:
        if env.get("GROUP_RANK") and env.get("GROUP_WORLD_SIZE"):  # torchrun
            node, nodes = int(env["GROUP_RANK"]), int(env["GROUP_WORLD_SIZE"])
        elif env.get("GROUP_RANK") and env.get("WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
            nodes = int(env["WORLD_SIZE"]) // max(int(env["LOCAL_WORLD_SIZE"]), 1)
            node = int(env["GROUP_RANK"])
        elif env.get("SLURM_NODEID") and env.get("SLURM_NNODES"):
            node, nodes = int(env["SLURM_NODEID"]), int(env["SLURM_NNODES"])
        else:
            return None
    except ValueError:
        return None
    return (node, nodes) if nodes > 1 and 0 <= node < nodes else None


def _client(timeout_s: float = 30.0) -> Any:
    """A client of the job's rendezvous store, or None when there is none to reach."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        import torch.distributed

        return torch.distributed.TCPStore(  # type: ignore[attr-defined]
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except Exception as exc:  # unreachable, refused, or no c10d in this torch
        logger.info("no rendezvous store to share sample counts through: %s", exc)
        return None


def _prefix(keys: Sequence[str]) -> str:
    digest = hashlib.blake2b(json.dumps(list(keys)).encode(), digest_size=16).hexdigest()
    return f"cloudshards/counts/{digest}"


def _parts_prefix(keys: Sequence[str], nodes: int) -> str:
    """Where this attempt's per-node parts go: a restarted (or resized) job's nodes never take
    a part an earlier attempt left, which another split of the shards made."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{_prefix(keys)}/{nodes}-nodes/attempt-{attempt}"


def share_counts(
    keys: Sequence[str],
    counts: Sequence[int],
    store: Any = None,
    *,
    marker: Path | None = None,
) -> None:
    """Publish counts this node found, for other nodes still counting: once per process, and
    with ``marker`` (a path beside the node's counts file) once per node and job."""
    if node_position() is None and store is None:
        return
    prefix = _prefix(keys)
    with _shared_lock:
        if prefix in _shared:
            return
        _shared.add(prefix)
    if marker is not None:
        job = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}:{job_id()}"
        tag = hashlib.blake2b(job.encode(), digest_size=8).hexdigest()
        try:  # the node's first process this job creates it; the others have nothing to do
            os.close(os.open(f"{marker}.shared-{tag}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except OSError:
            return
    store = store if store is not None else _client(timeout_s=5.0)
    if store is not None:
        try:
            store.set(f"{prefix}/all", json.dumps([int(n) for n in counts]))
        except RuntimeError as exc:  # the store went away: the others count for themselves
            logger.info("could not share sample counts: %s", exc)


def count_once_per_job(
    keys: Sequence[str],
    count_some: CountSome,
    *,
    position: tuple[int, int] | None = None,
    store: Any = None,
) -> tuple[list[int], int]:
    """Every shard's count, this node counting its part; returns ``(counts, shards counted
    here)``. Without a multi-node job or a store, this node counts them all."""
    position = position or node_position()
    if position is not None and store is None:
        store = _client()
    if position is None or store is None:
        return count_some(range(len(keys))), len(keys)
    node, nodes = position
    prefix = _prefix(keys)
    full = _get(store, f"{prefix}/all")
    if full is not None and len(full) == len(keys):
        return full, 0
    parts = _parts_prefix(keys, nodes)
    mine = list(range(node, len(keys), nodes))
    began = time.monotonic()
    result: list[int | None] = [None] * len(keys)
    for index, count in zip(mine, count_some(mine), strict=True):
        result[index] = count
    try:
        store.set(f"{parts}/{node}", json.dumps([result[i] for i in mine]))
    except RuntimeError as exc:  # the store went away: the others count this part themselves
        logger.info("could not share sample counts: %s", exc)
    counted = len(mine)
    waiting = set(range(nodes)) - {node}
    deadline = time.monotonic() + WAIT_S + (time.monotonic() - began)
    while waiting and time.monotonic() < deadline:
        full = _get(store, f"{prefix}/all")
        if full is not None and len(full) == len(keys):
            return full, counted
        for other in sorted(waiting):
            positions = range(other, len(keys), nodes)
            part = _get(store, f"{parts}/{other}")
            if part is not None and len(part) == len(positions):
                for index, count in zip(positions, part, strict=True):
                    result[index] = count
                waiting.discard(other)
        if waiting:
            time.sleep(_POLL_S)
    if waiting:
        missing = [index for index, count in enumerate(result) if count is None]
        logger.warning(
            "nodes %s did not share their sample counts in time: counting their %d shards here",
            sorted(waiting),
            len(missing),
        )
        for index, count in zip(missing, count_some(missing), strict=True):
            result[index] = count
        counted += len(missing)
    counts = [int(count) for count in result if count is not None]
    share_counts(keys, counts, store)
    return counts, counted


def _get(store: Any, key: str) -> list[int] | None:
    """The JSON list under ``key``, or None while it is not there (or is not a list)."""
    try:
        if not store.check([key]):
            return None
        value = json.loads(store.get(key))
    except (RuntimeError, ValueError):
        return None
    if isinstance(value, list) and all(isinstance(n, int) for n in value):
        return value
    return None
