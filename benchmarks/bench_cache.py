"""The per-node shard cache, side by side in one run, with shards served by nginx.

    python benchmarks/bench_cache.py            # 16 shards x 1000 samples (20 KiB), 3 repeats
    python benchmarks/bench_cache.py --quick    # 8 shards x 250 samples, 3 repeats

Measures (nginx's access log gives the body bytes of every response):
  1. bytes  4 processes (2 DataLoader workers each) on one node each read every shard:
            remote bytes fetched / dataset bytes. cloudshards with one shared ``cache_dir``
            (target 1.00) vs webdataset 1.0.2 with the same ``cache_dir`` (its FileCache
            downloads whole shards with curl, no lock between processes: up to 4.00).
  2. warm   cloudshards' second epoch from its cache vs cloudshards reading the same shards
            from local disk without a cache: samples/s ratio, target >= 0.9.
  3. cold   cloudshards' first (cold) epoch from nginx with an empty cache vs without a cache:
            samples/s ratio, target >= 0.95.

Each repeat runs both sides of every measure, alternating which goes first; the table shows
medians. Every run must read exactly the data set (sample count, distinct keys, payload
bytes); if one does not, the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    Shape,
    ensure_shards,
    fmt_rate,
    format_table,
    median,
    shard_name,
    use_checkout,
    versions,
    warm_page_cache,
)

LIBS = ("cloudshards", "webdataset")
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Read:
    """What one reader saw: checked against the data set."""

    samples: int
    distinct: int
    payload_bytes: int

    def problem(self, shape: Shape) -> str | None:
        if (self.samples, self.distinct, self.payload_bytes) == (
            shape.samples,
            shape.samples,
            shape.payload_bytes,
        ):
            return None
        return (
            f"{self.samples} samples ({self.distinct} distinct), {self.payload_bytes} payload "
            f"bytes; expected {shape.samples} samples, {shape.payload_bytes} bytes"
        )


def read_all(source: Any) -> Read:
    keys: set[str] = set()
    n = nbytes = 0
    for sample in source:
        n += 1
        keys.add(sample["__key__"])
        nbytes += len(sample["bin"])
    return Read(n, len(keys), nbytes)


# --------------------------------------------------------------------------------------------
# Child: one of the N processes of measure 1
# --------------------------------------------------------------------------------------------


def child(config_path: str) -> int:
    """Build the library's dataset, signal ready, wait for the barrier, read, write counts."""
    cfg = json.loads(Path(config_path).read_text())
    use_checkout()
    warnings.filterwarnings("ignore", module="webdataset")
    import torch.utils.data

    if cfg["lib"] == "cloudshards":
        import cloudshards as lib
    else:
        import webdataset as lib  # type: ignore[no-redef]
    dataset = lib.WebDataset(
        cfg["url"], shardshuffle=False, nodesplitter=None, cache_dir=cfg["cache_dir"]
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=cfg["workers"])
    Path(cfg["ready"]).touch()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not os.path.exists(cfg["go"]):
        if time.monotonic() > deadline:
            return 3
        time.sleep(0.005)
    start = time.perf_counter()
    result = read_all(loader)
    seconds = time.perf_counter() - start
    out = {**result.__dict__, "seconds": seconds}
    Path(cfg["out"] + ".tmp").write_text(json.dumps(out))
    os.replace(cfg["out"] + ".tmp", cfg["out"])
    return 0


# --------------------------------------------------------------------------------------------
# Measure 1: remote bytes per node
# --------------------------------------------------------------------------------------------


@dataclass
class BytesRun:
    ratio: float
    seconds: float
    problems: list[str] = field(default_factory=list)
    note: str = ""


