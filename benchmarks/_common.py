"""Shared helpers for the benchmarks: shard generation, timing, medians and tables.

Nothing here imports cloudshards or webdataset at module level, so a benchmark can report a
clear error when one of them is missing.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

#: Name of the file that records what a data directory holds, so ``--data DIR`` can reuse it.
MANIFEST = "manifest.json"

#: Repository root (the parent of ``benchmarks/``).
REPO_ROOT = Path(__file__).resolve().parent.parent


def use_checkout() -> None:
    """Put the repository root first on ``sys.path``.

    The benchmarks measure the cloudshards of the checkout they live in, whether or not it is
    installed (an editable install points to the same files). ``BENCH_CHECKOUT`` names
    another checkout instead (``bench_s3.py --against DIR``: the same benchmark run, two
    versions side by side).
    """
    root = os.environ.get("BENCH_CHECKOUT") or str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


@dataclass(frozen=True)
class Shape:
    """What a synthetic data set looks like."""

    shards: int
    samples_per_shard: int
    bin_bytes: int
    seed: int = 0

    @property
    def samples(self) -> int:
        return self.shards * self.samples_per_shard

    @property
    def payload_bytes(self) -> int:
        return self.samples * self.bin_bytes

    def describe(self) -> str:
        return (
            f"{self.shards} shards x {self.samples_per_shard} samples = {self.samples} samples; "
            f"each sample: bin ({self.bin_bytes // 1024} KiB random) + json (small) + cls; "
            f"~{self.payload_bytes / 2**20:.0f} MiB of payload"
        )


def shard_name(index: int) -> str:
    return f"bench-{index:06d}.tar"


def shard_pattern(data_dir: Path, shape: Shape) -> str:
    """The brace pattern of every shard, e.g. ``/d/bench-{000000..000019}.tar``."""
    if shape.shards == 1:
        return str(data_dir / shard_name(0))
    return str(data_dir / f"bench-{{000000..{shape.shards - 1:06d}}}.tar")


def sample_key(shard: int, index: int) -> str:
    """Keys are unique across the whole data set, so the two libraries' key lists compare."""
    return f"s{shard:06d}_{index:06d}"


def expected_keys(shape: Shape) -> list[str]:
    return [sample_key(s, i) for s in range(shape.shards) for i in range(shape.samples_per_shard)]


def ensure_shards(data_dir: Path, shape: Shape, log: Callable[[str], None] = print) -> float:
    """Write the shards into ``data_dir`` unless a matching set is already there.

    The shards are written with webdataset's own ``TarWriter``, as users' data is: a PAX
    extended header precedes every member. Returns the seconds spent writing (0 when reused).
    """
    import webdataset  # the reference writer; imported here so the error is clear if missing

    data_dir.mkdir(parents=True, exist_ok=True)
    manifest = data_dir / MANIFEST
    if manifest.exists():
        try:
            recorded = json.loads(manifest.read_text())
        except ValueError:
            recorded = None
        if recorded == asdict(shape) and all(
            (data_dir / shard_name(s)).exists() for s in range(shape.shards)
        ):
            log(f"reusing shards in {data_dir}")
            return 0.0
        manifest.unlink()

    log(f"writing {shape.shards} shards to {data_dir} with webdataset.TarWriter ...")
    start = time.perf_counter()
    rng = np.random.default_rng(shape.seed)
    for s in range(shape.shards):
        tmp = data_dir / (shard_name(s) + ".partial")
        with webdataset.TarWriter(str(tmp)) as writer:
            for i in range(shape.samples_per_shard):
                writer.write(
                    {
                        "__key__": sample_key(s, i),
                        "bin": rng.bytes(shape.bin_bytes),
                        "json": {"shard": s, "index": i, "label": f"item {i}"},
                        "cls": i % 10,
                    }
                )
        os.replace(tmp, data_dir / shard_name(s))
    manifest.write_text(json.dumps(asdict(shape)))
    return time.perf_counter() - start


def warm_page_cache(paths: Iterable[Path], block: int = 8 << 20) -> int:
    """Read every file once so neither library pays for a cold disk. Returns bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(block):
                total += len(chunk)
    return total


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    """Run ``fn`` (which returns a sample count); return (count, seconds)."""
    start = time.perf_counter()
    count = fn()
    return count, time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def versions(extra: dict[str, str] | None = None) -> list[str]:
    """Python, platform, core count, torch and numpy versions (plus ``extra``), one per line."""
    lines = [
        f"python     {platform.python_version()} ({platform.python_implementation()})",
        f"platform   {platform.platform()}, {os.cpu_count()} cores",
    ]
    try:
        import torch

        lines.append(f"torch      {torch.__version__}")
    except ImportError:
        lines.append("torch      (not installed)")
    lines.append(f"numpy      {np.__version__}")
    for name, value in (extra or {}).items():
        lines.append(f"{name:<10} {value}")
    return lines


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def fmt_rate(value: float) -> str:
    return "n/a" if value != value else f"{value:,.0f}"  # NaN check without math import
