"""Two ends of epochs the ranks end together, under torchrun (gloo), one rank per process.

``restore MODE SPEC DIR``: a pipeline whose ``select`` drops a whole shard, so that its rank
runs out first and the ranks end the epoch together. ``MODE=save`` saves the loader's state
after every step (a checkpoint every N steps hits the epoch's last one whenever N divides
it); ``MODE=resume`` restores the last one and reads on: the epoch has nothing left.

``short SPEC``: two epochs of batches of 4 without partial ones; with remote shards and no
counts the first epoch is count-free, and a rank whose shards hold fewer than 4 samples has
no batch at all.

Each rank prints ``rank R MODE epoch E: N steps``; every step all-reduces, as DDP does. Once
its process group is destroyed, as the job's last step, it prints at interpreter exit the gloo
threads still alive: ``rank R gloo threads at exit: N``.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import cloudshards as wds


def _gloo_threads_at_exit() -> None:
    """Registered first, so it runs last of the exit handlers, just before the interpreter
    finalizes: a gloo worker thread alive then can abort the process."""
    tasks = Path("/proc/self/task")
    names = [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]
    alive = sum(name.startswith("pt_gloo") for name in names)
    print(f"rank {os.environ.get('RANK')} gloo threads at exit: {alive}", flush=True)


def main() -> wds.StatefulLoader:
    atexit.register(_gloo_threads_at_exit)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("cloudshards.countfree").setLevel(logging.INFO)  # says count-free
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if sys.argv[1] == "restore":
        mode, spec, directory = sys.argv[2:5]
        dataset = (
            wds.WebDataset(spec, shardshuffle=False, seed=0)
            .select(lambda sample: not sample["__key__"].startswith("a0-"))
            .map(lambda sample: sample["__key__"])
            .batched(4)
        )
        epochs = 1
    else:
        mode, spec, directory = "short", sys.argv[2], ""
        dataset = (
            wds.WebDataset(spec, shardshuffle=False, seed=0)
            .map(lambda sample: sample["__key__"])
            .batched(4, partial=False)
        )
        epochs = 2
    loader = wds.StatefulLoader(dataset, batch_size=None, num_workers=0)
    checkpoint = f"{directory}/checkpoint.pt"
    if mode == "resume":
        loader.load_state_dict(torch.load(checkpoint, weights_only=False))
    gradient = torch.zeros(1)
    for epoch in range(epochs):
        steps = 0
        for _ in loader:
            dist.all_reduce(gradient)  # DDP's gradient all-reduce
            steps += 1
            if mode == "save":
                state = loader.state_dict()  # on every rank
                if rank == 0:
                    torch.save(state, checkpoint)
        print(f"rank {rank} {mode} epoch {epoch}: {steps} steps", flush=True)
    dist.destroy_process_group()
    return loader


if __name__ == "__main__":
    # Kept, as a script's top-level loader is, until the interpreter finalizes.
    LOADER = main()
