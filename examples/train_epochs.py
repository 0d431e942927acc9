"""Classic epochs with DDP: every sample once per epoch, the same number of steps on every rank.

Each epoch the shard order is a permutation seeded by (seed, epoch), identical on every rank;
``balance="drop"`` (the default when there are several ranks) cuts that epoch's sample sequence
so that every rank x DataLoader worker gets exactly the same number of samples, dropping at
most ``ranks x workers - 1`` of them (``balance="pad"`` repeats a few instead). Equal sample
counts mean equal batch counts, so DistributedDataParallel never waits at an all-reduce for a
rank that has run out of data: the classic hang with shards of uneven sizes.

Run it on one process, or on several with torchrun::

    python examples/train_epochs.py "s3://bucket/train-{000000..000099}.tar" --epochs 2
    torchrun --standalone --nproc_per_node=2 examples/train_epochs.py SHARDS --workers 2
    # two nodes: the same command on each, with --node_rank=0 / 1
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 \\
        examples/train_epochs.py SHARDS

Resume after a crash with ``wds.StatefulLoader`` (torchdata's ``StatefulDataLoader``; ``pip
install 'cloudshards[resume]'``): it asks the dataset in every worker for its ``state_dict()``
and gathers every rank's into each checkpoint, so a restored run continues with the very next
sample, on the same number of ranks and workers or on another (an elastic restore: the rest of
the epoch is divided over the new world, each sample once, every rank the same steps)::

    torchrun ... examples/train_epochs.py SHARDS --steps-limit 100 --state ckpt/   # stops
    torchrun ... examples/train_epochs.py SHARDS --resume ckpt/                     # continues
    torchrun --nproc_per_node=3 ... train_epochs.py SHARDS --resume ckpt/ --workers 1  # elastic

Data: each sample has ``npy`` (a float32 vector of ``--features`` values) and ``cls`` (an int
label below ``--classes``), e.g. written with ``wds.ShardWriter``::

    sink.write({"__key__": key, "npy": np.float32(vector), "cls": label})
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from _ddp import (
    KeyLog,
    finish,
    make_model,
    setup_distributed,
    train_step,
    training_arguments,
)

import cloudshards as wds


def parse_args() -> argparse.Namespace:
    parser = training_arguments(
        __doc__.split("\n", 1)[0], "shard spec: braces, a glob, or '::'-joined URLs"
    )
    parser.add_argument("--balance", choices=["auto", "drop", "pad"], default="auto")
    parser.add_argument("--shuffle-buffer", type=int, default=0, help="sample shuffle buffer")
    parser.add_argument("--state", type=Path, help="save a checkpoint to DIR/rankN.pt at the end")
    parser.add_argument("--resume", type=Path, help="continue from the checkpoint in DIR")
    parser.add_argument(
        "--torch-loader",
        action="store_true",
        help="a plain torch.utils.data.DataLoader, as most webdataset programs use",
    )
    parser.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip samples that fail to decode (warn_and_continue) instead of stopping",
    )
    parser.add_argument(
        "--mix-counts",
        help="mix datasets: DATA is comma-separated shard specs, this their samples per epoch "
        "(comma-separated, over all ranks), e.g. 5000,3000,2000",
    )
    return parser.parse_args()


def shards(spec: str, args: argparse.Namespace, seed: int) -> wds.WebDataset:
    dataset = wds.WebDataset(
        spec,
        shardshuffle=True,  # a new shard order every epoch, the same on every rank
        seed=seed,
        balance=args.balance,  # equal samples per rank x worker: no DDP hang, no duplicate
        cache_dir=args.cache_dir,
    )
    return dataset.shuffle(args.shuffle_buffer)  # no-op with 0; resume is exact either way


def make_dataset(args: argparse.Namespace) -> Any:
    # decode, pick the fields, batch in the worker (one pickle per batch, not per sample)
    handler = wds.warn_and_continue if args.skip_bad else wds.reraise_exception
    tail = [
        wds.decode(handler=handler),
        wds.to_tuple("__key__", "npy", "cls"),
        wds.batched(args.batch_size),
    ]
    if args.mix_counts is None:
        return shards(args.data, args, args.seed).compose(*tail)
    # Each epoch exactly these many samples of each dataset, in a fixed interleaving; every
    # rank and worker takes its equal share of each count.
    counts = [int(n) for n in args.mix_counts.split(",")]
    sources = [shards(spec, args, args.seed + n) for n, spec in enumerate(args.data.split(","))]
    return wds.DataPipeline(wds.WeightedMix(sources, counts=counts), *tail, seed=args.seed)


def make_loader(dataset: Any, args: argparse.Namespace) -> Any:
    """A DataLoader over the (already batched) dataset; a stateful one to checkpoint it."""
    if args.torch_loader:
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers)
    if args.state is not None or args.resume is not None:
        return wds.StatefulLoader(dataset, batch_size=None, num_workers=args.workers)
    return wds.WebLoader(dataset, batch_size=None, num_workers=args.workers)


def main() -> None:
    args = parse_args()
    rank, world_size = setup_distributed()
    model, optimizer = make_model(args)

    dataset = make_dataset(args)
    loader = make_loader(dataset, args)
    start_epoch, step, samples, loss = 0, 0, 0, float("nan")
    loader_state = None
    if args.resume is not None:
        # Every rank's file holds every rank's loader state, and DDP keeps the model and the
        # optimizer identical on all ranks: a new rank of a larger world reads rank 0's.
        path = args.resume / f"rank{rank}.pt"
        path = path if path.exists() else args.resume / "rank0.pt"
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch, step, samples = checkpoint["epoch"], checkpoint["step"], checkpoint["samples"]
        loader_state = checkpoint["loader"]

    log = KeyLog(args.log_keys, rank)
    epoch = start_epoch
    while epoch < args.epochs and (args.steps_limit is None or step < args.steps_limit):
        dataset.set_epoch(epoch)  # same value on every rank: same shard order everywhere
        if loader_state is not None:
            loader.load_state_dict(loader_state)  # continue mid-epoch, where the state stopped
            loader_state = None
        for keys, features, labels in loader:
            loss = train_step(model, optimizer, features, labels)
            step += 1
            samples += len(keys)
            log.write(epoch, step, list(keys))
            if args.steps_limit is not None and step >= args.steps_limit:
                break
        else:
            epoch += 1  # the epoch ran to its end

    if args.state is not None:
        args.state.mkdir(parents=True, exist_ok=True)
        loader_state = loader.state_dict()  # collective: every rank's, gathered
        checkpoint = {
            "epoch": epoch,
            "step": step,
            "samples": samples,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": loader_state,  # every rank's and worker's dataset.state_dict() inside
        }
        torch.save(checkpoint, args.state / f"rank{rank}.pt")
    log.close()
    # DDP holds the process group: drop it first, so that leaving the group destroys the group
    # now and not during interpreter shutdown (where gloo's threads can abort the process).
    del model, optimizer
    finish(rank, world_size, epoch, step, samples, loss)


if __name__ == "__main__":
    main()
