"""cloudshards vs LitData, MosaicML Streaming and webdataset on S3, side by side, in one run.

    python benchmarks/bench_s3.py                 # 16 shards x 1000 samples, 2 repeats
    python benchmarks/bench_s3.py --quick         # 4 shards x 250 samples, 1 repeat
    python benchmarks/bench_s3.py --setup-only    # install the peers (benchmarks/.peers/)
    python benchmarks/bench_s3.py --loaders cloudshards,litdata --setups proxy --workers 2

The same samples (``bin``: 20 KiB random, ``json``, ``cls``) are written in each loader's own
format: tar shards (webdataset's TarWriter) for cloudshards and webdataset, ``litdata.optimize``
chunks for LitData 0.2.76, ``MDSWriter`` shards for MosaicML Streaming 0.13.0; all are
uploaded to s3rver 3.7.1, a local S3 server that serves Range requests. Setups: ``proxy``
reads through the cloud simulator (integration/cloudsim.py in its own process: 30 ms before
each request, 25 MB/s per connection), ``direct`` reads s3rver itself, ``gcs`` reads the tar
and LitData copies from fake-gcs-server (the GCS emulator) through the simulator: both move
the bytes through obstore (GCS's XML API), their metadata through gcsfs and
google-cloud-storage (the JSON API); MosaicML Streaming and webdataset are measured on S3 only.
``cloudshards+fsspec``, when named, reads through s3fs/gcsfs instead of obstore.

Each measurement (loader x setup x DataLoader workers, batch 32) runs in a fresh child process
under the peers' interpreter (_s3peers.py) with empty caches: epoch 1 is cold, epoch 2 warm.
cloudshards runs without a cache and with ``cache_dir=`` (its node cache); LitData and
Streaming always cache locally. webdataset reads ``pipe:aws s3 cp URL -`` (it has no s3://
opener). Every epoch must deliver every key exactly once with the right bytes, or the run is a
MISMATCH and the script exits with status 2. Repeats alternate the loaders' order; the table
shows medians: samples/s, the ratio to LitData, network MB/s, GETs and bytes the store saw
(the simulator's counters, or s3rver's log when direct), and CPU seconds (user+system of the
child and its workers) per GB of ``bin`` payload, which stays steady on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, format_table, median
from _s3peers import S3RVER, child_env, ensure, fake_gcs_server, python
from _s3peers import versions as peer_versions
from _s3store import FakeGCS, Moto, S3rver, gcs_env, s3_env

HERE = Path(__file__).resolve().parent
CLOUDSIM = REPO_ROOT / "integration" / "cloudsim.py"
BASELINE = "litdata"
# (label, library, cloudshards cache); --loaders picks by library.
VARIANTS = (
    ("cloudshards", "cloudshards", False),
    ("cloudshards+cache", "cloudshards", True),
    ("litdata", "litdata", False),
    ("streaming", "streaming", False),
    ("webdataset", "webdataset", False),
)
#: Measured only when --loaders names them: torch's own DataLoader(batch_size=...) over the
#: dataset, as programs written for webdataset often use it, with the node cache.
PLAIN = ("cloudshards+dataloader", "cloudshards", True)
#: Measured only when named: cloudshards with its bytes through s3fs/gcsfs instead of obstore
#: (CLOUDSHARDS_TRANSPORT=fsspec), no cache: what the obstore transport gains.
FSSPEC = ("cloudshards+fsspec", "cloudshards", False)
#: With --against DIR: the cloudshards of another checkout, without and with the cache.
AGAINST = (("before", "cloudshards", False), ("before+cache", "cloudshards", True))
LIBRARIES = ("cloudshards", "litdata", "streaming", "webdataset")
SETUPS = ("proxy", "direct", "gcs", "moto")
GCS_LIBRARIES = ("cloudshards", "litdata")  # the loaders measured on GCS too


@dataclass
class Cell:
    """Every repeat of one variant in one setup with one worker count."""

    epochs: list[list[dict[str, Any]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def _median(self, epoch: int, value: Callable[[dict[str, Any]], float]) -> float:
        """Median over the repeats of ``value(epoch's figures)``; NaN without that epoch."""
        return median([value(run[epoch]) for run in self.epochs if len(run) > epoch])

    def med(self, epoch: int, key: str) -> float:
        return self._median(epoch, lambda e: float(e[key]))

    def rate(self, epoch: int) -> float:
        return self._median(epoch, lambda e: e["samples"] / e["seconds"])

    def cpu_per_gb(self, epoch: int) -> float:
        return self._median(epoch, lambda e: e["cpu_s"] / (e["payload_bytes"] / 1e9))

    def net_mb_s(self, epoch: int) -> float:
        return self._median(epoch, lambda e: e["store_bytes"] / 1e6 / e["seconds"])


class Simulator:
    """integration/cloudsim.py as a process under the peers' interpreter (it has aiohttp)."""

    def __init__(self, upstream: str, latency_s: float, mbps: float) -> None:
        argv = [str(python()), str(CLOUDSIM), "--upstream", upstream, "--port", "0"]
        argv += ["--stop-on-stdin-eof", "--latency-s", str(latency_s)]
        argv += ["--bandwidth-bps", str(mbps * 1e6)]
        self.popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.popen.stdout is not None
        self.url = self.popen.stdout.readline().decode().strip()
        if not self.url.startswith("http://"):
            self.stop()
            raise RuntimeError("cloudsim did not start")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)


