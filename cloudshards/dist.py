"""Who am I: rank, world size, local rank and DataLoader worker of the current process.

The only reader of torch.distributed, torchrun's and SLURM's variables and DataLoader worker info.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = [
    "WorkerInfo",
    "check_same_length",
    "derive_seed",
    "pytorch_worker_info",
    "pytorch_worker_seed",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Position of this process in the job.

    Attributes:
        rank: Global rank (0 when not distributed).
        world_size: Number of ranks.
        local_rank: Rank within the node.
        worker: DataLoader worker id within this rank (0 in the main process).
        num_workers: DataLoader workers of this rank (1 in the main process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    worker: int = 0
    num_workers: int = 1

    @classmethod
    def detect(cls, group: Any = None) -> WorkerInfo:
        """Detect rank and worker: torch.distributed when initialised, else torchrun's
        ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, else SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``;
        the worker from ``torch.utils.data.get_worker_info()``, else webdataset's
        ``WORKER``/``NUM_WORKERS`` variables."""
        rank, world_size = _detect_rank(group)
        local_rank = _env_int("LOCAL_RANK", _env_int("SLURM_LOCALID", 0))
        worker, num_workers = _detect_worker()
        return cls(rank, world_size, local_rank, worker, num_workers)

    @property
    def global_worker(self) -> int:
        """Index of this worker among all ``world_size * num_workers`` consumers."""
        return self.rank * self.num_workers + self.worker

    @property
    def num_consumers(self) -> int:
        """Total number of data consumers (ranks x workers)."""
        return self.world_size * self.num_workers


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        return default


def _detect_rank(group: Any) -> tuple[int, int]:
    try:
        import torch.distributed as torch_dist

        if torch_dist.is_available() and torch_dist.is_initialized():
            group = group if group is not None else torch_dist.group.WORLD
            return torch_dist.get_rank(group=group), torch_dist.get_world_size(group=group)
    except ImportError:
        pass
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return _env_int("SLURM_PROCID", 0), _env_int("SLURM_NTASKS", 1)
    return 0, 1


def _detect_worker() -> tuple[int, int]:
    try:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        if info is not None:
            return info.id, info.num_workers
    except ImportError:
        pass
    if "WORKER" in os.environ and "NUM_WORKERS" in os.environ:
        return _env_int("WORKER", 0), _env_int("NUM_WORKERS", 1)
    return 0, 1


def check_ranks(rank: int | None, world_size: int | None) -> tuple[int, int] | None:
    """A (rank, world_size) given to a pipeline, checked; None when neither is given.

    Raises:
        ConfigError: Only one of them is given, or the rank is out of range.
    """
    if rank is None and world_size is None:
        return None
    if rank is None or world_size is None or not 0 <= rank < world_size:
        from cloudshards.errors import ConfigError

        raise ConfigError(
            f"rank={rank}, world_size={world_size}: give both, with 0 <= rank < world_size"
        )
    return rank, world_size


#: Hugging Face Accelerate's loaders that divide one reader's stream among the ranks: its
#: DataLoaderDispatcher (rank 0 reads each batch, every rank gets its part) and its
#: IterableDatasetShard (every rank reads the whole stream and keeps its part).
_ONE_STREAM_FOR_ALL = frozenset({"DataLoaderDispatcher", "IterableDatasetShard"})


def one_reader_for_all_ranks(dataset: Any, frame: FrameType | None = None) -> bool:
    """Have ``dataset`` read every rank's samples (``rank=0, world_size=1``) when Accelerate's
    loader that iterates it (found among the callers of ``frame``, default the caller's)
    divides them among the ranks itself: split by rank too, each epoch trained on
    1/world_size of the data, without a word. A rank or world size given is kept.

    Returns:
        False where the dataset must read nothing: a rank other than 0 under Accelerate's
        DataLoaderDispatcher, whose DataLoader workers start (and would read) though only
        rank 0's loader is read.
    """
    if dataset.__dict__.get("_dispatched_elsewhere"):
        return False
    if "accelerate" not in sys.modules or getattr(dataset, "_ranks", 0) is not None:
        return True
    frame = frame or sys._getframe(1)
    for _ in range(64):  # the loader's own frame is a few calls up
        if frame is None:
            return True
        kind = type(frame.f_locals.get("self"))
        if kind.__name__ in _ONE_STREAM_FOR_ALL and kind.__module__.startswith("accelerate"):
            dataset._ranks = (0, 1)
            if kind.__name__ == "DataLoaderDispatcher" and WorkerInfo.detect().rank != 0:
                dataset.__dict__["_dispatched_elsewhere"] = True
                return False
            logger.info(
                "Accelerate's %s divides what one reader reads among the ranks: this dataset "
                "reads every rank's samples, not its rank's share",
                kind.__name__,
            )
            return True
        frame = frame.f_back
    return True


def effective_info(ranks: tuple[int, int] | None, replication: int = 1) -> WorkerInfo:
    """This process's position as a pipeline sees it: detected, then ``ranks`` (given to the
    pipeline) instead of the detected ones, then with ``replication`` > 1 the data-parallel
    position: ranks ``r`` and ``r + 1 ... r + replication - 1`` (``r`` a multiple of it), one
    model-parallel group, share rank ``r // replication`` of ``world_size // replication``, and
    so read the same samples in the same order.

    Raises:
        ConfigError: ``replication`` does not divide the number of ranks.
    """
    info = WorkerInfo.detect()
    if ranks is not None:
        info = dataclasses.replace(info, rank=ranks[0], world_size=ranks[1])
    if replication > 1:
        if info.world_size % replication:
            from cloudshards.errors import ConfigError

            raise ConfigError(
                f"replication={replication} must divide the number of ranks ({info.world_size})"
            )
        info = dataclasses.replace(
            info, rank=info.rank // replication, world_size=info.world_size // replication
        )
    return info


def pytorch_worker_info(group: Any = None) -> tuple[int, int, int, int]:
    """Return ``(rank, world_size, worker, num_workers)`` like webdataset's function."""
    info = WorkerInfo.detect(group)
    return info.rank, info.world_size, info.worker, info.num_workers


