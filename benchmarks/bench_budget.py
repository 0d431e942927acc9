"""The node request budget against a store that throttles: the default budget and shared
backoff, side by side with fixed settings, in one run.

Two processes ("ranks") x 8 DataLoader workers read 16 shards x 40 samples of 16 KiB through
the project's cloud simulator in front of nginx (20 ms before each request, GETs beyond
``--rps`` per second answered 503 SlowDown), with 64 KiB ranged GETs. Each setting runs
``--repeats`` times; the table shows the median seconds, the GETs the store answered, how
many it throttled, the most GETs in flight at once, and the throughput relative to the best
setting.

    python benchmarks/bench_budget.py
    python benchmarks/bench_budget.py --rps 120 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO_ROOT, format_table, median, use_checkout

use_checkout()
sys.path.insert(0, str(REPO_ROOT / "integration"))

from cloudsim import CloudSimProcess  # noqa: E402
from servers import NginxServer  # noqa: E402
from test_node_budget import _write_shards  # noqa: E402

READER = REPO_ROOT / "integration" / "node_budget_reader.py"

#: (name, CLOUDSHARDS_NODE_REQUESTS): the default, fixed node budgets, and none at all.
SETTINGS = [("default (128)", None), ("budget 6", "6"), ("budget 16", "16"), ("none", "0")]


def run(urls: list[str], budget: str | None, work: Path) -> float:
    """Seconds for both ranks to read everything with ``budget``."""
    # The readers import this checkout, as the benchmark does.
    env = {**os.environ, "CLOUDSHARDS_NODE_DIR": str(work / "node"), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("CLOUDSHARDS_NODE_REQUESTS", None)
    if budget is not None:
        env["CLOUDSHARDS_NODE_REQUESTS"] = budget
    shutil.rmtree(work / "node", ignore_errors=True)
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, str(READER), json.dumps(urls), str(r), "2", str(work / f"{r}.json")],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        for r in (0, 1)
    ]
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a reader failed (budget {budget})")
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rps", type=float, default=60.0, help="GETs per second before SlowDown")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-budget-"))
    nginx = NginxServer.start(work / "nginx", work / "data")
    sim = CloudSimProcess.start(nginx.base_url, latency_s=0.02, rate_limit_rps=args.rps)
    try:
        urls = [f"{sim.url}/{name}" for name in _write_shards(work / "data")]
        results = {}
        for _ in range(args.repeats):
            for name, budget in SETTINGS:  # alternated: drift on a noisy machine hits all
                sim.reset_stats()
                seconds = run(urls, budget, work)
                stats = sim.stats()
                results.setdefault(name, []).append(
                    (seconds, stats.gets, stats.throttled, stats.gets_in_flight_max)
                )
        best = min(median([r[0] for r in runs]) for runs in results.values())
        rows = []
        for name, runs in results.items():
            seconds = median([r[0] for r in runs])
            rows.append(
                [
                    name,
                    f"{seconds:.2f}",
                    f"{median([r[1] for r in runs]):.0f}",
                    f"{median([r[2] for r in runs]):.0f}",
                    f"{max(r[3] for r in runs)}",
                    f"{best / seconds:.2f}",
                ]
            )
        print(f"2 ranks x 8 workers, 16 shards x 40 x 16 KiB, {args.rps:.0f} GET/s limit")
        print(format_table(["setting", "s", "GETs", "throttled", "in flight", "x best"], rows))
    finally:
        sim.stop()
        nginx.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
