"""Balanced epochs: every rank and DataLoader worker yields exactly the same number of samples.

Unequal batch counts hang DDP: the rank that runs out first stops calling all-reduce and the
others wait forever. Splitting *shards* across ranks cannot be equal when shards hold different
numbers of samples, so balanced mode splits the epoch's *sample* sequence instead: the shards in
the epoch's order (identical on every rank) are laid end to end, and consumer ``g`` of ``C``
(rank x workers) takes a contiguous run of ``T // C`` samples ("drop": the ``T % C`` left over
are skipped this epoch) or ``ceil(T / C)`` ("pad": consumers one short repeat their first
sample). Runs are contiguous, so each consumer reads whole shards except at most two partial
ones at its ends, and no sample is delivered twice within an epoch in "drop" mode.

Per-shard sample counts come from an index (``cloudshards index``), from a mapping the user
passes, or from one counting pass over the shards, remembered per node in a counts file.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cloudshards import config, jobcount
from cloudshards.cache import ShardCache
from cloudshards.errors import ConfigError, ShardOpenError
from cloudshards.grouping import is_meta_name, split_key
from cloudshards.redact import redact_url
from cloudshards.shardmeta import counts_from_metadata
from cloudshards.source import FetchOptions, OpenOptions, open_source
from cloudshards.tar import iter_members
from cloudshards.urls import protocol_of

__all__ = [
    "BALANCE_MODES",
    "assign_samples",
    "count_shard_samples",
    "counts_file",
    "observe",
    "observed",
    "resolve_sample_counts",
    "save_counts",
    "saved_counts",
    "seen_file",
]

logger = logging.getLogger(__name__)

BALANCE_MODES = ("drop", "pad")

#: Most shards counted at once when no index exists.
_COUNT_THREADS = 8


def count_shard_samples(
    url: str,
    options: OpenOptions,
    fetch: FetchOptions,
    cache: ShardCache | None = None,
) -> int:
    """Count the samples of one shard by reading its member names (data is skipped: a local
    or cached shard is read header by header; a remote one streams through once)."""
    stream = open_source(url, options, fetch=fetch, cache=cache)
    count = 0
    last_key: str | None = None

    def name_filter(name: str) -> str | None:
        nonlocal count, last_key
        if name.startswith("__") and is_meta_name(name):
            return None
        parts = split_key(name)
        if parts is not None and parts[0] != last_key:
            last_key = parts[0]
            count += 1
        return None  # never copy member data

    try:
        for _ in iter_members(
            stream, url=url, name_filter=name_filter, max_member_bytes=options.member_limit()
        ):
            pass
    finally:
        stream.close()
    return count


def _url_key(url: str) -> str:
    # Hashed: a signed URL's query string must never land in a file.
    key = url
    if protocol_of(url) == "file":
        path = url[len("file://") :] if url.startswith("file://") else url
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            key = f"{url}\0{stat.st_size}\0{stat.st_mtime_ns}"  # a rewritten file is recounted
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def _from_index(
    urls: Sequence[str],
    index: Any,
    storage_options: Mapping[str, Any] | None,
    quiet: bool,
    allow_external: bool,
) -> list[int] | None:
    from cloudshards.indexed import DatasetIndex, default_index_url, load_index

    try:
        loaded = index if isinstance(index, DatasetIndex) else None
        if loaded is None:
            location = str(index) if index is not None else default_index_url(urls)
            loaded = load_index(location, storage_options, allow_external_shards=allow_external)
    except (ShardOpenError, ConfigError, ValueError) as exc:
        if not quiet:
            raise
        logger.debug("no usable index next to the shards (%s)", exc)
        return None
    by_url = {shard.url: shard.num_samples for shard in loaded.shards}
    missing = [url for url in urls if url not in by_url]
    if missing:
        if not quiet:
            raise ConfigError(
                f"the index does not list {len(missing)} of the {len(urls)} shards "
                f"(first: {redact_url(missing[0])}); rebuild it with `cloudshards index`"
            )
        return None
    return [by_url[url] for url in urls]


def resolve_sample_counts(
    urls: Sequence[str],
    *,
    counts: Mapping[str, int] | Sequence[int] | None = None,
    index: Any = None,
    options: OpenOptions | None = None,
    fetch: FetchOptions | None = None,
    cache: ShardCache | None = None,
    allow_external_shards: bool = False,
    count: bool = True,
) -> list[int] | None:
    """Samples per shard, in ``urls`` order (None when ``count`` is False and only a counting
    pass would give them).

    From ``counts`` (a mapping by URL or a list in order) when given; else from ``index`` (a
    :class:`DatasetIndex` or its URL); else from this node's counts file; else from an index
    at the default place next to the shards; else from metadata dataset tools write beside
    shards (``sizes.json``, timm's ``_info.json``, img2dataset's ``*_stats.json``: see
    :mod:`cloudshards.shardmeta`); else by counting once. What the last three find
    is saved in the counts file, under a lock, so the other processes on the node wait and
    reuse it instead of asking the store again. An index file must list its shards inside its
    own location unless ``allow_external_shards`` (see :func:`~cloudshards.load_index`).
    """
    options = options or OpenOptions()
    fetch = fetch or FetchOptions.from_env()
    if counts is not None:
        if isinstance(counts, Mapping):
            missing = [url for url in urls if url not in counts]
            if missing:
                raise ConfigError(f"sample_counts has no entry for {redact_url(missing[0])}")
            return [int(counts[url]) for url in urls]
        if len(counts) != len(urls):
            raise ConfigError(f"sample_counts has {len(counts)} entries for {len(urls)} shards")
        return [int(n) for n in counts]
    if index is not None:  # given explicitly: it wins
        explicit = _from_index(
            urls, index, options.storage_options, quiet=False, allow_external=allow_external_shards
        )
        assert explicit is not None
        return explicit
    path, keys = counts_file(urls)
    # The node's counts file first: every DataLoader worker of every epoch asks, and a local
    # read is free where probing the store for an index is a request (or two) each time.
    saved = _read_counts(path)
    if saved is not None and all(key in saved for key in keys):
        return _shared([int(saved[key]) for key in keys], keys, path)
    with open(str(path) + ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # one process per node looks or counts
        saved = _read_counts(path)
        if saved is not None and all(key in saved for key in keys):
            return _shared([int(saved[key]) for key in keys], keys, path)
        found = _from_index(
            urls, None, options.storage_options, quiet=True, allow_external=allow_external_shards
        )
        if found is None:  # what dataset tools write beside shards (cloudshards.shardmeta)
            found = counts_from_metadata(urls, options.storage_options)
        if found is not None:
            _write_counts(path, dict(zip(keys, found, strict=True)))
            return _shared(found, keys, path)
        if not count:
            return None
        position = jobcount.node_position()
        split = f", this node's 1/{position[1]} of them" if position else ""
        where = "through the node cache" if cache is not None else "once"
        logger.warning(
            "counting the samples of %d shards %s to balance ranks%s (saved in %s); "
            "`cloudshards index` or sample_counts= avoid this pass",
            len(urls),
            where,
            split,
            path.parent,
        )

        def count_some(positions: Sequence[int]) -> list[int]:
            with cf.ThreadPoolExecutor(
                min(_COUNT_THREADS, len(positions)) or 1, thread_name_prefix="cloudshards-count"
            ) as pool:
                return list(
                    pool.map(
                        lambda i: count_shard_samples(urls[i], options, fetch, cache), positions
                    )
                )

        result, _ = jobcount.count_once_per_job(keys, count_some, position=position)
        _write_counts(path, dict(zip(keys, result, strict=True)))
        return result


def _shared(counts: list[int], keys: Sequence[str], path: Path) -> list[int]:
    """``counts``, after offering them to the job's other nodes, once per node and job (see
    :mod:`cloudshards.jobcount`)."""
    jobcount.share_counts(keys, counts, marker=path)
    return counts


def counts_file(urls: Sequence[str]) -> tuple[Path, list[str]]:
    """This node's counts file for ``urls`` and the key of each URL in it (hashed: a signed
    URL's query string never lands in a file)."""
    directory = config.counts_dir()
    directory.mkdir(parents=True, exist_ok=True)
    keys = [_url_key(url) for url in urls]
    name = hashlib.blake2b("\n".join(keys).encode(), digest_size=16).hexdigest()
    return directory / name, keys


