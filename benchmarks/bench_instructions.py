"""Instructions per sample of plain iteration over local shards, counted by callgrind.

Wall-clock figures on a shared 2-core machine move by 20% from run to run; instruction counts
do not (callgrind counts the same whatever else the machine does). Use this to tell whether a
change costs the per-sample path anything, comparing checkouts side by side:

    python benchmarks/bench_instructions.py                      # this checkout
    python benchmarks/bench_instructions.py /tmp/old-checkout .  # several (git worktree add ...)

Each checkout is counted twice under ``valgrind --tool=callgrind``: one pass and three passes
over two shards written by ``_common.ensure_shards`` (after the imports and a warm-up pass);
the difference divided by the samples of two passes is what one sample costs. Needs valgrind
and webdataset (to write the shards). Takes ~3 minutes per checkout.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import Shape, ensure_shards, shard_name

CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import torch.utils.data  # the heavy imports, before the passes that are compared
import cloudshards
urls = sys.argv[3:]
sum(1 for _ in cloudshards.WebDataset(urls[:1], shardshuffle=False))  # warm-up
for _ in range(int(sys.argv[2])):
    sum(1 for _ in cloudshards.WebDataset(urls, shardshuffle=False))
"""


def count(checkout: Path, passes: int, urls: list[str], work: Path) -> int:
    """Instructions callgrind counts for the child with ``passes`` passes."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={work}/cg.%p.out",
         sys.executable, "-c", CHILD, str(checkout), str(passes), *urls],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no count from callgrind for {checkout}:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkouts", nargs="*", type=Path, default=[Path(__file__).parents[1]])
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    shape = Shape(shards=2, samples_per_shard=1000, bin_bytes=20 << 10)
    with tempfile.TemporaryDirectory(prefix="bench-instr-") as temp:
        work = Path(temp)
        ensure_shards(work / "data", shape)
        urls = [str(work / "data" / shard_name(i)) for i in range(shape.shards)]
        samples = 2 * shape.samples  # what passes 2 and 3 read
        rows = []
        for checkout in args.checkouts:
            per_sample = (count(checkout, 3, urls, work) - count(checkout, 1, urls, work)) / samples
            rows.append((checkout, per_sample))
            print(f"{checkout}: {per_sample:,.0f} instructions per sample", flush=True)
        base = rows[0][1]
        for checkout, per_sample in rows[1:]:
            print(f"{checkout} vs {rows[0][0]}: {per_sample / base:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
