"""A loader that rank 0 iterates alone in a 2-rank job (an evaluation on rank 0, say), over a
dataset balanced across the ranks; rank 1 only joins the final barrier.

Prints ``rank 0: epoch E, N samples`` per epoch and ``rank R done`` at the end; the test reads
the lines and the wait it logged.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

import cloudshards as wds


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        dataset = wds.WebDataset(sys.argv[1], shardshuffle=False).batched(4)
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=0)
        for epoch in range(2):
            samples = sum(len(batch["__key__"]) for batch in loader)
            print(f"rank 0: epoch {epoch}, {samples} samples", flush=True)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
