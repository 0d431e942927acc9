"""Resampled streaming with DDP: every worker draws shards at random, epochs have a fixed length.

``resampled=True`` makes each DataLoader worker of each rank draw shards with replacement,
endlessly, from its own seed (derived from the base seed, the epoch, the rank and the worker,
so a rerun draws the same). ``with_epoch(n)`` cuts that endless stream into epochs of ``n``
batches per worker. Every rank therefore takes exactly ``workers x n`` steps per epoch whatever
the shard sizes, and DistributedDataParallel never hangs. There is no "each sample exactly
once" guarantee: this is the mode for very large datasets and many nodes, where an epoch is
just a number of steps between evaluations.

Run it on one process, or on several with torchrun::

    python examples/train_resampled.py "gs://bucket/train-{000000..000999}.tar" --epochs 2
    torchrun --standalone --nproc_per_node=2 examples/train_resampled.py SHARDS --workers 2
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 \\
        examples/train_resampled.py SHARDS --samples-per-epoch 1000000

Data: each sample has ``npy`` (a float32 vector of ``--features`` values) and ``cls`` (an int
label below ``--classes``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import cloudshards as wds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("shards", help="shard spec: braces, a glob, or '::'-joined URLs")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--samples-per-epoch",
        type=int,
        default=256,
        help="samples per epoch for the whole job, all ranks together (rounded down to batches)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shuffle-buffer", type=int, default=100, help="sample shuffle buffer")
    parser.add_argument("--cache-dir", help="per-node shard cache (downloads once per node)")
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument(
        "--log-keys",
        type=Path,
        metavar="DIR",
        help="write the keys of every batch to DIR/rankN.jsonl (not --log: torchrun takes it)",
    )
    parser.add_argument("--steps-limit", type=int, help="stop after this many steps in total")
    return parser.parse_args()


def setup_distributed() -> tuple[int, int]:
    """Join the process group when started by torchrun; otherwise run as rank 0 of 1."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    dist.init_process_group("gloo")  # CPU; use "nccl" on GPUs
    return dist.get_rank(), dist.get_world_size()


def batches_per_worker(args: argparse.Namespace, world_size: int) -> int:
    """Split the job's epoch among ranks x workers (the main process counts as one worker)."""
    consumers = world_size * max(args.workers, 1)
    batches = args.samples_per_epoch // (consumers * args.batch_size)
    if batches < 1:
        raise SystemExit(
            f"--samples-per-epoch {args.samples_per_epoch} is less than one batch of "
            f"{args.batch_size} for each of {consumers} ranks x workers"
        )
    return batches


def make_dataset(args: argparse.Namespace, world_size: int) -> wds.WebDataset:
    dataset = wds.WebDataset(
        args.shards,
        resampled=True,  # draw shards with replacement, forever; no node/worker split needed
        seed=args.seed,
        cache_dir=args.cache_dir,
    )
    return (
        dataset.shuffle(args.shuffle_buffer)
        .decode()
        .to_tuple("__key__", "npy", "cls")
        .batched(args.batch_size)
        .with_epoch(batches_per_worker(args, world_size))  # counts batches: it comes after them
    )


class KeyLog:
    """One JSON line per step: which samples this rank trained on (for tests and debugging)."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.file = (directory / f"rank{rank}.jsonl").open("a")

    def write(self, epoch: int, step: int, keys: list[str]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"epoch": epoch, "step": step, "keys": keys}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def main() -> None:
    args = parse_args()
    rank, world_size = setup_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = nn.Linear(args.features, args.classes)
    if dist.is_initialized():
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    dataset = make_dataset(args, world_size)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers)
    log = KeyLog(args.log_keys, rank)
    epoch, step, samples, loss = 0, 0, 0, float("nan")
    while epoch < args.epochs and (args.steps_limit is None or step < args.steps_limit):
        dataset.set_epoch(epoch)  # new draws each epoch, reproducible from (seed, epoch)
        for keys, features, labels in loader:
            optimizer.zero_grad()
            logits = model(torch.as_tensor(features, dtype=torch.float32))
            loss_tensor = nn.functional.cross_entropy(logits, torch.as_tensor(labels))
            loss_tensor.backward()  # DDP's all-reduce: every rank must take every step
            optimizer.step()
            step += 1
            samples += len(keys)
            loss = loss_tensor.item()
            log.write(epoch, step, list(keys))
            if args.steps_limit is not None and step >= args.steps_limit:
                break
        else:
            epoch += 1

    log.close()
    print(
        f"rank {rank}/{world_size}: {epoch} epochs, {step} steps, {samples} samples, "
        f"loss {loss:.4f}",
        flush=True,
    )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
