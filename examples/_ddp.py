"""What the three training examples share: joining the process group, a tiny DDP model, one
training step, a per-rank log of the samples trained on, and the closing summary line.

The data loading (the part that differs between the modes) stays in each example.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def training_arguments(description: str, data_help: str) -> argparse.ArgumentParser:
    """The options every example takes; each adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("data", help=data_help)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--seed", type=int, default=0, help="the same on every rank")
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
    return parser


def setup_distributed() -> tuple[int, int]:
    """Join the process group when started by torchrun; otherwise run as rank 0 of 1."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    dist.init_process_group("gloo")  # CPU; use "nccl" on GPUs
    return dist.get_rank(), dist.get_world_size()


def make_model(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A linear classifier (in DDP when distributed) and its optimizer."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = nn.Linear(args.features, args.classes)
    if dist.is_initialized():
        model = DistributedDataParallel(model)  # averages gradients across ranks every step
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, features: object, labels: object
) -> float:
    """One optimisation step; returns the loss."""
    optimizer.zero_grad()
    logits = model(torch.as_tensor(features, dtype=torch.float32))
    loss = nn.functional.cross_entropy(logits, torch.as_tensor(labels))
    loss.backward()  # DDP's all-reduce: every rank must take every step
    optimizer.step()
    return float(loss.item())


class KeyLog:
    """One JSON line per step: which samples this rank trained on (for tests and debugging)."""

    def __init__(self, directory: Path | None, rank: int) -> None:
        self.file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.file = (directory / f"rank{rank}.jsonl").open("a")  # a resumed run appends

    def write(self, epoch: int, step: int, keys: list[str]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"epoch": epoch, "step": step, "keys": keys}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def finish(rank: int, world_size: int, epoch: int, step: int, samples: int, loss: float) -> None:
    """Print this rank's summary line and leave the process group."""
    print(
        f"rank {rank}/{world_size}: {epoch} epochs, {step} steps, {samples} samples, "
        f"loss {loss:.4f}",
        flush=True,
    )
    if dist.is_initialized():
        gc.collect()  # what still holds the group (a DDP model in a reference cycle) goes first
        dist.destroy_process_group()
