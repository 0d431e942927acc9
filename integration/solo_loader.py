"""Loaders that not every rank iterates alike, in a 2-rank job over a dataset balanced across
the ranks, whose pipeline can drop samples (a ``select``): nothing may hang.

``solo``: rank 0 alone iterates a loader (an evaluation on rank 0, say), two epochs; rank 1
only joins the final barrier. Prints ``rank 0: epoch E, N samples``.

``peek``: rank 0 alone looks at one batch (``next(iter(loader))``), then both ranks train
two epochs on the loader, dropping ``s1-005`` to ``s1-007`` with a ``select`` (one rank a
batch short without the check). Prints ``rank R: epoch E, N batches``.

``late``: both ranks train three epochs, dropping ``s1-000`` to ``s1-003`` (remote shards
without counts: epoch 0 runs count-free); rank 0 comes ``LATE_S`` seconds late to epoch 1
(a long validation or checkpoint). Prints ``rank R: epoch E, N batches``.

Each rank prints ``rank R done`` at the end.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch.distributed as dist

import cloudshards as wds

DROPPED = {"s1-005", "s1-006", "s1-007"}
DROPPED_LATE = {"s1-000", "s1-001", "s1-002", "s1-003"}


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    spec, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dropped = DROPPED_LATE if mode == "late" else DROPPED
    dataset = wds.WebDataset(spec, shardshuffle=False)
    dataset = dataset.select(lambda sample: sample["__key__"] not in dropped).batched(4)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=0)
    if mode == "solo" and rank == 0:
        for epoch in range(2):
            samples = sum(len(batch["__key__"]) for batch in loader)
            print(f"rank 0: epoch {epoch}, {samples} samples", flush=True)
    if mode == "peek":
        if rank == 0:
            next(iter(loader))
        for epoch in range(2):
            dataset.set_epoch(epoch)
            batches = sum(1 for _ in loader)
            print(f"rank {rank}: epoch {epoch}, {batches} batches", flush=True)
    if mode == "late":
        for epoch in range(3):
            if epoch == 1 and rank == 0:
                time.sleep(float(os.environ["LATE_S"]))
            dataset.set_epoch(epoch)
            batches = sum(1 for _ in loader)
            print(f"rank {rank}: epoch {epoch}, {batches} batches", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