def run_child(
    command: str,
    spec: dict[str, Any],
    env: dict[str, str],
    timeout_s: float,
    py_spy: Path | None = None,
    gil: bool = False,
    idle: bool = False,
) -> tuple[dict[str, Any] | None, str]:
    """Run _s3loaders.py in a fresh process; (its RESULT or None, the output's tail).

    With ``py_spy``, under ``py-spy record -f raw -r 100 -s`` (every thread, its subprocesses),
    writing the profile there; ``gil``: only samples of the thread holding the GIL; ``idle``:
    waiting threads too."""
    argv = [str(python()), str(HERE / "_s3loaders.py"), command, json.dumps(spec)]
    if py_spy is not None:
        if not (python().parent / "py-spy").exists():  # peers installed before it was listed
            subprocess.run([str(python()), "-m", "pip", "install", "-q", "py-spy"], check=True)
        spy = [str(python().parent / "py-spy"), "record", "-f", "raw", "-r", "100", "-s"]
        spy += [*(["--gil"] if gil else []), *(["--idle"] if idle else [])]
        argv = [*spy, "-o", str(py_spy), "--", *argv]
    popen = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = popen.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)  # the child's own session: it and its workers
        out, _ = popen.communicate()
        return None, f"timed out after {timeout_s:.0f} s\n" + out.decode(errors="replace")[-1500:]
    text = out.decode(errors="replace")
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:]), text
        if command == "write" and line.startswith("{"):
            return json.loads(line), text
    return None, f"exit {popen.returncode}\n{text[-3000:]}"


