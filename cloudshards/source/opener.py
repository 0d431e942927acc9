"""``open_source``: the one function that turns a shard URL into a readable byte stream.

Local files and ``pipe:`` commands open where they are. A remote shard is read from the store
(as parallel ranged GETs when the caller lends a thread pool, else as one resumable streaming
GET), or through the node cache, which calls back the store opener made here on a miss.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from functools import partial
from typing import Protocol

from cloudshards.errors import ConfigError
from cloudshards.redact import redact_url
from cloudshards.source.local import check_pipe, is_local
from cloudshards.source.openparts import open_parts, open_sized_parts
from cloudshards.source.options import FetchOptions, OpenOptions
from cloudshards.source.parts import PartStream
from cloudshards.source.plain import open_shard
from cloudshards.source.resumable import open_remote
from cloudshards.source.retries import IOStats, process_stats
from cloudshards.source.stream import EntrySource, ShardSource
from cloudshards.urls import PIPE_PREFIX, secure

__all__ = ["EntrySource", "NodeCache", "ShardSource", "StoreOpener", "open_source"]


#: Opens a remote shard in the store from its start (what the cache calls on a miss).
StoreOpener = Callable[[], ShardSource]


class NodeCache(Protocol):
    """What :func:`open_source` needs of a node cache (:class:`cloudshards.cache.ShardCache`)."""

    def open_entry(
        self,
        url: str,
        options: OpenOptions,
        *,
        shard_index: int | None,
        wait_s: float,
        open_store: StoreOpener | None,
        cancel: threading.Event | None = None,
        keep_bytes: int = 0,
        expect_size: int | None = None,
    ) -> ShardSource: ...

    def join_downloads(self, cancel: threading.Event, timeout: float) -> None: ...

    def download_ahead(
        self,
        url: str,
        options: OpenOptions,
        *,
        shard_index: int | None = None,
        open_store: StoreOpener | None = None,
        cancel: threading.Event | None = None,
        keep_bytes: int = 0,
    ) -> threading.Thread | None: ...


def open_source(
    url: str,
    options: OpenOptions | None = None,
    *,
    fetch: FetchOptions | None = None,
    cache: NodeCache | None = None,
    shard_index: int | None = None,
    executor: cf.ThreadPoolExecutor | None = None,
    stats: IOStats | None = None,
    cancel: threading.Event | None = None,
    size: int | None = None,
    check_size: Callable[[int], None] | None = None,
) -> ShardSource:
    """Open a shard for reading from its start.

    Args:
        url: A local path, ``file://``, any fsspec URL, or (opt-in) ``pipe:CMD``.
        options: Storage options and switches; defaults when None.
        fetch: Part size, concurrency, retries, stall timeout (default: from the environment).
        cache: A node cache: remote shards open through it (a hit, a download it claims, or
            following another process's download).
        shard_index: Position of the shard in the epoch, for error messages.
        executor: A pool for ranged GETs: remote shards are read as parallel ranged parts.
            Without one, as one streaming GET that resumes after failures.
        stats: I/O counters to update (default: this process's).
        cancel: Set when the reader is closed: pending retries stop.
        size: The object's size as known already (an index's), with ``check_size`` called
            on the store's size before any byte is read (it raises to refuse the object). A
            cache entry of another size is taken for an older copy: refetched.

    Raises:
        ShardOpenError: The object is missing, access is denied, or the store failed.
        ConfigError: The URL's protocol is unknown, its backend is missing, or ``pipe:`` is
            not allowed.
        CacheError: Another process holds the cache download but wrote nothing in time.
    """
    options = options or OpenOptions()
    if is_local(url):
        if url.startswith(PIPE_PREFIX):
            check_pipe(url, options)  # refused (WDS_SECURE too) naming the program only
        elif secure():
            raise ConfigError(
                f"{redact_url(url)}: local files are not opened under WDS_SECURE "
                "(webdataset's enforce_security)"
            )
        return open_shard(url, options, shard_index=shard_index)
    fetch = fetch or FetchOptions.from_env()
    store = store_opener(
        url,
        options,
        fetch,
        shard_index=shard_index,
        executor=executor,
        stats=stats,
        cancel=cancel,
        size=size,
        check_size=check_size,
    )
    if cache is not None:
        return cache.open_entry(
            url,
            options,
            shard_index=shard_index,
            wait_s=fetch.reader_wait_s,  # the downloader's first GET, through its tries
            open_store=store,
            cancel=cancel,
            # The reader takes the blocks it reaches from memory; at most a shard's window.
            keep_bytes=fetch.concurrency * fetch.part_bytes,
            expect_size=size,
        )
    return store()


def store_opener(
    url: str,
    options: OpenOptions,
    fetch: FetchOptions,
    *,
    shard_index: int | None = None,
    executor: cf.ThreadPoolExecutor | None = None,
    stats: IOStats | None = None,
    cancel: threading.Event | None = None,
    size: int | None = None,
    check_size: Callable[[int], None] | None = None,
) -> StoreOpener:
    """How a remote shard is opened in the store (see :func:`open_source`)."""
    if executor is None:
        # One resumable streaming GET, with the caller's fetch options (retries, stall
        # timeout), through the cache too: the cache's own default would read the environment's.
        return partial(open_remote, url, options, fetch=fetch, stats=stats, shard_index=shard_index)
    if size is not None:
        return partial(
            open_sized_parts,
            url,
            options,
            fetch,
            executor=executor,
            stats=stats if stats is not None else process_stats(),
            size=size,
            check_size=check_size or _any_size,
            shard_index=shard_index,
        )
    return partial(
        _open_started_parts,
        url,
        options,
        fetch,
        executor=executor,
        stats=stats if stats is not None else process_stats(),
        shard_index=shard_index,
        cancel=cancel,
    )


def _open_started_parts(
    url: str,
    options: OpenOptions,
    fetch: FetchOptions,
    *,
    executor: cf.ThreadPoolExecutor,
    stats: IOStats,
    shard_index: int | None,
    cancel: threading.Event | None,
) -> ShardSource:
    """:func:`open_parts` with its window of ranged GETs put in flight at once (not on the
    first read): a shard opened ahead of its reader, or by a download ahead, fills it."""
    stream = open_parts(
        url, options, fetch, executor=executor, stats=stats, shard_index=shard_index, cancel=cancel
    )
    if isinstance(stream, PartStream):
        stream.start()
    return stream


def _any_size(size: int) -> None:
    del size