def seen_file(path: Path) -> str:
    """Where the counts noted on this node (:func:`observe`) go, beside the counts file at
    ``path``."""
    return str(path) + ".seen"


def observe(path: str, key: str, count: int) -> None:
    """Note that the shard with ``key`` held ``count`` samples (read whole in an epoch without
    counts): one line appended to ``path`` (appends of a line are atomic: no lock)."""
    try:
        with open(path, "a") as handle:
            handle.write(f"{key}\t{count}\n")
    except OSError as exc:
        logger.debug("cannot note a shard's count in %s: %s", path, exc)


def observed(path: str | Path) -> dict[str, int]:
    """The counts noted in ``path`` by :func:`observe`."""
    result: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            key, _, count = line.partition("\t")
            if count.isdigit():
                result[key] = int(count)
    return result


def saved_counts(path: Path) -> dict[str, int]:
    """The counts in the counts file at ``path`` (by key); empty when it has none."""
    return _read_counts(path) or {}


def save_counts(path: Path, counts: Mapping[str, int]) -> None:
    """Add ``counts`` (by key) to the counts file at ``path``, under its lock."""
    with open(str(path) + ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        _write_counts(path, {**(_read_counts(path) or {}), **counts})


def _read_counts(path: Path) -> dict[str, int] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_counts(path: Path, counts: dict[str, int]) -> None:
    try:
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".counts-")
        with os.fdopen(fd, "w") as handle:
            json.dump(counts, handle)
        os.replace(temp, path)
    except OSError as exc:
        logger.warning("cannot save sample counts in %s: %s", path.parent, exc)


