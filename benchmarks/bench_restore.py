"""What a restore through a shuffle buffer costs, against starting the epoch over.

A pipeline ``WebDataset(urls, shardshuffle=True).shuffle(BUFFER)`` is read to the middle of
its epoch; its ``state_dict()`` is taken there. Then, in the same process:

- **restore**: a new pipeline, ``load_state_dict(state)``, and its first sample: the buffered
  samples are read again by position (the shards that hold them are opened, only their
  members read) before the epoch goes on;
- **start over**: a new pipeline without the state, read up to the same point (what reaching
  the same position costs without an exact restore); its first sample's time too;
- **elastic**: the same state restored on 2 ranks (``load_state_dict({"elastic": [state]})``,
  sample counts known as with an index): rank 0's first sample (its share starts with the
  buffered samples); both ranks together must deliver the rest of the epoch once.

Local files, and http:// through nginx behind the project's cloud simulator (30 ms before
each request, 25 MB/s per connection): seconds to the first sample, and behind the simulator
the GETs and bytes the store served. Every restored run must continue exactly as the
uninterrupted one (checked by keys), or the script exits with status 2. Medians of
``--repeats``.

    python benchmarks/bench_restore.py                  # 60 shards x 1000 x 8 KiB, .shuffle(10000)
    python benchmarks/bench_restore.py --quick          # 8 shards x 500, .shuffle(1000)
    python benchmarks/bench_restore.py --setups local
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, Shape, ensure_shards, format_table, median, use_checkout

use_checkout()
sys.path.insert(0, str(REPO_ROOT / "integration"))

from cloudsim import CloudSimProcess  # noqa: E402
from servers import NginxServer  # noqa: E402

import cloudshards as wds  # noqa: E402

SEED = 11


def build(urls: list[str], buffer: int, rank: int = 0, world: int = 1, counts: Any = None) -> Any:
    """The pipeline (as rank ``rank`` of ``world``; ``counts``: samples per shard, known)."""
    return wds.WebDataset(
        urls, shardshuffle=True, seed=SEED, rank=rank, world_size=world, sample_counts=counts
    ).shuffle(buffer)


def keys_of(items: Any) -> list[str]:
    return [item["__key__"] for item in items]


def checkpoint(urls: list[str], buffer: int, at: int) -> tuple[dict[str, Any], list[str]]:
    """The state after ``at`` samples, and the keys delivered up to there."""
    dataset = build(urls, buffer)
    it = iter(dataset)
    head = [next(it)["__key__"] for _ in range(at)]
    state = dataset.state_dict()
    it.close()  # type: ignore[attr-defined]
    return state, head


def timed_first(make: Callable[[], Any]) -> tuple[float, Any, Iterator[Any]]:
    """Seconds to the first item of ``make()``'s iterator, the item and the iterator."""
    start = time.perf_counter()
    it = iter(make())
    first = next(it)
    return time.perf_counter() - start, first, it


@contextlib.contextmanager
def served(data: Path, work: Path, latency_s: float, mbps: float) -> Iterator[CloudSimProcess]:
    nginx = NginxServer.start(work / "nginx", data)
    try:
        sim = CloudSimProcess.start(nginx.base_url, latency_s=latency_s, bandwidth_bps=mbps * 1e6)
        try:
            yield sim
        finally:
            sim.stop()
    finally:
        nginx.close()


