"""The ``cloudshards`` command: inspect shards from a terminal. Thin over the public API.

Exit codes: 0 success, 1 a shard or data error, 2 a usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from cloudshards import __version__
from cloudshards.cache import cache_info, clear_cache
from cloudshards.errors import CloudShardsError, ConfigError, ShardError
from cloudshards.grouping import group_members
from cloudshards.redact import redact_text, redact_url
from cloudshards.source import open_shard, shard_size
from cloudshards.tar import iter_members
from cloudshards.urls import expand_urls

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _shown(text: str) -> str:
    """``text`` safe for a terminal, on one line: every character that is not printable (C0
    and C1 controls such as ESC and U+009B CSI, DEL, newlines, bidi and isolate overrides
    such as U+202E) is shown escaped (``\\x1b``, ``\\u202e``), never sent to the terminal.
    Everything the CLI prints that a shard, a store or an error wrote goes through here."""
    if text.isprintable():
        return text
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


def _cmd_ls(args: argparse.Namespace) -> int:
    urls = expand_urls(args.urls)
    total_bytes = 0
    total_samples = 0
    for url in urls:
        size = shard_size(url)
        line = f"{_shown(redact_url(url))}\t{size if size is not None else '?'} bytes"
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


def _cmd_cat(args: argparse.Namespace) -> int:
    from cloudshards.preview import describe

    wanted = set(args.fields.split(",")) if args.fields else None
    shown = 0
    for url in expand_urls(args.urls):
        if args.n is not None and shown >= args.n:
            break
        with open_shard(url) as stream:
            for sample in group_members(iter_members(stream, url=url), url=url):
                if args.n is not None and shown >= args.n:
                    break
                print(f"{_shown(sample['__key__'])}  ({_shown(redact_url(url))})")
                for field, value in sample.items():
                    if field[:2] != "__" and (wanted is None or field in wanted):
                        preview = _shown(describe(field, value, args.width))
                        print(f"  {_shown(field):12s} {len(value):>10,d} B  {preview}")
                shown += 1
    return 0


_WRITE_HELP = """Shard a folder of files or a JSONL manifest into WebDataset tars.

A folder: files are grouped into samples by WebDataset's rule (the key is the path up to the
first dot of the file name: a/x.jpg and a/x.json make sample "a/x"), in sorted key order;
hidden files are skipped. A manifest: one JSON object per line, e.g.
  {"__key__": "x1", "jpg": "images/x1.jpg", "cls": 3, "json": {"w": 640}, "txt": "a dog"}
