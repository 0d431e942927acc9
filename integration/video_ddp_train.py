"""DDP training on video clips, launched by ``integration/test_video_ddp.py`` under torchrun.

Every rank (gloo backend, CPU) reads the video shards as a user would::

    wds.WebDataset(SHARDS, shardshuffle=True, seed=SEED)
    .shuffle(5)
    .decode(video=wds.VideoClip(8, stride=2, size=(32, 32)))
    .to_tuple("__key__", "mp4", "cls")
    .map(to_training)  # the clip dict -> float frames [C, T, H, W] (+ what the test records)
    .batched(2)

through ``wds.StatefulLoader(dataset, batch_size=None, num_workers=2)``, and trains a small
Conv3d in ``DistributedDataParallel``: one SGD step (``loss.backward()``, an all-reduce) per
batch, ``dataset.set_epoch(epoch)`` before each epoch.

Per step, each rank appends one JSON line to ``--record DIR/rankN.jsonl``: the epoch, the step
and, per clip, the sample key, its label, the clip's timestamps and a hash of its uint8 frames.

``--steps-limit K --save FILE`` stops after K steps and checkpoints: ``loader.state_dict()``
(a collective: it gathers every rank's state) on every rank, then rank 0 alone writes it with
the model and optimizer, as a framework writes one checkpoint. ``--resume FILE`` loads that
one file on every rank (each takes its own loader state from it) and continues. The last line
of each rank is the summary ``torchrun_util`` parses.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import cloudshards as wds

CLASSES = 4
NUM_FRAMES = 8
STRIDE = 2
SIZE = (32, 32)
BATCH_SIZE = 2
WORKERS = 2
SHUFFLE_BUFFER = 5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("shards", help="shard spec (braces)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, required=True, help="the same on every rank")
    # Not --log: torchrun has options of that name.
    parser.add_argument("--record", type=Path, required=True, metavar="DIR")
    parser.add_argument("--steps-limit", type=int, help="stop after this many steps in total")
    parser.add_argument("--save", type=Path, help="checkpoint to FILE at the end (rank 0)")
    parser.add_argument("--resume", type=Path, help="continue from the checkpoint FILE")
    return parser.parse_args()


def frames_digest(frames: torch.Tensor) -> str:
    """A clip's identity: a hash of its uint8 frames (and their shape)."""
    data = hashlib.sha256(repr(tuple(frames.shape)).encode())
    data.update(frames.contiguous().numpy().tobytes())
    return data.hexdigest()[:20]


def to_training(sample: tuple[str, dict[str, Any], int]) -> tuple[Any, ...]:
    """The decoded clip dict -> float frames for the model, plus the clip's identity."""
    key, clip, label = sample
    frames = clip["frames"]  # uint8 [T, C, H, W]
    if frames.shape != (NUM_FRAMES, 3, *SIZE) or frames.dtype != torch.uint8:
        raise ValueError(f"{key}: a clip of {frames.dtype} {tuple(frames.shape)}")
    video = frames.permute(1, 0, 2, 3).float().div(255.0)  # [C, T, H, W] for Conv3d
    return key, video, clip["timestamps"], frames_digest(frames), int(label)


def make_dataset(shards: str, seed: int) -> Any:
    return (
        wds.WebDataset(shards, shardshuffle=True, seed=seed)
        .shuffle(SHUFFLE_BUFFER)
        .decode(video=wds.VideoClip(NUM_FRAMES, stride=STRIDE, size=SIZE))
        .to_tuple("__key__", "mp4", "cls")
        .map(to_training)
        .batched(BATCH_SIZE)
    )


class ClipNet(nn.Module):
    """A Conv3d over the clip, pooled, and a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 8, kernel_size=3, stride=2)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(video).relu().mean(dim=(2, 3, 4)))


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = DistributedDataParallel(ClipNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    dataset = make_dataset(args.shards, args.seed)
    loader = wds.StatefulLoader(dataset, batch_size=None, num_workers=WORKERS)
    epoch, step, samples, loss = 0, 0, 0, float("nan")
    loader_state = None
    if args.resume is not None:
        checkpoint = torch.load(args.resume, weights_only=True)  # one file for every rank
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        epoch, step, samples = checkpoint["epoch"], checkpoint["step"], checkpoint["samples"]
        loader_state = checkpoint["loader"]

    args.record.mkdir(parents=True, exist_ok=True)
    with (args.record / f"rank{rank}.jsonl").open("a") as record:  # a resumed run appends
        while epoch < args.epochs and (args.steps_limit is None or step < args.steps_limit):
            dataset.set_epoch(epoch)
            if loader_state is not None:
                loader.load_state_dict(loader_state)  # continue mid-epoch
                loader_state = None
            for keys, video, timestamps, digests, labels in loader:
                optimizer.zero_grad()
                logits = model(video)
                batch_loss = nn.functional.cross_entropy(logits, torch.as_tensor(labels))
                batch_loss.backward()  # DDP's all-reduce: every rank must take every step
                optimizer.step()
                loss = float(batch_loss.item())
                step += 1
                samples += len(keys)
                clips = [
                    {"key": k, "label": int(y), "timestamps": t.tolist(), "frames": d}
                    for k, y, t, d in zip(keys, labels, timestamps, digests, strict=True)
                ]
                line = {"epoch": epoch, "step": step, "clips": clips}
                record.write(json.dumps(line) + "\n")
                record.flush()
                if args.steps_limit is not None and step >= args.steps_limit:
                    break
            else:
                epoch += 1  # the epoch ran to its end

    if args.save is not None:
        loader_state = loader.state_dict()  # collective: every rank's state, gathered
        if rank == 0:
            checkpoint = {
                "epoch": epoch,
                "step": step,
                "samples": samples,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "loader": loader_state,
            }
            args.save.parent.mkdir(parents=True, exist_ok=True)
            torch.save(checkpoint, args.save)
    print(
        f"rank {rank}/{world_size}: {epoch} epochs, {step} steps, {samples} samples, "
        f"loss {loss:.4f}",
        flush=True,
    )
    del model, optimizer  # DDP holds the group: destroy it now, not at interpreter shutdown
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
