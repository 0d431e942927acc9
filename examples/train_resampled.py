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
    parser.add_argument(
        "--samples-per-epoch",
        type=int,
        default=256,
        help="samples per epoch for the whole job, all ranks together (rounded down to batches)",
    )
    parser.add_argument("--shuffle-buffer", type=int, default=100, help="sample shuffle buffer")
    return parser.parse_args()


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
        args.data,
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


def main() -> None:
    args = parse_args()
    rank, world_size = setup_distributed()
    model, optimizer = make_model(args)

    dataset = make_dataset(args, world_size)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=args.workers)
    log = KeyLog(args.log_keys, rank)
    epoch, step, samples, loss = 0, 0, 0, float("nan")
    while epoch < args.epochs and (args.steps_limit is None or step < args.steps_limit):
        dataset.set_epoch(epoch)  # new draws each epoch, reproducible from (seed, epoch)
        for keys, features, labels in loader:
            loss = train_step(model, optimizer, features, labels)
            step += 1
            samples += len(keys)
            log.write(epoch, step, list(keys))
            if args.steps_limit is not None and step >= args.steps_limit:
                break
        else:
            epoch += 1

    log.close()
    # DDP holds the process group: drop it first, so that leaving the group destroys the group
    # now and not during interpreter shutdown (where gloo's threads can abort the process).
    del model, optimizer
    finish(rank, world_size, epoch, step, samples, loss)


if __name__ == "__main__":
    main()
