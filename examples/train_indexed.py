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
from torch.utils.data import DataLoader

import cloudshards as wds


def parse_args() -> argparse.Namespace:
    parser = training_arguments(
        __doc__.split("\n", 1)[0], "an index URL (*.index.json), or shards next to their index"
    )
    parser.add_argument("--chunk-size", type=int, help="largest chunk (default: whole shards)")
    parser.add_argument("--drop-last", action="store_true", help="drop the tail, do not repeat")
    return parser.parse_args()


DECODER = wds.Decoder([])  # webdataset's default decoding: npy -> array, cls -> int


def to_example(sample: dict[str, Any]) -> tuple[str, torch.Tensor, int]:
    """Raw sample (bytes per field) -> (key, features, label); runs in the DataLoader worker."""
    sample = DECODER(sample)
    return sample["__key__"], torch.as_tensor(sample["npy"], dtype=torch.float32), sample["cls"]


def main() -> None:
    args = parse_args()
    rank, world_size = setup_distributed()
    model, optimizer = make_model(args)

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
            loss = train_step(model, optimizer, features, labels)
            step += 1
            samples += len(keys)
            log.write(epoch, step, list(keys))
            if args.steps_limit is not None and step >= args.steps_limit:
                break
        else:
            epoch += 1

    log.close()
    dataset.close()
    # DDP holds the process group: drop it first, so that leaving the group destroys the group
    # now and not during interpreter shutdown (where gloo's threads can abort the process).
    del model, optimizer
    finish(rank, world_size, epoch, step, samples, loss)


if __name__ == "__main__":
    main()
