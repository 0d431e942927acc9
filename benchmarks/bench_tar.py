"""Tar parser throughput: cloudshards.tar.iter_members vs the stdlib tarfile module.

Reads in-memory tars, so only the parser is measured: GB/s for large members, members/s for
small ones (written as webdataset's TarWriter writes them: a PAX header before every member).
Prints a table; not a test.

    python benchmarks/bench_tar.py [--large-mib 64] [--small-kib 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import statistics
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cloudshards.tar import iter_members


class Pipe:
    """A non-seekable stream, like a pipe or an HTTP body."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        return self._inner.read(size)

    def readinto(self, view: memoryview) -> int:
        return self._inner.readinto(view)


def make_tar(sizes: Iterable[int], *, pax: bool) -> bytes:
    """Build a tar of random members named ``%06d.bin``; ``pax`` adds a PAX header to each."""
    sizes = list(sizes)
    payload = os.urandom(max(sizes, default=0))
    buffer = io.BytesIO()
    fmt = tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT
    with tarfile.open(fileobj=buffer, mode="w|", format=fmt) as tar:
        for index, size in enumerate(sizes):
            info = tarfile.TarInfo(f"{index:06d}.bin")
            info.size = size
            # A float mtime makes tarfile write a PAX header, as in webdataset's shards.
            info.mtime = time.time() if pax else int(time.time())
            tar.addfile(info, io.BytesIO(payload[:size]))
    return buffer.getvalue()


def read_cloudshards(stream: BinaryIO | Pipe) -> tuple[int, int]:
    count = total = 0
    for member in iter_members(stream):
        count += 1
        total += len(member.data)
    return count, total


def read_tarfile(stream: BinaryIO | Pipe) -> tuple[int, int]:
    count = total = 0
    fileobj: Any = stream  # tarfile's stubs want a full file object; read() is all it uses
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for info in tar:
            if info.isreg():
                extracted = tar.extractfile(info)
                assert extracted is not None
                total += len(extracted.read())
                count += 1
    return count, total


def median_time(
    reader: Callable[[BinaryIO | Pipe], tuple[int, int]],
    make_stream: Callable[[], BinaryIO | Pipe],
    repeat: int,
) -> float:
    """Median wall time of ``repeat`` runs, after one warm-up run."""
    reader(make_stream())
    times = []
    for _ in range(repeat):
        stream = make_stream()
        start = time.perf_counter()
        reader(stream)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--large-mib", type=int, default=64, help="size of each large member")
    parser.add_argument("--large-count", type=int, default=6, help="number of large members")
    parser.add_argument("--small-kib", type=int, default=20, help="size of each small member")
    parser.add_argument("--small-count", type=int, default=20000, help="number of small members")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (median)")
    parser.add_argument("--skip-tarfile", action="store_true", help="time cloudshards only")
    args = parser.parse_args()

    large = make_tar([args.large_mib << 20] * args.large_count, pax=False)
    small = make_tar([args.small_kib << 10] * args.small_count, pax=True)
    small_gz = gzip.compress(small, 1)
    large_label = f"{args.large_count} x {args.large_mib} MiB"
    small_label = f"{args.small_count} x {args.small_kib} KiB, PAX"
    cases: list[tuple[str, Callable[[], BinaryIO | Pipe]]] = [
        (f"{large_label}, BytesIO", lambda: io.BytesIO(large)),
        (f"{large_label}, pipe (no seek)", lambda: Pipe(large)),
        (f"{small_label}, BytesIO", lambda: io.BytesIO(small)),
        (f"{small_label}, gzip -1", lambda: io.BytesIO(small_gz)),
    ]
    readers = [("cloudshards", read_cloudshards)]
    if not args.skip_tarfile:
        readers.append(("tarfile", read_tarfile))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, median of {args.repeat}")
    print(f"{'case':40s} {'reader':12s} {'seconds':>9s} {'GB/s':>7s} {'members/s':>11s}")
    for label, make_stream in cases:
        count, total = read_cloudshards(make_stream())
        for name, reader in readers:
            seconds = median_time(reader, make_stream, args.repeat)
            print(
                f"{label:40s} {name:12s} {seconds:9.4f} {total / seconds / 1e9:7.2f} "
                f"{count / seconds:11,.0f}"
            )


if __name__ == "__main__":
    main()