def measure(
    urls: list[str], buffer: int, at: int, sim: CloudSimProcess | None
) -> tuple[dict[str, float], list[str]]:
    """One repeat: restore and start-over figures; problems found."""
    problems: list[str] = []
    everything = keys_of(build(urls, buffer))
    state, head = checkpoint(urls, buffer, at)
    buffered = len(state["stages"]["shuffle"]["buffer"])
    figures: dict[str, float] = {"buffered": buffered}

    def restored() -> Any:
        dataset = build(urls, buffer)
        dataset.load_state_dict(state)
        return dataset

    if sim is not None:
        sim.reset_stats()
    seconds, first, it = timed_first(restored)
    if sim is not None:
        stats = sim.stats()
        figures |= {"restore_gets": stats.gets, "restore_mb": stats.bytes_sent / 1e6}
    figures["restore_s"] = seconds
    rest = [first["__key__"], *keys_of(it)]
    if head + rest != everything:
        problems.append(f"the restored run differs from the uninterrupted one ({buffered=})")

    # Elastic: the same checkpoint restored on 2 ranks (sample counts known, as with an
    # index): rank 0's first sample, and both ranks together must deliver the rest once.
    counts = [len(everything) // len(urls)] * len(urls)
    elastic = [build(urls, buffer, rank, 2, counts) for rank in (0, 1)]
    for dataset in elastic:
        dataset.load_state_dict({"elastic": [state]})
    if sim is not None:
        sim.reset_stats()
    seconds, first, it = timed_first(lambda: elastic[0])
    figures["elastic_s"] = seconds
    if sim is not None:
        stats = sim.stats()
        figures |= {"elastic_gets": stats.gets, "elastic_mb": stats.bytes_sent / 1e6}
    rest = [first["__key__"], *keys_of(it), *keys_of(elastic[1])]
    if sorted(head + rest) != sorted(everything):
        problems.append("the elastic restore on 2 ranks did not deliver the rest once")

    if sim is not None:
        sim.reset_stats()
    start = time.perf_counter()
    seconds, first, it = timed_first(lambda: build(urls, buffer))
    figures["fresh_first_s"] = seconds
    for _ in range(at - 1):
        next(it)
    figures["start_over_s"] = time.perf_counter() - start
    it.close()  # type: ignore[attr-defined]
    if sim is not None:
        stats = sim.stats()
        figures |= {"start_over_gets": stats.gets, "start_over_mb": stats.bytes_sent / 1e6}
    return figures, problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 shards x 500, .shuffle(1000)")
    p.add_argument("--shards", type=int, default=60)
    p.add_argument("--samples", type=int, default=1000, help="samples per shard")
    p.add_argument("--bin-kib", type=int, default=8)
    p.add_argument("--buffer", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--setups", default="local,simulator")
    p.add_argument("--latency-s", type=float, default=0.03)
    p.add_argument("--mbps", type=float, default=25.0)
    args = p.parse_args()
    if args.quick:
        args.shards, args.samples, args.buffer, args.repeats = 8, 500, 1000, 1
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups or set(setups) - {"local", "simulator"}:
        p.error("--setups takes local, simulator or both")
    shape = Shape(args.shards, args.samples, args.bin_kib * 1024)
    at = shape.shards * shape.samples_per_shard // 2
    work = Path(tempfile.mkdtemp(prefix="bench-restore-"))
    rows, problems = [], []
    try:
        data = work / "data"
        ensure_shards(data, shape, log=lambda m: print(m, file=sys.stderr))
        names = sorted(path.name for path in data.glob("*.tar"))
        print(
            f"data   {shape.shards} shards x {shape.samples_per_shard} samples, bin "
            f"{args.bin_kib} KiB; .shuffle({args.buffer}); checkpoint after {at} samples"
        )
        for setup in setups:
            with contextlib.ExitStack() as stack:
                sim = None
                if setup == "simulator":
                    sim = stack.enter_context(served(data, work, args.latency_s, args.mbps))
                    urls = [f"{sim.url}/{name}" for name in names]
                else:
                    urls = [str(data / name) for name in names]
                runs = []
                for _ in range(args.repeats):
                    figures, found = measure(urls, args.buffer, at, sim)
                    runs.append(figures)
                    problems += [f"{setup}: {x}" for x in found]

                def med(key: str, runs: list[dict[str, float]] = runs) -> str:
                    values = [r[key] for r in runs if key in r]
                    return f"{median(values):,.2f}" if values else "n/a"

                rows.append(
                    [
                        setup,
                        med("buffered"),
                        med("restore_s"),
                        med("restore_gets"),
                        med("restore_mb"),
                        med("start_over_s"),
                        med("start_over_gets"),
                        med("start_over_mb"),
                        med("fresh_first_s"),
                        med("elastic_s"),
                        med("elastic_gets"),
                        med("elastic_mb"),
                    ]
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = ["setup", "buffered", "restore s", "GETs", "MB", "start over s", "GETs", "MB"]
    print()
    print(format_table([*header, "fresh 1st s", "elastic s", "GETs", "MB"], rows))
    print(
        "\nrestore: load_state_dict to the first sample; start over: a new epoch read up to the"
        " checkpoint;\nfresh 1st s: a new epoch's first sample; elastic: the checkpoint restored"
        " on 2 ranks,\nrank 0's first sample. GETs/MB: what the store served."
    )
    if problems:
        print("\nPROBLEMS:\n  - " + "\n  - ".join(problems))
        return 2
    print("every restored run continued exactly as the uninterrupted one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
