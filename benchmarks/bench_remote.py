"""Remote shards behind a latency- and bandwidth-limited link: cloudshards vs webdataset 1.0.2.

nginx serves the shards through the project's cloud simulator (integration/cloudsim.py, in its
own process), which adds first-byte latency to every request and caps each connection's
bandwidth, like an object store seen from a training node (DESIGN.md section 5: 30 ms, 25 MB/s
per connection). Both libraries read the same http:// URLs in one run, alternating; the table
gives median samples/s, the ratio, and cloudshards' time to first sample.

    python benchmarks/bench_remote.py [--quick] [--repeats N] [--latency-s 0.03] [--mbps 25]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
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

    start = time.perf_counter()
    first = 0.0
    count = 0
    for _ in cloudshards.WebDataset(urls, shardshuffle=False):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 shards x 500 samples, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--latency-s", type=float, default=0.03)
    parser.add_argument("--mbps", type=float, default=25.0, help="per-connection cap, MB/s")
    args = parser.parse_args()
    if shutil.which("curl") is None:
        raise SystemExit("webdataset reads http:// URLs with curl; install curl first")
    shape = Shape(4, 500, 20 * 1024) if args.quick else Shape(8, 1000, 20 * 1024)
    repeats = args.repeats or (2 if args.quick else 3)

    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        data = work / "data"
        ensure_shards(data, shape, log=lambda m: print(m, file=sys.stderr))
        nginx = NginxServer.start(work / "nginx", data)
        sim = CloudSimProcess.start(
            nginx.base_url, latency_s=args.latency_s, bandwidth_bps=args.mbps * 1e6
        )
        try:
            urls = [f"{sim.url}/{shard_name(i)}" for i in range(shape.shards)]
            results: dict[str, list[tuple[int, float, float]]] = {"webdataset": [], "cs": []}
            for repeat in range(repeats):
                order = ["webdataset", "cs"] if repeat % 2 == 0 else ["cs", "webdataset"]
                for lib in order:
                    run = read_webdataset if lib == "webdataset" else read_cloudshards
                    results[lib].append(run(urls))
            for lib, runs in results.items():
                counts = {count for count, _, _ in runs}
                if counts != {shape.samples}:
                    print(f"{lib} read {counts} samples, expected {shape.samples}")
                    return 2
            rate = {lib: median([c / s for c, s, _ in runs]) for lib, runs in results.items()}
            first = {lib: median([f for _, _, f in runs]) for lib, runs in results.items()}
        finally:
            sim.stop()
            nginx.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

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
    ]
    print(format_table(["measure", "webdataset 1.0.2", "cloudshards", "ratio"], rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
