"""Remote shards behind a latency- and bandwidth-limited link: cloudshards vs webdataset 1.0.2.

nginx serves the shards through the project's cloud simulator (integration/cloudsim.py, in its
own process), which adds first-byte latency to every request and caps each connection's
bandwidth, like an object store seen from a training node (DESIGN.md section 5: 30 ms, 25 MB/s
per connection). Both libraries read the same http:// URLs in one run, alternating; the table
gives median samples/s, the ratio, and cloudshards' time to first sample.

    python benchmarks/bench_remote.py [--quick] [--repeats N] [--latency-s 0.03] [--mbps 25]
    python benchmarks/bench_remote.py --large [--large-mb 128]
    python benchmarks/bench_remote.py --rss

``--rss`` reads 6 shards of 16 MiB with a slow consumer (so every prefetch buffer fills) at
prefetch K = 0, 2 and 4 in fresh processes and prints peak resident memory against DESIGN.md's
budget: base + K x (part size x concurrency) + 64 MB, base being the process after imports.

``--large`` instead reads ONE large shard with cloudshards at concurrency 1, 2, 4 and 8 (one
ranged GET at a time is "one stream") and prints MB/s, the speed-up over one stream, and the
peak resident memory of each run (a fresh process each, so the figures do not mix).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

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


def read_cloudshards(urls: list[str]) -> tuple[int, float, float]:
    """(samples, seconds, seconds to the first sample) with default options."""
    import cloudshards

    # The root imports lazily: load the reading code outside the timed run, as webdataset's
    # import is (a first sample should not be charged with a module import).
    web_dataset = cloudshards.WebDataset
    start = time.perf_counter()
    first = 0.0
    count = 0
    for _ in web_dataset(urls, shardshuffle=False):
        if count == 0:
            first = time.perf_counter() - start
        count += 1
    return count, time.perf_counter() - start, first


def read_webdataset(urls: list[str]) -> tuple[int, float, float]:
    """(samples, seconds, seconds to the first sample); webdataset opens http:// with curl."""
    import webdataset

    start = time.perf_counter()
    first = 0.0
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in webdataset.WebDataset(urls, shardshuffle=False):
            if count == 0:
                first = time.perf_counter() - start
            count += 1
    return count, time.perf_counter() - start, first


def raw_link_samples_per_s(urls: list[str], samples: int, connections: int) -> float:
    """The link itself: every byte of ``urls`` as 2 MiB ranged GETs, ``connections`` at a time,
    with no parsing; samples/s if a loader moved bytes that fast."""
    import concurrent.futures as cf

    import fsspec

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    part = 2 << 20
    jobs = []
    for url in urls:
        size = fs.info(url)["size"]
        jobs += [(url, start, min(start + part, size)) for start in range(0, size, part)]
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(connections) as pool:
        list(pool.map(lambda job: fs.cat_file(job[0], start=job[1], end=job[2]), jobs))
    return samples / (time.perf_counter() - start)