def measure(
    args: argparse.Namespace,
    variant: tuple[str, str, bool],
    workers: int,
    endpoint: str,
    counter: str,
    store: str = "s3",
) -> tuple[list[dict[str, Any]] | None, str]:
    """One fresh child reading with ``variant``; ``store``: "s3" (``endpoint`` is S3's) or
    "gcs" (``endpoint`` is the GCS emulator's, read through the simulator)."""
    label, library, cache = variant
    child_dir = Path(tempfile.mkdtemp(prefix=f"s3bench-{label}-", dir=args.work))
    try:
        spec = {
            "loader": library,
            "plain": label == PLAIN[0],
            "cache": cache,
            "workers": workers,
            "batch": args.batch,
            "shards": args.shards,
            "expected": str(args.work / "data" / "expected.json"),
            "counter": counter,
            "work_child": str(child_dir),
            "epochs": args.epochs,
            "store": store,
        }
        extra = gcs_env(endpoint) if store == "gcs" else s3_env(endpoint)
        env = child_env(endpoint, {**os.environ, **extra})
        env["TMPDIR"] = str(child_dir)
        if label.startswith("before"):
            env["BENCH_CHECKOUT"] = str(args.against)
        if label == FSSPEC[0]:
            env["CLOUDSHARDS_TRANSPORT"] = "fsspec"
        env["CLOUDSHARDS_COUNTS_DIR"] = str(child_dir / "counts")
        py_spy, args.py_spy = args.py_spy, None  # only the first measurement
        result, text = run_child("read", spec, env, args.timeout_s, py_spy, args.gil, args.idle)
        return (result["epochs"] if result else None), text
    finally:
        shutil.rmtree(child_dir, ignore_errors=True)