def node_run(
    lib: str,
    url: str,
    server: Any,
    dataset_bytes: int,
    shape: Shape,
    work: Path,
    processes: int,
    workers: int,
) -> BytesRun:
    """``processes`` readers of ``lib`` share one cache dir; returns nginx bytes / dataset."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{lib}-", dir=work))
    cache_dir = run_dir / "cache"
    cache_dir.mkdir()
    go = run_dir / "go"
    server.clear_access_log()
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    problems: list[str] = []
    try:
        for i in range(processes):
            cfg = {
                "lib": lib,
                "url": url,
                "cache_dir": str(cache_dir),
                "workers": workers,
                "ready": str(run_dir / f"ready{i}"),
                "go": str(go),
                "out": str(run_dir / f"out{i}.json"),
            }
            (run_dir / f"cfg{i}.json").write_text(json.dumps(cfg))
            with (run_dir / f"stderr{i}").open("wb") as err:
                popen = subprocess.Popen(
                    [sys.executable, __file__, "--child", str(run_dir / f"cfg{i}.json")],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                )
            procs.append((popen, run_dir / f"out{i}.json", run_dir / f"stderr{i}"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for i, (popen, _, stderr) in enumerate(procs):
            while not (run_dir / f"ready{i}").exists():
                if popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{lib} reader {i} did not start:\n{_tail(stderr)}")
                time.sleep(0.01)
        start = time.perf_counter()
        go.touch()
        for i, (popen, out, stderr) in enumerate(procs):
            code = popen.wait(timeout=RUN_TIMEOUT_S)
            if code != 0:
                problems.append(f"{lib} reader {i} exited with {code}: {_tail(stderr)}")
                continue
            counts = json.loads(out.read_text())
            del counts["seconds"]
            problem = Read(**counts).problem(shape)
            if problem:
                problems.append(f"{lib} reader {i} read {problem}")
        seconds = time.perf_counter() - start
        fetched = sum(e.bytes_sent for e in _settled(server) if e.method == "GET")
        note = ""
        if lib == "cloudshards":
            from cloudshards import cache_info

            counters = cache_info(cache_dir)["counters"]
            note = (
                f"(its cache counters: misses {counters.get('misses', 0)}, waits "
                f"{counters.get('waits', 0)}, hits {counters.get('hits', 0)}, bytes_network "
                f"{counters.get('bytes_network', 0) / dataset_bytes:.2f} x dataset)"
            )
        return BytesRun(fetched / dataset_bytes, seconds, problems, note)
    finally:
        for popen, _, _ in procs:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def _settled(server: Any, quiet_s: float = 0.3, timeout_s: float = 10.0) -> list[Any]:
    """nginx logs a response when it is done: wait until the log stops growing."""
    deadline = time.monotonic() + timeout_s
    entries = server.access_entries()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        current = server.access_entries()
        if len(current) == len(entries):
            break
        entries = current
    return list(entries)


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# Measures 2 and 3: one process, plain iteration, cloudshards on both sides
# --------------------------------------------------------------------------------------------


@dataclass
class Timed:
    rates: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, label: str, read: Read, seconds: float, shape: Shape) -> None:
        rate = read.samples / seconds if seconds > 0 else float("nan")
        self.rates.append(rate)
        problem = read.problem(shape)
        if problem:
            self.problems.append(f"{label}: read {problem}")
        flag = f"  MISMATCH: {problem}" if problem else ""
        print(
            f"    {label:<34} {read.samples:>7} samples in {seconds:6.2f} s = "
            f"{fmt_rate(rate):>8} samples/s{flag}",
            flush=True,
        )


#: The four runs of measures 2 and 3, by kind.
STEPS = {
    "cold": "cold epoch, nginx, with cache",
    "plain": "cold epoch, nginx, no cache",
    "warm": "second epoch, from the cache",
    "disk": "local disk, no cache",
}


def source_for(kind: str, cached: Any, remote: str, local: str) -> Any:
    """The dataset a run iterates: the cached one (its first, then its second epoch), or a
    fresh uncached one over nginx or over the local files."""
    import cloudshards

    if kind in ("cold", "warm"):
        return cached
    return cloudshards.WebDataset(remote if kind == "plain" else local, shardshuffle=False)


def timed_read(make: Callable[..., Any], *args: Any) -> tuple[Read, float]:
    """Build the dataset with ``make(*args)`` and read it all; the time covers both."""
    start = time.perf_counter()
    result = read_all(make(*args))
    return result, time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="8 shards x 250 samples")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side (default 3)")
    p.add_argument("--shards", type=int, help="number of shards (default 16)")
    p.add_argument("--samples", type=int, help="samples per shard (default 1000)")
    p.add_argument("--bin-kib", type=int, default=20, help="size of each bin field (KiB)")
    p.add_argument("--processes", type=int, default=4, help="readers on the node (measure 1)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per reader")
    p.add_argument(
        "--measures", default="1,2,3", help="comma-separated measures to run (default 1,2,3)"
    )
    p.add_argument(
        "--data",
        type=Path,
        help="directory for the shards, reused when it holds the same data set "
        "(default: a temporary directory, removed at the end)",
    )
    p.add_argument(
        "--work",
        type=Path,
        help="where cache directories go (default: a temporary directory on the local disk)",
    )
    args = p.parse_args(argv)
    args.shards = args.shards or (8 if args.quick else 16)
    args.samples = args.samples or (250 if args.quick else 1000)
    if min(args.repeats, args.shards, args.samples, args.bin_kib, args.processes) < 1:
        p.error("--repeats, --shards, --samples, --bin-kib and --processes must be positive")
    try:
        args.measures = {int(x) for x in args.measures.split(",") if x.strip()}
    except ValueError:
        p.error("--measures takes numbers such as 1,3")
    if not args.measures or args.measures - {1, 2, 3}:
        p.error("--measures takes numbers among 1, 2, 3")
    return args


def start_nginx(workdir: Path, root: Path) -> Any:
    """nginx from the integration suite's server helpers, serving ``root``."""
    sys.path.insert(0, str(REPO_ROOT / "integration"))
    from servers import NginxServer, ServerStartError

    try:
        return NginxServer.start(workdir, root)
    except ServerStartError as exc:
        raise SystemExit(f"cannot start nginx: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.child)
    use_checkout()
    warnings.filterwarnings("ignore", module="webdataset")
    import webdataset

    import cloudshards

    if shutil.which("curl") is None and 1 in args.measures:
        raise SystemExit("webdataset opens http URLs with curl, which is not installed")
    shape = Shape(args.shards, args.samples, args.bin_kib * 1024)
    extra = {
        "cloudshards": f"{cloudshards.__version__}  ({cloudshards.__file__})",
        "webdataset": f"{getattr(webdataset, '__version__', '?')}  ({webdataset.__file__})",
    }
    print("\n".join(versions(extra)))
    print(f"data       {shape.describe()}")
    print(f"repeats    {args.repeats} of each side, order alternating; medians in the table")

    temp_dir = Path(tempfile.mkdtemp(prefix="cloudshards-bench-cache-"))
    data_dir = args.data or temp_dir / "data"
    work = args.work or temp_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        seconds = ensure_shards(data_dir, shape)
        if seconds:
            print(f"wrote the shards in {seconds:.1f} s")
        paths = [data_dir / shard_name(s) for s in range(shape.shards)]
        dataset_bytes = warm_page_cache(paths)
        print(f"shards     {dataset_bytes / 2**20:.0f} MiB in {data_dir} (page cache warmed)")
        server = start_nginx(temp_dir / "nginx", data_dir)
        brace = f"bench-{{000000..{shape.shards - 1:06d}}}.tar"
        remote = server.url_for(brace)
        local = str(data_dir / brace)
        print(f"nginx      {server.base_url} (access log: {server.access_log_path})")

        rows: list[list[str]] = []
        problems: list[str] = []
        if 1 in args.measures:
            print(
                f"\nmeasure 1: {args.processes} processes x {args.workers} workers, one node, "
                "one shared cache_dir, every process reads every shard from nginx"
            )
            ratios: dict[str, list[float]] = {lib: [] for lib in LIBS}
            for r in range(args.repeats):
                order = LIBS if r % 2 == 0 else tuple(reversed(LIBS))
                for lib in order:
                    run = node_run(
                        lib,
                        remote,
                        server,
                        dataset_bytes,
                        shape,
                        work,
                        args.processes,
                        args.workers,
                    )
                    ratios[lib].append(run.ratio)
                    problems += run.problems
                    flag = f"  PROBLEMS: {run.problems}" if run.problems else ""
                    print(
                        f"    repeat {r + 1}/{args.repeats}  {lib:<12} fetched "
                        f"{run.ratio:.2f} x dataset bytes in {run.seconds:6.2f} s {run.note}{flag}",
                        flush=True,
                    )
            cs, wd = median(ratios["cloudshards"]), median(ratios["webdataset"])
            rows.append(
                [
                    f"1 remote bytes per node / dataset, {args.processes} processes",
                    f"{cs:.2f}",
                    f"webdataset {wd:.2f}",
                    f"{cs / wd:.2f}",
                    "cloudshards = 1.00",
                    "yes" if round(cs, 2) == 1.00 else "NO",
                ]
            )

        if args.measures & {2, 3}:
            print("\nmeasures 2 and 3: one process, plain iteration, cloudshards on both sides")
            series = {kind: Timed() for kind in STEPS}
            # Untimed warm-up: threads, fsspec's session and nginx's workers start once here,
            # not in whichever run happens to go first.
            for kind in ("plain", "disk"):
                problem = timed_read(source_for, kind, None, remote, local)[0].problem(shape)
                if problem:
                    problems.append(f"warm-up {kind}: read {problem}")
            for r in range(args.repeats):
                cache_dir = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
                ds = cloudshards.WebDataset(remote, shardshuffle=False, cache_dir=str(cache_dir))

                print(f"  repeat {r + 1}/{args.repeats}")
                kinds = (
                    ("plain", "cold", "warm", "disk")
                    if r % 2 == 0
                    else ("cold", "plain", "disk", "warm")
                )
                for kind in kinds:
                    label, timed = STEPS[kind], series[kind]
                    os.sync()  # earlier runs' cache writes must not be flushed during this one
                    result, secs = timed_read(source_for, kind, ds, remote, local)
                    timed.add(label, result, secs, shape)
                entries = cloudshards.cache_info(cache_dir)["entries"]
                if entries != shape.shards:
                    problems.append(f"repeat {r + 1}: the cache holds {entries} entries")
                shutil.rmtree(cache_dir, ignore_errors=True)
            for timed in series.values():
                problems += timed.problems
            if 2 in args.measures:
                a, b = median(series["warm"].rates), median(series["disk"].rates)
                rows.append(
                    [
                        "2 second epoch from cache vs local disk, samples/s",
                        fmt_rate(a),
                        f"disk {fmt_rate(b)}",
                        f"{a / b:.2f}",
                        ">= 0.90",
                        "yes" if a / b >= 0.9 else "NO",
                    ]
                )
            if 3 in args.measures:
                a, b = median(series["cold"].rates), median(series["plain"].rates)
                rows.append(
                    [
                        "3 cold epoch with cache vs without, samples/s",
                        fmt_rate(a),
                        f"no cache {fmt_rate(b)}",
                        f"{a / b:.2f}",
                        ">= 0.95",
                        "yes" if a / b >= 0.95 else "NO",
                    ]
                )

        header = ["measure (medians)", "cloudshards", "reference", "ratio", "target", "met"]
        print()
        print(format_table(header, rows))
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(temp_dir, ignore_errors=True)

    if problems:
        print("\nFAILED: some runs did not read the data set exactly:")
        for problem in problems:
            print(f"  - {problem}")
        return 2
    print("\nevery run read exactly the expected samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
