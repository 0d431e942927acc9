"""cloudshards vs webdataset 1.0.2 on the same local shards, side by side, in one run.

    python benchmarks/bench_local.py            # 20 shards x 1000 samples, 5 repeats
    python benchmarks/bench_local.py --quick    # 4 shards x 500 samples, 3 repeats

Scenarios (each library runs the same code; only the module differs):
  1. iterate   ``WebDataset(urls, shardshuffle=False)``, counting samples (no decoding)
  2. decode    the same ``.decode().to_tuple("bin", "json", "cls")``
  3. loader    scenario 2 ``.batched(64)`` in ``WebLoader(ds, num_workers=2, batch_size=None)``

The libraries alternate within every repeat, and the one that goes first alternates too
(A B, B A, A B ...), so drift on the machine (thermal, page cache, other jobs) hits both alike.
The table shows the MEDIAN samples/s of each library per scenario and the ratio
cloudshards / webdataset. Both libraries must read exactly the same samples (count, keys,
payload bytes, decoded values); if they do not, the script says where and exits with status 2.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import pstats
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import (
    Shape,
    ensure_shards,
    expected_keys,
    fmt_rate,
    format_table,
    median,
    shard_name,
    shard_pattern,
    timed,
    use_checkout,
    versions,
    warm_page_cache,
)

LIBS = ("webdataset", "cloudshards")
BATCH = 64
WORKERS = 2


@dataclass
class Fingerprint:
    """What a run read: compared between the libraries and against the data set's shape."""

    samples: int = 0
    payload_bytes: int = 0  # sum of len(bin)
    value_sum: int = 0  # sum of cls + json["shard"] + json["index"] (decoding scenarios)
    keys_digest: str = ""  # sha256 of the key sequence (scenario 1)
    keys: list[str] = field(default_factory=list, repr=False)

    def summary(self) -> tuple[int, int, int, str]:
        return (self.samples, self.payload_bytes, self.value_sum, self.keys_digest)