def pytorch_worker_seed(group: Any = None) -> int:
    """Return webdataset's per-worker seed, ``rank * 1000 + worker``."""
    rank, _, worker, _ = pytorch_worker_info(group)
    return rank * 1000 + worker


def derive_seed(*parts: object) -> int:
    """Derive a 63-bit seed from parts (seed, epoch, rank, ...), stable across processes.

    Python's ``hash`` is salted per process for strings, so a cryptographic digest of the
    parts' reprs is used instead: every rank computes the same value.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def check_same_length(count: int, *, what: str = "batches", group: Any = None) -> None:
    """Raise if the ranks disagree on ``count`` (e.g. this epoch's number of batches).

    Call it on every rank at the start of an epoch, in the main process, before the first
    step: a rank with fewer batches than the others finishes its epoch early, stops joining
    DDP's gradient all-reduce, and the others wait forever. One small all-gather; nothing
    happens when torch.distributed is not initialised.

    Raises:
        RuntimeError: Naming each rank's count and what to do.
    """
    import torch
    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return
    world = torch_dist.get_world_size(group=group)
    device = torch.device("cpu")
    if torch_dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([int(count)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    torch_dist.all_gather(gathered, mine, group=group)
    counts = [int(t.item()) for t in gathered]
    if len(set(counts)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise RuntimeError(
            f"ranks disagree on the number of {what} this epoch ({listing}); DDP would hang "
            "when the shortest rank finishes. Use balanced epochs (WebDataset(..., "
            "balance='drop'), the default with several ranks), resampled=True with "
            ".with_epoch(n), or a DistributedChunkedSampler"
        )
