"""Building a tar index: scan each shard once with the streaming tar reader.

Part of :mod:`cloudshards.indexed`, which re-exports :func:`build_index`.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from cloudshards.errors import ConfigError, ShardFormatError
from cloudshards.grouping import group_members, make_name_filter
from cloudshards.indexed.format import DatasetIndex, IndexedMember, IndexedSample, ShardIndex
from cloudshards.redact import redact_url
from cloudshards.source import (
    FetchOptions,
    OpenOptions,
    object_etag,
    object_info,
    open_source,
    retry,
)
from cloudshards.tar import iter_members
from cloudshards.tar.decompress import MAGIC_BYTES, compression_of
from cloudshards.types import Member
from cloudshards.urls import expand_urls, protocol_of

__all__ = ["build_index", "scan_shard"]

logger = logging.getLogger(__name__)


class _Location(NamedTuple):
    """Where a member lies; stands in for its data while the grouping rules run."""

    name: str
    header: int  # first byte after the previous member: its headers (PAX, long name) start here
    offset: int
    size: int


class _Head:
    """A stream that remembers its first bytes (to tell a compressed shard from a tar)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.head = b""

    def read(self, size: int, /) -> bytes:
        data: bytes = self._stream.read(size)
        if len(self.head) < MAGIC_BYTES:
            self.head += data[: MAGIC_BYTES - len(self.head)]
        return data


def build_index(
    urls: str | Iterable[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    max_workers: int = 8,
    max_member_bytes: int | None = None,
) -> DatasetIndex:
    """Scan shards and index every sample: key, members (name, data offset, size), byte range.

    Each shard is read once, as one streaming GET (several shards at a time); the grouping
    rules are the streaming reader's own, so the index describes exactly the samples
    :class:`~cloudshards.WebDataset` yields (metadata members skipped, fields lower-cased).

    Args:
        urls: Shard spec (braces, globs, ``::`` lists) or a list of URLs; uncompressed tars.
        storage_options: fsspec options, per protocol or flat.
        max_workers: Shards scanned at the same time.
        max_member_bytes: Largest member accepted (default as for the streaming reader).

    Returns:
        The index, in memory; save it with :func:`write_index`. Bare local paths become
        absolute; URLs stay as given.

    Raises:
        ConfigError: Bad URLs, ``pipe:`` URLs, or ``max_workers`` < 1.
        ShardOpenError: A shard cannot be read.
        ShardFormatError: A shard is corrupt or gzip-compressed (byte offsets inside a gzip
            stream cannot be fetched with a ranged GET).
    """
    if max_workers < 1:
        raise ConfigError(f"max_workers must be >= 1, got {max_workers}")
    shard_urls = expand_urls(urls, storage_options=storage_options)
    if any(protocol_of(url) == "pipe" for url in shard_urls):
        raise ConfigError("pipe: URLs cannot be indexed: indexed reads need ranged GETs")
    # Bare local paths are made absolute, as an index loaded from a file resolves them.
    shard_urls = [url if "://" in url else os.path.abspath(url) for url in shard_urls]
    options = OpenOptions(storage_options=storage_options, max_member_bytes=max_member_bytes)
    fetch = FetchOptions.from_env()
    start = time.perf_counter()
    if max_workers == 1 or len(shard_urls) == 1:
        shards = [scan_shard(url, options, fetch, p) for p, url in enumerate(shard_urls)]
    else:
        with cf.ThreadPoolExecutor(
            min(max_workers, len(shard_urls)), thread_name_prefix="cloudshards-index"
        ) as pool:
            futures = [
                pool.submit(scan_shard, url, options, fetch, p) for p, url in enumerate(shard_urls)
            ]
            try:
                shards = [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    index = DatasetIndex(tuple(shards))
    logger.info(
        "indexed %d shards, %d samples in %.1f s",
        len(shards),
        index.num_samples,
        time.perf_counter() - start,
    )
    return index


def scan_shard(
    url: str, options: OpenOptions, fetch: FetchOptions, position: int | None = None
) -> ShardIndex:
    """Index one shard: its size and store metadata, then every sample's members."""
    size, etag, mtime = _describe(url, options, fetch)
    stream = open_source(url, options, fetch=fetch, shard_index=position)
    try:
        head = _Head(stream)
        samples = list(_samples(head, url, position, options.member_limit()))
        compression = compression_of(head.head)
        if compression is not None:
            raise ShardFormatError(
                f"{compression}-compressed shard: indexed mode needs uncompressed .tar shards "
                f"(offsets inside a {compression} stream cannot be fetched with a ranged GET)",
                url=url,
                shard_index=position,
            )
    finally:
        stream.close()
    if size is None:  # the store did not say: trust the archive's own end
        size = samples[-1].end if samples else 0
    elif samples and samples[-1].end > size:
        raise ShardFormatError(
            f"shard is {size} bytes but its members run to byte {samples[-1].end}",
            url=url,
            shard_index=position,
        )
    logger.debug("indexed %s: %d samples", redact_url(url), len(samples))
    return ShardIndex.from_samples(url, size, samples, etag=etag, mtime=mtime)


def _samples(
    stream: Any, url: str, position: int | None, max_member_bytes: int
) -> Iterator[IndexedSample]:
    members = iter_members(
        stream, url=url, name_filter=make_name_filter(None, None), max_member_bytes=max_member_bytes
    )
    # The streaming reader's grouping function, run on locations instead of bytes, so the
    # index cannot disagree with it about keys, fields, skipped names or duplicates.
    for sample in group_members(_locations(members), url=url, shard_index=position):
        located = [v for k, v in sample.items() if k not in ("__key__", "__url__")]
        last = located[-1]
        yield IndexedSample(
            sample["__key__"],
            located[0].header,
            last.offset + last.size + (-last.size & 511),
            tuple(IndexedMember(loc.name, loc.offset, loc.size) for loc in located),
        )


def _locations(members: Iterable[Member]) -> Iterator[Member]:
    previous_end = 0
    for name, data, offset in members:
        size = len(data)
        yield Member._make((name, _Location(name, previous_end, offset, size), offset))
        previous_end = offset + size + (-size & 511)


def _describe(
    url: str, options: OpenOptions, fetch: FetchOptions
) -> tuple[int | None, str | None, str | None]:
    """Size, ETag and modification time of a shard, from one metadata request."""
    details: dict[str, Any] = retry(
        lambda: object_info(url, options), url=url, offset=0, options=fetch, what="HEAD"
    )
    size = details.get("size")
    etag = object_etag(details) or details.get("md5Hash")
    mtime = (
        details.get("LastModified")
        or details.get("Last-Modified")
        or details.get("updated")
        or details.get("mtime")
    )
    return (
        None if size is None else int(size),
        None if etag is None else str(etag),
        None if mtime is None else str(mtime),
    )