@contextlib.contextmanager
def served_shards(shape: Shape, args: argparse.Namespace, prefix: str) -> Iterator[str]:
    """Write the shards, serve them with nginx behind the simulator; yield the base URL."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        data = work / "data"
        ensure_shards(data, shape, log=lambda m: print(m, file=sys.stderr))
        nginx = NginxServer.start(work / "nginx", data)
        try:
            sim = CloudSimProcess.start(
                nginx.base_url, latency_s=args.latency_s, bandwidth_bps=args.mbps * 1e6
            )
            try:
                yield sim.url
            finally:
                sim.stop()
        finally:
            nginx.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def large_shard_child(url: str, concurrency: int) -> None:
    """Read one shard in this (fresh) process; print MB/s and peak RSS as one line."""
    import resource

    import cloudshards

    start = time.perf_counter()
    total = 0
    ds = cloudshards.WebDataset([url], shardshuffle=False, concurrency=concurrency, prefetch=0)
    for sample in ds:
        total += len(sample["bin"])
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{total / seconds / 1e6:.3f} {peak_mib:.1f}")


def rss_child(urls: list[str], prefetch: int) -> None:
    """Read ``urls`` slowly with ``prefetch`` shards ahead; print base and peak RSS (MiB)."""
    import resource

    import cloudshards
    from cloudshards.urls import resolve

    resolve(urls[0])  # imports and the filesystem instance are part of the base
    base_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ds = cloudshards.WebDataset(urls, shardshuffle=False, prefetch=prefetch)
    count = 0
    for _ in ds:
        count += 1
        if count % 50 == 0:
            time.sleep(0.02)  # slower than the link: every prefetch buffer fills
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{base_mib:.1f} {peak_mib:.1f} {count}")


def run_rss(args: argparse.Namespace) -> int:
    """Peak resident memory with K shards prefetched, against the design's budget."""
    import subprocess

    from cloudshards.source import FetchOptions

    fetch = FetchOptions()
    window_mib = fetch.part_bytes * fetch.concurrency / (1 << 20)
    shape = Shape(6, 16 * 1024 * 1024 // (20 * 1024), 20 * 1024)
    rows = []
    with served_shards(shape, args, "bench-remote-rss-") as base_url:
        urls = [f"{base_url}/{shard_name(i)}" for i in range(shape.shards)]
        for prefetch in (0, 2, 4):
            out = subprocess.run(
                [sys.executable, __file__, "--rss-child", ",".join(urls), str(prefetch)],
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            ).stdout.split()
            base, peak, count = float(out[0]), float(out[1]), int(out[2])
            if count != shape.samples:
                print(f"read {count} samples, expected {shape.samples}")
                return 2
            budget = base + prefetch * window_mib + 64
            rows.append(
                [
                    str(prefetch),
                    f"{base:.0f} MiB",
                    f"{peak:.0f} MiB",
                    f"+{peak - base:.0f} MiB",
                    f"{budget:.0f} MiB",
                    "yes" if peak <= budget else "NO",
                ]
            )
    print("\n".join(versions()))
    print(
        f"data: {shape.describe()}; parts of {fetch.part_bytes >> 20} MiB, "
        f"{fetch.concurrency} in flight per shard; slow consumer"
    )
    print(
        format_table(
            ["prefetch K", "base RSS", "peak RSS", "peak - base", "budget", "within"], rows
        )
    )
    return 0


def run_large(args: argparse.Namespace) -> int:
    """One large shard over a capped connection: N ranged GETs vs one stream."""
    import subprocess

    shape = Shape(1, max(1, args.large_mb * 1024 * 1024 // (20 * 1024)), 20 * 1024)
    rows = []
    results: dict[int, list[tuple[float, float]]] = {}
    with served_shards(shape, args, "bench-remote-large-") as base_url:
        url = f"{base_url}/{shard_name(0)}"
        for _ in range(args.repeats or 2):
            for concurrency in (1, 2, 4, 8):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", url, str(concurrency)],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=600,
                ).stdout.split()
                results.setdefault(concurrency, []).append((float(out[0]), float(out[1])))
    one = median([mbs for mbs, _ in results[1]])
    for concurrency, runs in results.items():
        mbs = median([m for m, _ in runs])
        peak = max(p for _, p in runs)
        rows.append([str(concurrency), f"{mbs:.1f}", f"{mbs / one:.2f}x", f"{peak:.0f} MiB"])
    print("\n".join(versions()))
    print(
        f"one shard of {shape.samples * 20 / 1024:.0f} MiB; {args.latency_s * 1000:.0f} ms per "
        f"request, {args.mbps:.0f} MB/s per connection; 2 MiB parts; medians"
    )
    print(format_table(["ranged GETs in flight", "MB/s", "vs one stream", "peak RSS"], rows))
    return 0


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        large_shard_child(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--rss-child":
        rss_child(sys.argv[2].split(","), int(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 shards x 500 samples, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--latency-s", type=float, default=0.03)
    parser.add_argument("--mbps", type=float, default=25.0, help="per-connection cap, MB/s")
    parser.add_argument("--large", action="store_true", help="one large shard, N ranged GETs")
    parser.add_argument("--large-mb", type=int, default=128, help="size of the large shard")
    parser.add_argument("--rss", action="store_true", help="peak memory with K shards ahead")
    args = parser.parse_args()
    if args.large:
        return run_large(args)
    if args.rss:
        return run_rss(args)
    if shutil.which("curl") is None:
        raise SystemExit("webdataset reads http:// URLs with curl; install curl first")
    shape = Shape(4, 500, 20 * 1024) if args.quick else Shape(8, 1000, 20 * 1024)
    repeats = args.repeats or (2 if args.quick else 3)

    with served_shards(shape, args, "bench-remote-") as base_url:
        urls = [f"{base_url}/{shard_name(i)}" for i in range(shape.shards)]
        results: dict[str, list[tuple[int, float, float]]] = {"webdataset": [], "cs": []}
        for repeat in range(repeats):
            order = ["webdataset", "cs"] if repeat % 2 == 0 else ["cs", "webdataset"]
            for lib in order:
                run = read_webdataset if lib == "webdataset" else read_cloudshards
                results[lib].append(run(urls))
        # The ceiling: as many raw connections as cloudshards keeps in flight by default.
        raw = median([raw_link_samples_per_s(urls, shape.samples, 24) for _ in range(repeats)])
    for lib, runs in results.items():
        counts = {count for count, _, _ in runs}
        if counts != {shape.samples}:
            print(f"{lib} read {counts} samples, expected {shape.samples}")
            return 2
    rate = {lib: median([c / s for c, s, _ in runs]) for lib, runs in results.items()}
    first = {lib: median([f for _, _, f in runs]) for lib, runs in results.items()}

    print("\n".join(versions()))
    print(f"data: {shape.describe()}")
    print(
        f"link: {args.latency_s * 1000:.0f} ms before each request, {args.mbps:.0f} MB/s per "
        f"connection (cloud simulator in front of nginx); {repeats} repeats, medians"
    )
    rows = [
        [
            "samples/s",
            f"{rate['webdataset']:,.0f}",
            f"{rate['cs']:,.0f}",
            f"{rate['cs'] / rate['webdataset']:.2f}x",
        ],
        [
            "time to first sample",
            f"{first['webdataset'] * 1000:.0f} ms",
            f"{first['cs'] * 1000:.0f} ms",
            f"{first['cs'] / args.latency_s:.1f}x the first-byte latency",
        ],
        [
            "the link: 24 raw ranged GETs in flight",
            "",
            f"{raw:,.0f} samples/s",
            f"cloudshards reaches {rate['cs'] / raw:.0%} of it",
        ],
    ]
    print(format_table(["measure", "webdataset 1.0.2", "cloudshards", "ratio"], rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