String values of txt/json/cls-like fields are the content; other strings are paths (relative
to the manifest) or URLs of files to copy in. Shards are published atomically."""

#: Manifest fields whose string values are content, not file paths.
_TEXT_FIELDS = frozenset(
    {
        *("txt", "text", "transcript", "html", "htm", "json", "jsn"),
        *("cls", "cls2", "class", "count", "index", "inx", "id"),
    }
)


def _folder_samples(root: str) -> Iterator[dict[str, Any]]:
    from cloudshards.grouping import split_key

    groups: dict[str, dict[str, str]] = {}
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in files:
            relative = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/")
            parts = None if name.startswith(".") else split_key(relative)
            if parts is None:
                if not name.startswith("."):
                    logger.warning("skipped %s: not a KEY.FIELD file name", relative)
                continue
            groups.setdefault(parts[0], {})[parts[1]] = os.path.join(directory, name)
    for key in sorted(groups):
        fields = groups[key]
        yield {"__key__": key, **{f: _read_file(fields[f]) for f in sorted(fields)}}


def _manifest_samples(path: str) -> Iterator[dict[str, Any]]:
    base = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: not a JSON object: {exc}") from exc
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object per line")
            sample = {"__key__": str(record.pop("__key__", f"{number:09d}"))}
            for field, value in record.items():
                extension = field.rpartition(".")[2].lower()
                if isinstance(value, str) and extension not in _TEXT_FIELDS:
                    where = value if "://" in value else os.path.join(base, value)
                    try:
                        value = _read_file(where)
                    except (OSError, CloudShardsError) as exc:
                        raise ConfigError(f"{path}:{number}: field {field!r}: {exc}") from exc
                sample[field] = value
            yield sample


def _read_file(where: str) -> bytes:
    if "://" in where:
        with open_shard(where) as stream:
            return stream.read()
    with open(where, "rb") as file:
        return file.read()


def _cmd_write(args: argparse.Namespace) -> int:
    from cloudshards.writers import ShardWriter

    if os.path.isdir(args.source):
        samples = _folder_samples(args.source)
    elif os.path.isfile(args.source):
        samples = _manifest_samples(args.source)
    else:
        raise ConfigError(f"no such folder or manifest: {args.source}")
    shards: list[str] = []

    def published(name: str) -> None:
        shards.append(f"{redact_url(name)}\t{sink.count} samples\t{sink.size:,} bytes")

    sink = ShardWriter(
        args.output,
        maxcount=args.maxcount,
        maxsize=args.maxsize,
        start_shard=args.start_shard,
        post=published,
        verbose=0,
        storage_options=_storage_options(args.storage_option),
    )
    with sink, _progress_bar("writing", args.quiet) as bar:
        for sample in samples:
            sink.write(sample)
            bar.update()
    print("\n".join(shards))
    print(f"{sink.total} samples in {len(shards)} shards")
    return 0


def _progress_bar(description: str, quiet: bool) -> Any:
    from tqdm import tqdm

    # disable=None: a bar on a terminal only, so piped output and logs stay clean.
    return tqdm(desc=description, unit=" samples", disable=True if quiet else None, file=sys.stderr)


def _storage_options(items: Sequence[str]) -> dict[str, Any] | None:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--storage-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    return options or None


def _cmd_bench(args: argparse.Namespace) -> int:
    from cloudshards.dataset import WebDataset

    dataset = WebDataset(
        args.urls,
        shardshuffle=False,
        cache_dir=args.cache_dir,
        prefetch=args.prefetch,
        concurrency=args.concurrency,
    )
    start = time.perf_counter()
    samples = 0
    total = 0
    with _progress_bar("reading", args.quiet) as bar:
        for sample in dataset:
            samples += 1
            total += sum(
                len(v) for k, v in sample.items() if isinstance(v, bytes) and k[:2] != "__"
            )
            if samples % 100 == 0:
                bar.update(100)
        bar.update(samples % 100)
    elapsed = time.perf_counter() - start
    stats = dataset.stats()
    io = stats["io"]
    print(
        f"{samples} samples, {total / 1e6:.1f} MB in {elapsed:.2f} s: "
        f"{samples / elapsed:,.0f} samples/s, {total / 1e6 / elapsed:,.1f} MB/s"
    )
    wait = min(io["wait_s"], elapsed)
    print(f"waiting for I/O {wait:.2f} s ({wait / elapsed:.0%}), computing {elapsed - wait:.2f} s")
    print(
        f"{int(io['requests'])} requests, {int(io['retries'])} retries, "
        f"{io['bytes'] / 1e6:.1f} MB from the store"
    )
    if "cache" in stats:
        cache = stats["cache"]
        print(
            f"cache: {int(cache['hits'])} hits, {int(cache['misses'])} downloads, "
            f"{int(cache['waits'])} followed, {int(cache['uncached'])} uncached"
        )
    return 0


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

    from cloudshards.indexed import build_index, default_index_url, write_index

    storage_options = _storage_options(args.storage_option)
    urls = expand_urls(args.urls, storage_options=storage_options)
    index = build_index(urls, storage_options, max_workers=args.workers)
    output = args.output or default_index_url(urls)
    write_index(index, output, storage_options)
    print(f"{redact_url(output)}: {len(index.shards)} shards, {index.num_samples} samples")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloudshards",
        description="Inspect, write and benchmark WebDataset tar shards at any fsspec URL.",
        epilog="exit codes: 0 success, 1 a shard or data error (missing object, corrupt tar, "
        "failed upload), 2 a usage or configuration error. Errors are one line; --debug shows "
        "the traceback.",
    )
    parser.add_argument("--version", action="version", version=f"cloudshards {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    commands = parser.add_subparsers(dest="command", required=True)

    ls = commands.add_parser("ls", help="list shards and their sizes")
    ls.add_argument("urls", help="shard spec, e.g. 's3://bucket/train-{0000..0099}.tar'")
    ls.add_argument("--count", action="store_true", help="also count samples (reads shards)")
    ls.set_defaults(func=_cmd_ls)

    for name, default, what in [("cat", None, "all samples"), ("head", 3, "the first samples")]:
        cat = commands.add_parser(
            name,
            help=f"show {what}: keys, fields, sizes, previews (image WxH, JSON, ...)",
            description=f"Show {what} of a dataset: each field's size and a decoded preview.",
        )
        cat.add_argument("urls", help="shard spec")
        cat.add_argument(
            "-n", type=int, default=default, help=f"most samples (default {default or 'all'})"
        )
        cat.add_argument("--fields", help="comma-separated fields to show (default: all)")
        cat.add_argument("--width", type=int, default=60, help="longest text preview")
        cat.set_defaults(func=_cmd_cat)

    write = commands.add_parser(
        "write",
        help="shard a folder of files or a JSONL manifest into tars at a URL",
        description=_WRITE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    write.add_argument("source", help="a directory, or a .jsonl manifest (one sample per line)")
    write.add_argument("output", help="shard URL pattern, e.g. 's3://bucket/train-%%06d.tar'")
    write.add_argument("--maxcount", type=int, default=10000, help="most samples per shard (10000)")
    write.add_argument(
        "--maxsize", type=float, default=1e9, help="most bytes of data per shard (1e9)"
    )
    write.add_argument("--start-shard", type=int, default=0, help="number of the first shard")
    write.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="fsspec option for the output, repeatable; VALUE is JSON or text",
    )  # fmt: skip
    write.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    write.set_defaults(func=_cmd_write)

    bench = commands.add_parser(
        "bench", help="read a dataset; report samples/s, MB/s, time waiting for I/O, retries"
    )
    bench.add_argument("urls", help="shard spec")
    bench.add_argument("--cache-dir", default=None, help="read through this node cache")
    bench.add_argument("--prefetch", type=int, default=None, help="shards fetched ahead")
    bench.add_argument("--concurrency", type=int, default=None, help="ranged GETs per shard")
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
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
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s" if args.debug else "cloudshards: %(message)s",
    )
    try:
        result: Any = args.func(args)
        return int(result)
    except BrokenPipeError:
        return 0
    except (ConfigError, FileNotFoundError) as exc:
        if args.debug:
            raise
        print(f"cloudshards: error: {_shown(redact_text(str(exc)))}", file=sys.stderr)
        return 1 if isinstance(exc, ShardError) else 2  # a missing shard is not a usage error
    except (CloudShardsError, OSError) as exc:
        if args.debug:
            raise
        print(f"cloudshards: error: {_shown(redact_text(str(exc)))}", file=sys.stderr)
        return 1
    except Exception as exc:  # a backend error we do not know: still one line, exit 1
        if args.debug:
            raise
        message = _shown(redact_text(str(exc)))
        print(f"cloudshards: error: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