def _digest(keys: Iterable[str]) -> str:
    h = hashlib.sha256()
    for key in keys:
        h.update(key.encode())
        h.update(b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# The scenarios. Each takes the library module and the URL pattern and returns a Fingerprint;
# the caller times it. Bookkeeping inside the loops is the same few operations for both.
# --------------------------------------------------------------------------------------------


def scenario_iterate(wds: ModuleType, urls: str) -> Fingerprint:
    keys: list[str] = []
    append = keys.append
    nbytes = 0
    for sample in wds.WebDataset(urls, shardshuffle=False):
        append(sample["__key__"])
        nbytes += len(sample["bin"])
    return Fingerprint(len(keys), nbytes, 0, _digest(keys), keys)


def _tuple_dataset(wds: ModuleType, urls: str) -> Any:
    return wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("bin", "json", "cls")


def scenario_decode(wds: ModuleType, urls: str) -> Fingerprint:
    n = nbytes = total = 0
    for data, meta, cls in _tuple_dataset(wds, urls):
        n += 1
        nbytes += len(data)
        total += int(cls) + meta["shard"] + meta["index"]
    return Fingerprint(n, nbytes, total)


def scenario_loader(wds: ModuleType, urls: str) -> Fingerprint:
    dataset = _tuple_dataset(wds, urls).batched(BATCH)
    loader = wds.WebLoader(dataset, num_workers=WORKERS, batch_size=None)
    n = nbytes = total = 0
    for datas, metas, classes in loader:
        n += len(datas)
        nbytes += sum(len(d) for d in datas)
        total += int(sum(int(c) for c in classes))
        total += sum(m["shard"] + m["index"] for m in metas)
    return Fingerprint(n, nbytes, total)


@dataclass(frozen=True)
class Scenario:
    number: int
    name: str
    label: str
    run: Callable[[ModuleType, str], Fingerprint]


SCENARIOS = (
    Scenario(1, "iterate", "1 iterate (no decode)", scenario_iterate),
    Scenario(2, "decode", '2 decode + to_tuple("bin","json","cls")', scenario_decode),
    Scenario(3, "loader", f"3 WebLoader {WORKERS} workers, batched({BATCH})", scenario_loader),
)


def expected_fingerprint(shape: Shape, scenario: Scenario) -> Fingerprint:
    """What a correct reader must produce on the synthetic data (see _common.ensure_shards)."""
    keys = expected_keys(shape)
    fp = Fingerprint(shape.samples, shape.payload_bytes)
    if scenario.name == "iterate":
        fp.keys_digest = _digest(keys)
    else:
        per_shard = sum(i % 10 + i for i in range(shape.samples_per_shard))
        fp.value_sum = shape.shards * per_shard + shape.samples_per_shard * sum(range(shape.shards))
    return fp


# --------------------------------------------------------------------------------------------
# Running and reporting
# --------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """All repeats of one library on one scenario."""

    rates: list[float] = field(default_factory=list)
    error: str | None = None
    mismatch: str | None = None


def first_difference(got: list[str], want: list[str]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"position {i}: got key {a!r}, expected {b!r}"
    return f"got {len(got)} keys, expected {len(want)}"


def check(fp: Fingerprint, want: Fingerprint, shape: Shape) -> str | None:
    if fp.summary() == want.summary():
        return None
    problems = []
    if fp.samples != want.samples:
        problems.append(f"{fp.samples} samples, expected {want.samples}")
    if fp.payload_bytes != want.payload_bytes:
        problems.append(f"{fp.payload_bytes} payload bytes, expected {want.payload_bytes}")
    if fp.value_sum != want.value_sum:
        problems.append(f"decoded value sum {fp.value_sum}, expected {want.value_sum}")
    if fp.keys_digest != want.keys_digest:
        if fp.keys and sorted(fp.keys) == expected_keys(shape):
            problems.append("same keys in a different order")
        else:
            problems.append("different keys: " + first_difference(fp.keys, expected_keys(shape)))
    return "; ".join(problems)


def run_scenario(
    scenario: Scenario,
    libs: dict[str, ModuleType],
    urls: str,
    shape: Shape,
    repeats: int,
) -> dict[str, Cell]:
    cells = {name: Cell() for name in libs}
    want = expected_fingerprint(shape, scenario)
    print(f"\nscenario {scenario.label}")
    for r in range(repeats):
        order = list(libs) if r % 2 == 0 else list(reversed(libs))
        for name in order:
            cell = cells[name]
            if cell.error is not None:
                continue
            try:
                fp, seconds = timed(lambda n=name: scenario.run(libs[n], urls))  # type: ignore[misc]
            except Exception as exc:
                cell.error = f"{type(exc).__name__}: {exc}"
                print(f"  repeat {r + 1}/{repeats}  {name:<12} FAILED {cell.error}")
                traceback.print_exc(limit=-4, file=sys.stdout)
                continue
            rate = fp.samples / seconds if seconds > 0 else float("nan")
            cell.rates.append(rate)
            problem = check(fp, want, shape)
            if problem and cell.mismatch is None:
                cell.mismatch = problem
            flag = f"  MISMATCH: {problem}" if problem else ""
            print(
                f"  repeat {r + 1}/{repeats}  {name:<12} {fp.samples:>7} samples "
                f"in {seconds:6.2f} s = {fmt_rate(rate):>8} samples/s{flag}",
                flush=True,
            )
    return cells


def report(results: dict[Scenario, dict[str, Cell]]) -> list[str]:
    """Print the table; return the problems (errors, mismatches) found."""
    header = [
        "scenario",
        "webdataset",
        "cloudshards",
        "cloudshards/webdataset",
    ]
    rows = []
    problems: list[str] = []
    for scenario, cells in results.items():
        row = [scenario.label]
        meds = {}
        for name in LIBS:
            cell = cells.get(name)
            if cell is None:
                row.append("-")
                continue
            if cell.error is not None:
                problems.append(f"scenario {scenario.number}, {name}: {cell.error}")
            if cell.mismatch is not None:
                problems.append(f"scenario {scenario.number}, {name}: read {cell.mismatch}")
            if cell.rates and cell.error is None:
                meds[name] = median(cell.rates)
                row.append(fmt_rate(meds[name]))
            else:
                row.append("error")
        if len(meds) == 2:
            row.append(f"{meds['cloudshards'] / meds['webdataset']:.2f}x")
        else:
            row.append("-")
        rows.append(row)
    print("\nmedian samples/s (higher is better)\n")
    print(format_table(header, rows))
    return problems


def profile_cloudshards(cloudshards: ModuleType, urls: str, top: int) -> None:
    """Profile one cloudshards pass of scenario 1 and print the hottest functions."""
    print(f"\ncProfile of cloudshards, scenario 1 (top {top} by own time)\n")
    profiler = cProfile.Profile()
    profiler.enable()
    scenario_iterate(cloudshards, urls)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    print(out.getvalue().rstrip())


def load_libraries(names: Iterable[str]) -> dict[str, ModuleType]:
    libs: dict[str, ModuleType] = {}
    for name in names:
        try:
            module = __import__(name)
            # A library that imports but lacks the API is as unusable as a missing one.
            for attr in ("WebDataset", "WebLoader"):
                getattr(module, attr)
        except Exception as exc:
            raise SystemExit(f"cannot use {name}: {type(exc).__name__}: {exc}") from exc
        libs[name] = module
    return libs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 shards x 500 samples, 3 repeats")
    p.add_argument("--repeats", type=int, help="timed runs per library and scenario (default 5)")
    p.add_argument("--shards", type=int, help="number of shards (default 20)")
    p.add_argument("--samples", type=int, help="samples per shard (default 1000)")
    p.add_argument("--bin-kib", type=int, default=20, help="size of each bin field (KiB)")
    p.add_argument(
        "--data",
        type=Path,
        help="directory for the shards; reused when it already holds the same data set "
        "(default: a temporary directory, removed at the end)",
    )
    p.add_argument(
        "--scenarios", default="1,2,3", help="comma-separated scenario numbers (default 1,2,3)"
    )
    p.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=25,
        default=0,
        metavar="TOP",
        help="after the table, cProfile one cloudshards pass of scenario 1 (default top 25)",
    )
    p.add_argument(
        "--libs",
        default=",".join(LIBS),
        help="comma-separated libraries to run (default: both; one alone gives no ratio)",
    )
    args = p.parse_args(argv)
    args.libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    if not args.libs or set(args.libs) - set(LIBS):
        p.error(f"--libs takes names among {', '.join(LIBS)}")
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.shards = args.shards or (4 if args.quick else 20)
    args.samples = args.samples or (500 if args.quick else 1000)
    if min(args.repeats, args.shards, args.samples, args.bin_kib) < 1:
        p.error("--repeats, --shards, --samples and --bin-kib must be positive")
    try:
        wanted = {int(x) for x in args.scenarios.split(",") if x.strip()}
    except ValueError:
        p.error("--scenarios takes numbers such as 1,3")
    args.selected = [s for s in SCENARIOS if s.number in wanted]
    if not args.selected:
        p.error(f"no scenario among {[s.number for s in SCENARIOS]}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_checkout()
    # webdataset warns about things the benchmark does on purpose; keep the output readable.
    warnings.filterwarnings("ignore", module="webdataset")
    libs = load_libraries(name for name in LIBS if name in args.libs)

    shape = Shape(args.shards, args.samples, args.bin_kib * 1024)
    extra = {name: f"{getattr(m, '__version__', '?')}  ({m.__file__})" for name, m in libs.items()}
    print("\n".join(versions(extra)))
    print(f"data       {shape.describe()}")
    print(f"repeats    {args.repeats} per library and scenario, order alternating")

    temp_dir = None if args.data else Path(tempfile.mkdtemp(prefix="cloudshards-bench-"))
    data_dir = args.data or temp_dir
    assert data_dir is not None
    try:
        seconds = ensure_shards(data_dir, shape)
        if seconds:
            print(f"wrote the shards in {seconds:.1f} s")
        nbytes = warm_page_cache(data_dir / shard_name(s) for s in range(shape.shards))
        print(f"shards     {nbytes / 2**20:.0f} MiB on disk in {data_dir} (page cache warmed)")
        urls = shard_pattern(data_dir, shape)

        results = {
            scenario: run_scenario(scenario, libs, urls, shape, args.repeats)
            for scenario in args.selected
        }
        problems = report(results)
        if args.profile and "cloudshards" in libs:
            profile_cloudshards(libs["cloudshards"], urls, args.profile)
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)

    if problems:
        print("\nFAILED: the libraries did not read the same data correctly:")
        for problem in problems:
            print(f"  - {problem}")
        return 2
    print(f"\n{' and '.join(libs)} read exactly the expected samples in every scenario")
    return 0


if __name__ == "__main__":
    sys.exit(main())