def _segments(
    order: list[dict[str, Any]], counts: Mapping[int, int], start: int, end: int
) -> Iterator[dict[str, Any]]:
    """The shard dicts that hold samples ``[start, end)`` of the sequence ``order`` lays end
    to end."""
    position = 0
    for shard in order:
        if position >= end:
            return
        count = counts[shard["shard_index"]]
        lo, hi = max(start, position), min(end, position + count)
        if lo < hi:
            # "count": the reader looks past a segment that ends where the count says the
            # shard does, for a shard rewritten with more samples since it was counted.
            yield {**shard, "skip": lo - position, "take": hi - lo, "count": count}
        position += count


def assign_samples(
    shards: Iterable[dict[str, Any]],
    counts: Mapping[int, int],
    *,
    consumer: int,
    num_consumers: int,
    mode: str,
    limit: int | None = None,
    drop_at: int = -1,
) -> Iterator[dict[str, Any]]:
    """This consumer's part of one epoch: shard dicts with ``skip``/``take`` sample counts.

    Args:
        shards: The epoch's shard dicts in order (with ``shard_index``), the same on every rank.
        counts: Samples per shard index.
        consumer: This consumer's index (``rank * num_workers + worker``).
        num_consumers: Ranks x workers.
        mode: ``"drop"`` (``T // C`` each) or ``"pad"`` (``ceil(T / C)`` each, the consumers
            one short repeating their first sample).
        limit: Use only the first ``limit`` samples of the epoch's sequence (subsampling).
        drop_at: With ``drop``, which sample of its run a consumer that holds one more than
            it takes (the first ``T % C``) leaves out, counted from the run's start, modulo
            the run's length (default: its last). Drawn each epoch, it moves the left-over
            samples, which the shard order alone cannot move with one shard; the shards a
            consumer reads stay the same.
    """
    order = list(shards)
    total = sum(counts[shard["shard_index"]] for shard in order)
    total = total if limit is None else min(total, max(0, limit))
    base, extra = divmod(total, num_consumers)
    start = consumer * base + min(consumer, extra)
    own = base + (1 if consumer < extra else 0)
    take = base if mode == "drop" else own
    wanted = base if mode == "drop" or extra == 0 else base + 1
    gap = drop_at % own if own > take else take  # the sample left out, from ``start``
    runs = [(start, start + gap), (start + gap + 1, start + own)] if own > take else []
    runs = [(lo, hi) for lo, hi in runs if lo < hi] or [(start, start + take)]
    first: dict[str, Any] | None = None
    for begin, end in runs:
        for segment in _segments(order, counts, begin, end):
            first = first or segment
            yield segment
    if wanted > take:
        if first is None:  # fewer samples than consumers: repeat the epoch's first sample
            first = next(({**s, "skip": 0} for s in order if counts[s["shard_index"]] > 0), None)
        if first is not None:
            repeat = {key: value for key, value in first.items() if key != "count"}
            yield {**repeat, "take": wanted - take, "pad": True}
