"""Seeds and the epoch context of a pipeline: the default seed, and the (seed, epoch, rank,
worker) a :class:`~cloudshards.pipeline.DataPipeline` makes current while its stages run."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from cloudshards import config
from cloudshards.dist import WorkerInfo, derive_seed
from cloudshards.stages import shuffle
from cloudshards.stages.base import IterationContext

__all__ = ["default_seed", "epoch_context"]

logger = logging.getLogger("cloudshards.pipeline")


def default_seed() -> int:
    """The base seed when none is given: ``CLOUDSHARDS_SEED``, else ``WDS_SEED``, else 0.

    A fixed default keeps every rank on the same shard order without coordination, the way
    ``DistributedSampler(seed=0)`` does; epochs still differ through the epoch number.
    """
    value = config.env_seed()
    return 0 if value is None else value


def _shuffles(stage: Any) -> bool:
    return getattr(stage, "shuffle", None) is True or isinstance(stage, shuffle.Shuffler)


def _torch_base_seed() -> int | None:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return None if info is None else int(info.seed - info.id)


def epoch_context(
    seed: int,
    epoch: int,
    *,
    info: WorkerInfo,
    seed_given: bool,
    epoch_set: bool,
    stages: Sequence[Any],
) -> IterationContext:
    """The context of one epoch of a pipeline with base ``seed`` in this process.

    Args:
        seed: The pipeline's base seed.
        epoch: The epoch to run.
        info: This process's position as the pipeline sees it (see
            :func:`~cloudshards.dist.effective_info`).
        seed_given: The user chose the seed (argument or environment).
        epoch_set: ``set_epoch`` (or a restored state) chose the epoch.
        stages: The pipeline's stages (a shuffling one makes a missing set_epoch worth a warning).
    """
    if not epoch_set and info.world_size == 1 and not seed_given:
        # Without set_epoch, non-persistent DataLoader workers get a fresh copy of the
        # dataset each epoch, so their epoch counter never moves. Mixing in the DataLoader's
        # per-epoch base seed (equal for all workers of one epoch) still reshuffles. Only
        # on one rank (ranks must agree, and their torch seeds may differ) and only without
        # a seed (a seed the user gives must fix the order regardless of torch's RNG).
        base_seed = _torch_base_seed()
        if base_seed is not None:
            seed = derive_seed(seed, base_seed)
    elif (
        not epoch_set
        and epoch == 0
        and (info.num_workers > 1 or _torch_base_seed() is not None)
        and (info.rank, info.worker) == (0, 0)
        and any(_shuffles(stage) for stage in stages)
    ):
        # Several ranks or an explicit seed, DataLoader workers and no set_epoch: fresh
        # (non-persistent) workers start from epoch 0 every time, so the order repeats.
        why = f"with {info.world_size} ranks" if info.world_size > 1 else f"with seed={seed}"
        logger.warning(
            "no set_epoch() on this dataset %s: unless the DataLoader has "
            "persistent_workers=True, its workers see epoch 0 every epoch and repeat its "
            "order; call dataset.set_epoch(epoch) each epoch (the same value on every rank)",
            why,
        )
    return IterationContext(seed=seed, epoch=epoch, info=info)
