"""Indexed mode: random single-sample reads from a remote store and from the node cache.

nginx serves shards written with webdataset's TarWriter through the project's cloud simulator
(integration/cloudsim.py, in its own process: 30 ms before each request, 25 MB/s per
connection, as in bench_remote.py). An index is built over the simulator, then
``IndexedDataset`` reads samples in random order:

- remote: no cache, one ranged GET per sample; 1 thread, ``--threads`` threads
  (``get_many``), and a DataLoader with ``--workers`` workers whose batches are read on
  ``--threads`` threads each (``__getitems__``);
- cache: ``cache_dir`` on local disk; cold (empty cache, each shard downloaded on first touch,
  DataLoader with the locality-preserving ``DistributedChunkedSampler``), then warm: the same
  three ways of reading as remote.

Requests per sample come from the simulator's own GET counter. Every sample read is checked
against the streaming reader's sample with the same index (keys and bytes).

    python benchmarks/bench_indexed.py [--quick] [--repeats N] [--threads 16] [--workers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    Shape,
    ensure_shards,
    format_table,
    median,
    shard_name,
    use_checkout,
    versions,
)

use_checkout()
sys.path.insert(0, str(REPO_ROOT / "integration"))

from cloudsim import CloudSimProcess  # noqa: E402
from servers import NginxServer  # noqa: E402


@dataclass
class Run:
    samples: int
    seconds: float
    gets: int
    bytes_sent: int

    @property
    def rate(self) -> float:
        return self.samples / self.seconds


@contextlib.contextmanager
def served(shape: Shape, args: argparse.Namespace) -> Iterator[tuple[Path, str, CloudSimProcess]]:
    """Shards on disk, nginx, the simulator in front: (data dir, base URL, simulator)."""
    work = Path(tempfile.mkdtemp(prefix="bench-indexed-"))
    try:
        data = Path(args.data) if args.data else work / "data"
        ensure_shards(data, shape, log=lambda m: print(m, file=sys.stderr))
        nginx = NginxServer.start(work / "nginx", data)
        try:
            sim = CloudSimProcess.start(
                nginx.base_url, latency_s=args.latency_s, bandwidth_bps=args.mbps * 1e6
            )
            try:
                yield work, sim.url, sim
            finally:
                sim.stop()
        finally:
            nginx.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(sim: CloudSimProcess, read: Callable[[], int]) -> Run:
    sim.reset_stats()
    start = time.perf_counter()
    count = read()
    seconds = time.perf_counter() - start
    stats = sim.stats()
    return Run(count, seconds, stats.gets, stats.bytes_sent)


def checker(expected: dict[int, tuple[str, bytes]]) -> Callable[[int, dict[str, Any]], None]:
    def check(index: int, sample: dict[str, Any]) -> None:
        key, data = expected[index]
        if sample["__key__"] != key or sample["bin"] != data:
            raise SystemExit(f"MISMATCH at sample {index}: {sample['__key__']} != {key}")

    return check


def read_one_by_one(ds: Any, order: list[int], check: Callable[..., None]) -> int:
    for i in order:
        check(i, ds[i])
    return len(order)


def read_threads(ds: Any, order: list[int], threads: int, check: Callable[..., None]) -> int:
    for start in range(0, len(order), 256):
        part = order[start : start + 256]
        for i, sample in zip(part, ds.get_many(part, max_workers=threads), strict=True):
            check(i, sample)
    return len(order)


def _keys_and_bins(batch: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["bin"]) for s in batch]


def read_loader(ds: Any, sampler: Any, workers: int, by_key: dict[str, bytes]) -> int:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=32,
        sampler=sampler,
        num_workers=workers,
        collate_fn=_keys_and_bins,
        multiprocessing_context="fork",
    )
    count = 0
    for batch in loader:
        for key, data in batch:
            if by_key.get(key) != data:
                raise SystemExit(f"MISMATCH: sample {key} has other bytes")
            count += 1
    if count != len(sampler):
        raise SystemExit(f"MISMATCH: read {count} samples, the sampler has {len(sampler)}")
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 shards x 500 samples")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency-s", type=float, default=0.03)
    parser.add_argument("--mbps", type=float, default=25.0, help="per-connection cap, MB/s")
    parser.add_argument("--data", default=None, help="keep the shards in this directory")
    args = parser.parse_args()
    shape = Shape(4, 500, 20 * 1024) if args.quick else Shape(8, 1000, 20 * 1024)
    repeats = args.repeats or (1 if args.quick else 3)
    single = 100 if args.quick else 300  # samples per one-thread run (~30 ms each)
    many = 1000 if args.quick else 4000

    import cloudshards
    from cloudshards.indexed import DistributedChunkedSampler, IndexedDataset, build_index

    results: dict[str, list[Run]] = {}
    with served(shape, args) as (work, base_url, sim):
        urls = [f"{base_url}/{shard_name(i)}" for i in range(shape.shards)]
        start = time.perf_counter()
        index = build_index(urls)
        build_s = time.perf_counter() - start
        expected = {
            i: (s["__key__"], s["bin"])
            for i, s in enumerate(cloudshards.WebDataset(urls, shardshuffle=False))
        }
        check = checker(expected)
        by_key = dict(expected.values())
        n = len(expected)
        rng = random.Random(0)

        def add(name: str, run: Run) -> None:
            results.setdefault(name, []).append(run)
            print(
                f"{name}: {run.samples} samples in {run.seconds:.2f} s = {run.rate:,.0f}/s, "
                f"{run.gets} GETs",
                file=sys.stderr,
            )

        for repeat in range(repeats):
            with IndexedDataset(index, max_workers=args.threads) as ds:
                order = [rng.randrange(n) for _ in range(single)]
                add("remote, 1 thread", measure(sim, partial(read_one_by_one, ds, order, check)))
                order = [rng.randrange(n) for _ in range(many)]
                add(
                    f"remote, {args.threads} threads",
                    measure(sim, partial(read_threads, ds, order, args.threads, check)),
                )
                import torch.utils.data

                sampler = torch.utils.data.RandomSampler(
                    range(n), num_samples=many, generator=torch.Generator().manual_seed(repeat)
                )
                add(
                    f"remote, DataLoader {args.workers} workers x {args.threads} threads",
                    measure(sim, partial(read_loader, ds, sampler, args.workers, by_key)),
                )

            cache_dir = work / f"cache-{repeat}"
            with IndexedDataset(index, cache_dir=cache_dir, max_workers=args.threads) as ds:
                chunked = DistributedChunkedSampler(ds, num_replicas=1, rank=0, seed=repeat)
                add(
                    f"cache cold, DataLoader {args.workers} workers, chunked sampler",
                    measure(sim, partial(read_loader, ds, chunked, args.workers, by_key)),
                )
                order = [rng.randrange(n) for _ in range(many)]
                add(
                    "cache warm, 1 thread", measure(sim, partial(read_one_by_one, ds, order, check))
                )
                add(
                    f"cache warm, {args.threads} threads",
                    measure(sim, partial(read_threads, ds, order, args.threads, check)),
                )
                chunked.set_epoch(1)
                add(
                    f"cache warm, DataLoader {args.workers} workers, chunked sampler",
                    measure(sim, partial(read_loader, ds, chunked, args.workers, by_key)),
                )
            shutil.rmtree(cache_dir, ignore_errors=True)

    print("\n".join(versions()))
    print(f"data: {shape.describe()}")
    print(
        f"link: {args.latency_s * 1000:.0f} ms before each request, {args.mbps:.0f} MB/s per "
        f"connection (cloud simulator in front of nginx); {repeats} repeats, medians"
    )
    print(f"index: built over the simulator in {build_s:.2f} s; samples in random order")
    rows = []
    for name, runs in results.items():
        rate = median([r.rate for r in runs])
        per_sample = median([r.gets / r.samples for r in runs])
        mb_s = median([r.bytes_sent / r.seconds / 1e6 for r in runs])
        rows.append([name, f"{rate:,.0f}", f"{per_sample:.3f}", f"{mb_s:,.1f}"])
    print(format_table(["read", "samples/s", "GETs per sample", "MB/s from store"], rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
