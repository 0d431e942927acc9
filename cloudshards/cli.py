"""The ``cloudshards`` command: inspect shards from a terminal. Thin over the public API.

Exit codes: 0 success, 1 a shard or data error, 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from cloudshards import __version__
from cloudshards.cache import cache_info, clear_cache
from cloudshards.errors import CloudShardsError, ConfigError
from cloudshards.grouping import group_members
from cloudshards.io import open_shard, shard_size
from cloudshards.redact import redact_text, redact_url
from cloudshards.tar import iter_members
from cloudshards.urls import expand_urls

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _cmd_ls(args: argparse.Namespace) -> int:
    urls = expand_urls(args.urls)
    total_bytes = 0
    total_samples = 0
    for url in urls:
        size = shard_size(url)
        line = f"{redact_url(url)}\t{size if size is not None else '?'} bytes"
        if args.count:
            with open_shard(url) as stream:
                count = sum(1 for _ in group_members(iter_members(stream, url=url), url=url))
            total_samples += count
            line += f"\t{count} samples"
        total_bytes += size or 0
        print(line)
    summary = f"{len(urls)} shards, {total_bytes} bytes"
    if args.count:
        summary += f", {total_samples} samples"
    print(summary)
    return 0


def _preview(value: bytes, width: int) -> str:
    try:
        text = value[:width].decode("utf-8")
        return repr(text) + ("..." if len(value) > width else "")
    except UnicodeDecodeError:
        return f"<{len(value)} bytes>"


def _cmd_head(args: argparse.Namespace) -> int:
    shown = 0
    for url in expand_urls(args.urls):
        with open_shard(url) as stream:
            for sample in group_members(iter_members(stream, url=url), url=url):
                print(f"{sample['__key__']}  ({redact_url(url)})")
                for field, value in sample.items():
                    if not field.startswith("__"):
                        print(f"  {field:12s} {len(value):>10d} B  {_preview(value, 40)}")
                shown += 1
                if shown >= args.n:
                    return 0
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from cloudshards.compat import WebDataset

    dataset = WebDataset(
        args.urls,
        shardshuffle=False,
        cache_dir=args.cache_dir,
        prefetch=args.prefetch,
        concurrency=args.concurrency,
    )
    progress = _progress(args.quiet)
    start = time.perf_counter()
    samples = 0
    total = 0
    for sample in dataset:
        samples += 1
        total += sum(len(v) for k, v in sample.items() if isinstance(v, bytes) and k[:2] != "__")
        if samples % 1000 == 0:
            progress(samples, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    stats = dataset.stats()
    io = stats["io"]
    if not args.quiet:
        print(file=sys.stderr)
    print(
        f"{samples} samples, {total / 1e6:.1f} MB in {elapsed:.2f} s: "
        f"{samples / elapsed:,.0f} samples/s, {total / 1e6 / elapsed:,.1f} MB/s"
    )
    wait = min(io["wait_s"], elapsed)
    print(
        f"waiting for I/O {wait:.2f} s ({wait / elapsed:.0%}), computing "
        f"{elapsed - wait:.2f} s; {int(io['requests'])} requests, {int(io['retries'])} retries, "
        f"{io['bytes'] / 1e6:.1f} MB from the store"
    )
    if "cache" in stats:
        cache = stats["cache"]
        print(
            f"cache: {int(cache['hits'])} hits, {int(cache['misses'])} downloads, "
            f"{int(cache['waits'])} followed, {int(cache['uncached'])} uncached"
        )
    return 0


def _progress(quiet: bool) -> Any:
    def show(samples: int, elapsed: float) -> None:
        if not quiet:
            print(f"\r{samples:,} samples, {samples / elapsed:,.0f}/s", end="", file=sys.stderr)

    return show


def _cmd_cache_info(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.directory):
        raise ConfigError(f"no cache directory at {args.directory}")
    info = cache_info(args.directory)
    print(f"directory: {info['directory']}")
    print(f"entries:   {info['entries']} ({info['bytes']:,} bytes)")
    print(f"partial:   {info['partial']} downloads in flight or interrupted")
    for key, value in sorted(info["counters"].items()):
        print(f"{key + ':':<15s}{value:,}")
    return 0


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.directory):
        raise ConfigError(f"no cache directory at {args.directory}")
    removed = clear_cache(args.directory)
    print(f"removed {removed} entries from {args.directory} (entries in use are kept)")
    return 0


def _cmd_index(args: argparse.Namespace) -> int:
    import json

    from cloudshards.indexed import build_index, default_index_url, write_index

    options: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--storage-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    storage_options = options or None
    urls = expand_urls(args.urls, storage_options=storage_options)
    index = build_index(urls, storage_options, max_workers=args.workers)
    output = args.output or default_index_url(urls)
    write_index(index, output, storage_options)
    print(f"{redact_url(output)}: {len(index.shards)} shards, {index.num_samples} samples")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloudshards", description="Inspect WebDataset tar shards at any fsspec URL."
    )
    parser.add_argument("--version", action="version", version=f"cloudshards {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    commands = parser.add_subparsers(dest="command", required=True)

    ls = commands.add_parser("ls", help="list shards and their sizes")
    ls.add_argument("urls", help="shard spec, e.g. 's3://bucket/train-{0000..0099}.tar'")
    ls.add_argument("--count", action="store_true", help="also count samples (reads shards)")
    ls.set_defaults(func=_cmd_ls)

    head = commands.add_parser("head", help="show the first samples: keys, fields, sizes")
    head.add_argument("urls", help="shard spec")
    head.add_argument("-n", type=int, default=3, help="number of samples (default 3)")
    head.set_defaults(func=_cmd_head)

    bench = commands.add_parser(
        "bench", help="read a dataset; report samples/s, MB/s, time waiting for I/O, retries"
    )
    bench.add_argument("urls", help="shard spec")
    bench.add_argument("--cache-dir", default=None, help="read through this node cache")
    bench.add_argument("--prefetch", type=int, default=None, help="shards fetched ahead")
    bench.add_argument("--concurrency", type=int, default=None, help="ranged GETs per shard")
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    bench.set_defaults(func=_cmd_bench)

    cache = commands.add_parser("cache", help="inspect or clear a per-node shard cache")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    cache_info_parser = cache_commands.add_parser("info", help="entries, bytes and counters")
    cache_info_parser.add_argument("directory", help="the cache directory (cache_dir=)")
    cache_info_parser.set_defaults(func=_cmd_cache_info)
    cache_clear = cache_commands.add_parser("clear", help="remove entries not in use")
    cache_clear.add_argument("directory", help="the cache directory (cache_dir=)")
    cache_clear.set_defaults(func=_cmd_cache_clear)

    index = commands.add_parser("index", help="write a tar index for random access (indexed mode)")
    index.add_argument("urls", nargs="+", help="shard specs (uncompressed .tar)")
    index.add_argument("--output", help="index URL (default: <shard dir>/<name>.index.json)")
    index.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="fsspec option, repeatable; VALUE is JSON or text (endpoint_url=http://...)",
    )  # fmt: skip
    index.add_argument("--workers", type=int, default=8, help="shards scanned at once")
    index.set_defaults(func=_cmd_index)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)
    try:
        result: Any = args.func(args)
        return int(result)
    except BrokenPipeError:
        return 0
    except (ConfigError, FileNotFoundError) as exc:
        if args.debug:
            raise
        print(f"cloudshards: error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    except (CloudShardsError, OSError) as exc:
        if args.debug:
            raise
        print(f"cloudshards: error: {redact_text(str(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:  # a backend error we do not know: still one line, exit 1
        if args.debug:
            raise
        print(f"cloudshards: error: {type(exc).__name__}: {redact_text(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
