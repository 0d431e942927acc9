"""A webdataset program, unchanged: real webdataset vs cloudshards' one-line switch.

The program is integration/test_wds_program.py's ``PROGRAM`` (open_clip's way of building
training data from webdataset's submodules: ``url_opener`` + ``tar_file_expander`` + its own
grouping, ``PipelineStage`` subclasses, ``_shuffle``), read through a DataLoader with
``--workers`` workers. Each run is a fresh process; one run of the benchmark measures, in
alternating order:

- webdataset 1.0.2 on local files;
- cloudshards (``install_as_webdataset()`` in front of the same program) on local files;
- cloudshards on ``s3://`` (moto) behind the cloud simulator (integration/cloudsim.py), which
  adds ``--latency-s`` before each request and caps each connection at ``--mbps``.

It prints median samples/s and the ratios to webdataset on local files.

    python benchmarks/bench_wds_program.py [--quick] [--repeats N] [--workers 2]
        [--latency-s 0.03] [--mbps 25]

moto reads a whole object for every ranged GET, so shards are kept small (``--samples``
per shard): the s3 figure is cloudshards over a 30 ms link, not moto's range handling.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _common import (
    REPO_ROOT,
    Shape,
    ensure_shards,
    format_table,
    median,
    shard_name,
    shard_pattern,
    use_checkout,
    versions,
    warm_page_cache,
)

use_checkout()
sys.path.insert(0, str(REPO_ROOT / "integration"))

from cloudsim import CloudSimProcess  # noqa: E402
from servers import S3Server  # noqa: E402
from test_wds_program import PROGRAM  # noqa: E402

BUCKET = "bench-wds-program"

CHILD = """
import sys
import time
{switch}
import torch.utils.data

import wds_program


def main():
    spec, workers = sys.argv[1], int(sys.argv[2])
    loader = torch.utils.data.DataLoader(
        wds_program.make_dataset(spec, 17, "stage"),
        batch_size=None,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    start = time.perf_counter()
    count = 0
    for _ in loader:
        count += 1
    print(count, time.perf_counter() - start)


if __name__ == "__main__":
    main()
"""

SWITCH = "import cloudshards\ncloudshards.install_as_webdataset()"


def write_children(directory: Path) -> None:
    """The program, and one entry script per library (the switch is the only difference)."""
    (directory / "wds_program.py").write_text(PROGRAM)
    (directory / "run_webdataset.py").write_text(textwrap.dedent(CHILD.format(switch="")))
    (directory / "run_cloudshards.py").write_text(textwrap.dedent(CHILD.format(switch=SWITCH)))


def run_child(
    directory: Path, script: str, spec: str, workers: int, env: dict[str, str]
) -> tuple[int, float]:
    """(samples, seconds) of one run in a fresh process."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CLOUDSHARDS_"))}
    environ.update(env)
    result = subprocess.run(
        [sys.executable, script, spec, str(workers)],
        capture_output=True,
        text=True,
        cwd=directory,
        env=environ,
        timeout=1800,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"{script} {spec} failed:\n{result.stderr[-3000:]}")
    count, seconds = result.stdout.split()
    return int(count), float(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 shards x 250 samples, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--samples", type=int, default=250, help="samples per shard")
    parser.add_argument("--latency-s", type=float, default=0.03)
    parser.add_argument("--mbps", type=float, default=25.0, help="per-connection cap, MB/s")
    args = parser.parse_args()
    shape = Shape(4, 250, 20 * 1024) if args.quick else Shape(args.shards, args.samples, 20 * 1024)
    repeats = args.repeats or (2 if args.quick else 3)

    work = Path(tempfile.mkdtemp(prefix="bench-wds-program-"))
    try:
        data = work / "data"
        ensure_shards(data, shape, log=lambda m: print(m, file=sys.stderr))
        warm_page_cache(data / shard_name(i) for i in range(shape.shards))
        write_children(work)
        local_spec = shard_pattern(data, shape)
        moto = S3Server.start(work / "moto", enforce_auth=False)
        try:
            fs = moto.filesystem()
            fs.mkdir(BUCKET)
            names = [shard_name(i) for i in range(shape.shards)]
            fs.put([str(data / n) for n in names], [f"{BUCKET}/{n}" for n in names])
            sim = CloudSimProcess.start(
                moto.endpoint_url, latency_s=args.latency_s, bandwidth_bps=args.mbps * 1e6
            )
            try:
                s3_env = {**moto.env(), "AWS_ENDPOINT_URL": sim.url}
                s3_env["AWS_EC2_METADATA_DISABLED"] = "true"
                s3_spec = f"s3://{BUCKET}/" + Path(local_spec).name
                runs: dict[str, tuple[str, str, dict[str, str]]] = {
                    "webdataset, local": ("run_webdataset.py", local_spec, {}),
                    "cloudshards, local": ("run_cloudshards.py", local_spec, {}),
                    "cloudshards, s3 (sim)": ("run_cloudshards.py", s3_spec, s3_env),
                }
                results: dict[str, list[tuple[int, float]]] = {name: [] for name in runs}
                for repeat in range(repeats):
                    order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
                    for name in order:
                        script, spec, env = runs[name]
                        results[name].append(run_child(work, script, spec, args.workers, env))
                        print(f"  {name}: {results[name][-1]}", file=sys.stderr)
            finally:
                sim.stop()
        finally:
            moto.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for name, measured in results.items():
        counts = {count for count, _ in measured}
        if counts != {shape.samples}:
            print(f"{name} read {counts} samples, expected {shape.samples}")
            return 2
    rate = {name: median([c / s for c, s in measured]) for name, measured in results.items()}
    base = rate["webdataset, local"]
    print("\n".join(versions()))
    print(f"data: {shape.describe()}")
    print(
        f"program: integration/test_wds_program.py PROGRAM, DataLoader with {args.workers} "
        f"workers (fork); s3: moto behind the cloud simulator, {args.latency_s * 1000:.0f} ms "
        f"before each request, {args.mbps:.0f} MB/s per connection; {repeats} repeats, medians"
    )
    rows = [[name, f"{rate[name]:,.0f}", f"{rate[name] / base:.2f}x"] for name in results]
    print(format_table(["run", "samples/s", "vs webdataset local"], rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
