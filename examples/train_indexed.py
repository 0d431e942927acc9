"""Indexed (map-style) epochs with DDP: random access through a tar index and a chunked sampler.

``IndexedDataset`` reads any sample by number (one ranged GET, or a read from the shard in the
per-node cache) using an index written once with ``cloudshards index SHARDS``.
``DistributedChunkedSampler`` gives every rank a disjoint, equally long list of sample numbers
each epoch, chunk by chunk (whole shards, or pieces of ``--chunk-size``), reshuffled by
``set_epoch``: a full shuffle of the epoch while each rank touches only a few shards at a time.
As with torch's ``DistributedSampler``, when the ranks do not divide the dataset the last ranks
repeat a few samples from the start of the epoch's order, so every rank takes the same number
of steps and DistributedDataParallel never hangs.

Run it on one process, or on several with torchrun::

    cloudshards index "s3://bucket/train-{000000..000099}.tar"    # writes train.index.json
    python examples/train_indexed.py "s3://bucket/train.index.json" --epochs 2
    torchrun --standalone --nproc_per_node=2 examples/train_indexed.py INDEX --workers 2

Data: each sample has ``npy`` (a float32 vector of ``--features`` values) and ``cls`` (an int
label below ``--classes``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import cloudshards as wds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("data", help="an index URL (*.index.json), or shards next to their index")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--seed", type=int, default=0, help="the same on every rank")
    parser.add_argument("--chunk-size", type=int, help="largest chunk (default: whole shards)")
    parser.add_argument("--drop-last", action="store_true", help="drop the tail, do not repeat")
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


DECODER = wds.Decoder([])  # webdataset's default decoding: npy -> array, cls -> int


def to_example(sample: dict[str, Any]) -> tuple[str, torch.Tensor, int]:
    """Raw sample (bytes per field) -> (key, features, label); runs in the DataLoader worker."""
    sample = DECODER(sample)
    return sample["__key__"], torch.as_tensor(sample["npy"], dtype=torch.float32), sample["cls"]


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

    dataset = wds.IndexedDataset(args.data, transform=to_example, cache_dir=args.cache_dir)
    sampler = wds.DistributedChunkedSampler(  # rank and world size from torch.distributed
        dataset, seed=args.seed, chunk_size=args.chunk_size, drop_last=args.drop_last
    )
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers
    )
    log = KeyLog(args.log_keys, rank)
    epoch, step, samples, loss = 0, 0, 0, float("nan")
    while epoch < args.epochs and (args.steps_limit is None or step < args.steps_limit):
        sampler.set_epoch(epoch)  # same value on every rank: a new, agreed order each epoch
        for keys, features, labels in loader:
            optimizer.zero_grad()
            loss_tensor = nn.functional.cross_entropy(model(features), labels)
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
    dataset.close()
    print(
        f"rank {rank}/{world_size}: {epoch} epochs, {step} steps, {samples} samples, "
        f"loss {loss:.4f}",
        flush=True,
    )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
