"""Sample counts that dataset tools already write beside tar shards, read instead of counting.

Balanced epochs need each shard's number of samples. Before counting them (a read of the whole
dataset), :func:`counts_from_metadata` looks in each shard directory, in this order, for:

- ``sizes.json``: ``{"shard-000000.tar": 10000, ...}``, shard file name to samples, as
  open_clip's ``get_dataset_size`` and the LAION tooling read it;
- timm's ``_info.json`` (or ``info.json``): ``{"splits": {"train": {"filenames": [...],
  "shard_lengths": [...], ...}}}``, as ``timm.data.readers.reader_wds`` reads it;
- img2dataset's per-shard ``00000_stats.json`` beside ``00000.tar``: its ``successes`` are
  the samples written to that shard.

A file that is missing, unreadable or does not name every shard of its directory is passed
over (the next source is tried); a count that is not a non-negative integer makes the file
unusable. These are small objects: one request per directory, or one per shard for
img2dataset's files (in parallel).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from cloudshards.errors import CloudShardsError
from cloudshards.indexed.files import read_bytes
from cloudshards.indexed.location import parent_url, strip_query

__all__ = ["counts_from_metadata"]

logger = logging.getLogger(__name__)

#: Most per-shard metadata files read at once.
_THREADS = 16

_Options = Mapping[str, Any] | None


def counts_from_metadata(urls: Sequence[str], storage_options: _Options) -> list[int] | None:
    """Samples per shard (in ``urls`` order) from the metadata beside them, or None when some
    shard's directory has none that covers it."""
    directories: dict[str, list[str]] = {}
    for url in urls:
        directories.setdefault(parent_url(url), []).append(url)
    found: dict[str, int] = {}
    for parent, members in directories.items():
        names = {url: strip_query(url).rsplit("/", 1)[-1] for url in members}
        for source in (_sizes_json, _timm_info, _img2dataset_stats):
            table = source(parent, list(names.values()), storage_options)
            if table is not None and all(name in table for name in names.values()):
                what = source.__name__.strip("_")
                logger.info("sample counts of %d shards from their %s", len(members), what)
                found.update((url, table[name]) for url, name in names.items())
                break
        else:
            return None
    return [found[url] for url in urls]


def _read_json(url: str, storage_options: _Options) -> Any:
    """The JSON object at ``url``, or None (missing, unreadable, not JSON)."""
    try:
        data = read_bytes(url, storage_options)
    except CloudShardsError as exc:
        logger.debug("no metadata at %s: %s", url, exc)
        return None
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _counts(pairs: Any) -> dict[str, int] | None:
    """``{name: count}`` from (name, count) pairs, or None if a count is not a count."""
    result: dict[str, int] = {}
    for name, count in pairs:
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return None
        result[str(name).rsplit("/", 1)[-1]] = count
    return result


def _sizes_json(parent: str, names: list[str], storage_options: _Options) -> dict[str, int] | None:
    data = _read_json(f"{parent}/sizes.json", storage_options)
    return _counts(data.items()) if isinstance(data, dict) else None


def _timm_info(parent: str, names: list[str], storage_options: _Options) -> dict[str, int] | None:
    for name in ("_info.json", "info.json"):
        data = _read_json(f"{parent}/{name}", storage_options)
        splits = data.get("splits") if isinstance(data, dict) else None
        if not isinstance(splits, dict):
            continue
        pairs: list[tuple[Any, Any]] = []
        for split in splits.values():
            if isinstance(split, dict):
                files, lengths = split.get("filenames", []), split.get("shard_lengths", [])
                if isinstance(files, list) and isinstance(lengths, list):
                    pairs.extend(zip(files, lengths, strict=False))
        return _counts(pairs)
    return None


def _img2dataset_stats(
    parent: str, names: list[str], storage_options: _Options
) -> dict[str, int] | None:
    def stats_of(name: str) -> Any:
        stem = name[: -len(".tar")] if name.endswith(".tar") else name
        return _read_json(f"{parent}/{stem}_stats.json", storage_options)

    first = stats_of(names[0])  # one probe before asking for every shard's
    if not isinstance(first, dict) or "successes" not in first:
        return None
    with cf.ThreadPoolExecutor(_THREADS, thread_name_prefix="cloudshards-meta") as pool:
        stats = list(pool.map(stats_of, names))
    return _counts(
        (name, one.get("successes") if isinstance(one, dict) else None)
        for name, one in zip(names, stats, strict=True)
    )