def fmt(value: float, digits: int = 0) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def report(cells: dict[tuple[str, int, str], Cell], args: argparse.Namespace) -> list[str]:
    problems: list[str] = []
    header = ["loader", "cold sam/s", "warm sam/s", "cold x LD", "warm x LD", "cold MB/s"]
    header += ["GETs c/w", "MB c/w", "CPU s/GB c", "CPU s/GB w"]
    for setup in args.setups:
        for workers in args.workers:
            rows = []
            base = cells.get((setup, workers, BASELINE))
            for label, _, _ in args.variants:
                cell = cells.get((setup, workers, label))
                if cell is None:  # not measured on this store
                    continue
                for error in cell.errors:
                    problems.append(f"{setup}, {workers} workers, {label}: {error}")
                if not cell.epochs:
                    rows.append([label, "error", *["-"] * (len(header) - 2)])
                    continue
                ratios = []
                for epoch in (0, 1):
                    value = float("nan")
                    if base is not None and base.epochs:
                        value = cell.rate(epoch) / base.rate(epoch)
                    ratios.append("-" if value != value else f"{value:.2f}x")
                gets = f"{fmt(cell.med(0, 'gets'))}/{fmt(cell.med(1, 'gets'))}"
                mbytes = f"{fmt(cell.med(0, 'store_bytes') / 1e6)}"
                mbytes += f"/{fmt(cell.med(1, 'store_bytes') / 1e6)}"
                rows.append(
                    [
                        label,
                        fmt(cell.rate(0)),
                        fmt(cell.rate(1)),
                        *ratios,
                        fmt(cell.net_mb_s(0), 1),
                        gets,
                        mbytes,
                        fmt(cell.cpu_per_gb(0), 1),
                        fmt(cell.cpu_per_gb(1), 1),
                    ]
                )
            sim = f"cloud simulator ({args.latency_s * 1000:.0f} ms, {args.mbps:g} MB/s per conn)"
            where = {
                "proxy": f"s3rver behind the {sim}",
                "direct": "direct to s3rver (store bytes from its log, 3 digits)",
                "gcs": f"fake-gcs-server (GCS) behind the {sim}",
                "moto": "direct to moto_server (no request log: GETs and bytes not counted)",
            }[setup]
            print(f"\n{setup}: {where}, {workers} DataLoader workers, batch {args.batch}\n")
            print(format_table(header, rows))
            for plain in ("cloudshards", "before"):  # what the node cache costs a cold epoch
                uncached, cached = (
                    cells.get((setup, workers, v)) for v in (plain, plain + "+cache")
                )
                if (
                    uncached is not None
                    and cached is not None
                    and uncached.epochs
                    and cached.epochs
                ):
                    ratio = cached.rate(0) / uncached.rate(0)
                    print(f"{plain}+cache cold: {ratio:.2f}x {plain} cold (without the cache)")
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 shards x 250 samples, 1 repeat")
    p.add_argument("--repeats", type=int, help="runs of each measurement (default 2)")
    p.add_argument("--shards", type=int, help="default 16")
    p.add_argument("--samples", type=int, help="samples per shard (default 1000)")
    p.add_argument("--bin-kib", type=int, default=20, help="size of each bin field (KiB)")
    p.add_argument(
        "--loaders",
        default=",".join(LIBRARIES),
        help="comma-separated libraries, or variants (cloudshards+cache; cloudshards+dataloader:\n"
        "torch's own DataLoader(batch_size=...) with the cache, only when named;\n"
        "cloudshards+fsspec: bytes through s3fs/gcsfs, not obstore, only when named)",
    )
    p.add_argument(
        "--setups",
        default="proxy,direct,gcs",
        help="comma-separated among proxy, direct, gcs, moto; both = proxy,direct\n"
        "(default: proxy,direct,gcs; moto: the S3 server the tests use, direct)",
    )
    p.add_argument("--workers", default="0,2", help="DataLoader worker counts (default 0,2)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--latency-s", type=float, default=0.03, help="simulator first-byte delay")
    p.add_argument("--mbps", type=float, default=25.0, help="simulator MB/s per connection")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit for one child")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    p.add_argument("--epochs", type=int, default=2, choices=(1, 2), help="1: cold only")
    p.add_argument(
        "--py-spy",
        type=Path,
        metavar="FILE",
        help="record the first measurement with py-spy (raw format, all threads) into FILE",
    )
    p.add_argument("--gil", action="store_true", help="with --py-spy: GIL holders only")
    p.add_argument("--idle", action="store_true", help="with --py-spy: waiting threads too")
    p.add_argument("--setup-only", action="store_true", help="install the peers and stop")
    p.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="also measure the cloudshards of another checkout (before, before+cache):\n"
        "a change's effect, side by side in one run (git worktree add DIR HEAD~1)",
    )
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.shards = args.shards or (4 if args.quick else 16)
    args.samples = args.samples or (250 if args.quick else 1000)
    names = [x.strip() for x in args.loaders.split(",") if x.strip()]
    labels = {v[0] for v in (*VARIANTS, PLAIN, FSSPEC)}
    if not names or set(names) - set(LIBRARIES) - labels:
        p.error(f"--loaders takes names among {', '.join(sorted(set(LIBRARIES) | labels))}")
    args.variants = [v for v in VARIANTS if v[1] in names or v[0] in names]
    for extra in (PLAIN, FSSPEC):
        if extra[0] in names:
            args.variants.insert(2, extra)
    if args.against is not None:
        if not (args.against / "cloudshards" / "__init__.py").exists():
            p.error(f"--against: no cloudshards checkout at {args.against}")
        args.against = args.against.resolve()
        args.variants[2:2] = AGAINST
    args.setups = [x.strip() for x in args.setups.replace("both", "proxy,direct").split(",")]
    args.setups = [x for x in dict.fromkeys(args.setups) if x]
    if not args.setups or set(args.setups) - set(SETUPS):
        p.error("--setups takes proxy, direct, gcs, moto (comma-separated) or both")
    args.workers = [int(x) for x in args.workers.split(",") if x.strip()]
    if min(args.repeats, args.shards, args.samples, args.bin_kib, args.batch) < 1:
        p.error("--repeats, --shards, --samples, --bin-kib and --batch must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure(log=lambda m: print(m, flush=True))
    found = peer_versions()
    print(f"platform   {platform.platform()}, {os.cpu_count()} cores")
    print(f"children   {python()} (Python {found.pop('python')})")
    for name, version in found.items():
        print(f"{name:<10} {version}")
    print(f"cloudshards {REPO_ROOT} (this checkout)")
    if args.setup_only:
        return 0
    temp = None if args.work else Path(tempfile.mkdtemp(prefix="bench-s3-"))
    work = args.work or temp
    assert work is not None
    args.work = work.resolve()
    for scratch in ("data", "s3rver-data"):  # a reused --work starts empty
        shutil.rmtree(args.work / scratch, ignore_errors=True)
    started = time.perf_counter()
    server = S3rver.start(S3RVER, args.work)
    sim = gcs = gcs_sim = moto = None
    try:
        spec = {"shards": args.shards, "samples": args.samples, "bin_bytes": args.bin_kib * 1024}
        spec |= {"work": str(args.work / "data"), "endpoint": server.url}
        if "gcs" in args.setups:
            gcs = FakeGCS.start(fake_gcs_server(), args.work)
            spec["gcs_endpoint"] = gcs.url
        env = child_env(server.url, {**os.environ, **s3_env(server.url)})
        written, text = run_child("write", spec, env, 1800)
        if written is None:
            print(f"writing the data failed:\n{text}")
            return 1
        print(
            f"data       {args.shards} shards x {args.samples} samples, bin {args.bin_kib} KiB;"
            f" {written['uploaded_bytes'] / 1e6:.0f} MB uploaded in 3 formats to {server.url}"
            + (f"; tar and LitData's to {gcs.url}" if gcs is not None else "")
        )
        print(
            f"repeats    {args.repeats}, order alternating; batch {args.batch}; fresh process each"
        )
        if "moto" in args.setups:
            moto = Moto.start(args.work)
            moto.mirror(server.url)
        if "proxy" in args.setups:
            sim = Simulator(server.url, args.latency_s, args.mbps)
        if gcs is not None:
            gcs_sim = Simulator(gcs.url, args.latency_s, args.mbps)
        cells = {
            (s, w, v[0]): Cell()
            for s in args.setups
            for w in args.workers
            for v in args.variants
            if s != "gcs" or v[1] in GCS_LIBRARIES
        }
        for repeat in range(args.repeats):
            order = args.variants if repeat % 2 == 0 else args.variants[::-1]
            for setup in args.setups:
                endpoint = {"proxy": sim, "gcs": gcs_sim, "moto": moto}.get(setup) or server
                counter = {"direct": f"s3rverlog:{server.log}", "moto": "none:"}.get(
                    setup, f"cloudsim:{endpoint.url}"
                )
                store = "gcs" if setup == "gcs" else "s3"
                for workers in args.workers:
                    for variant in order:
                        cell = cells.get((setup, workers, variant[0]))
                        if cell is None:
                            continue
                        epochs, text = measure(args, variant, workers, endpoint.url, counter, store)
                        if epochs is None:
                            cell.errors.append(text.strip().splitlines()[0])
                            print(f"  {setup:<6} w={workers} {variant[0]:<18} FAILED\n{text}")
                            continue
                        cell.epochs.append(epochs)
                        line = f"  {setup:<6} w={workers} {variant[0]:<18}"
                        for e in epochs:
                            line += f" e{e['epoch']} {e['samples'] / e['seconds']:8,.0f}/s"
                            line += f" {e['cpu_s']:5.1f} cpu-s ({e['sys_s']:4.1f} sys)"
                            line += f" {e['gets']:5d} GETs"
                            if e["mismatch"]:
                                cell.errors.append(f"MISMATCH epoch {e['epoch']}: {e['mismatch']}")
                                line += f" MISMATCH: {e['mismatch']}"
                        print(line, flush=True)
        problems = report(cells, args)
    finally:
        for running in (sim, gcs_sim, gcs, moto):
            if running is not None:
                running.stop()
        server.stop()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    print(f"\ntook {time.perf_counter() - started:.0f} s")
    print("x LD: samples/s as a multiple of LitData's; MB/s: bytes the store sent / cold seconds;")
    print("CPU s/GB: user+system CPU of the child and its workers per GB of bin payload")
    if problems:
        print("\nPROBLEMS:")
        for problem in problems:
            print(f"  - {problem}")
        return 2 if any("MISMATCH" in x for x in problems) else 1
    print("every loader read exactly the expected samples in every epoch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
