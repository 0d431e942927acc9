"""Downloads ahead: a background thread per shard that will be read soon, writing the cache
entry at the store's speed whatever its consumer does (so processes following it never wait)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cloudshards import config
from cloudshards.cache.files import open_file
from cloudshards.cache.handoff import Handoff
from cloudshards.cache.keys import entry_name, store_endpoint
from cloudshards.cache.tee import TeeStream
from cloudshards.redact import redact_url
from cloudshards.source import OpenOptions, StoreOpener, is_local

if TYPE_CHECKING:
    from cloudshards.cache.shardcache import ShardCache
    from cloudshards.cache.stats import CacheStats

__all__ = ["download_ahead", "follow_own", "join_downloads", "run_in_background"]

logger = logging.getLogger(__name__)


def download_ahead(
    cache: ShardCache,
    url: str,
    options: OpenOptions,
    *,
    shard_index: int | None = None,
    open_store: StoreOpener | None = None,
    cancel: threading.Event | None = None,
    keep_bytes: int = 0,
) -> threading.Thread | None:
    """Start downloading a shard that will be read soon, in a background thread.

    The thread writes the entry at the store's speed, independently of any consumer; the
    consumer later calls :meth:`ShardCache.open` as usual and reads the growing file (or the
    finished entry), as every other process on the node does, except that up to
    ``keep_bytes`` of the blocks it has not reached yet are handed to it from memory (see
    :mod:`cloudshards.cache.handoff`). Nothing starts (None) when the
    entry is complete, another process is downloading it, the URL is local, or the shard
    cannot be cached (budget, disk): :meth:`ShardCache.open` then handles it as before. A
    failure in the thread abandons the partial file; whoever reads it takes the download over.
    """
    stats = cache.stats
    if is_local(url) or cache.max_bytes is not None or not stats._committed_one or stats._disk_full:
        # Under a byte budget, entries downloaded ahead would compete for room with the
        # ones in use; before this process has cached anything, or once the disk is full,
        # a download ahead may not be cacheable: the consumer downloads those itself.
        return None
    name = entry_name(url, store_endpoint(url, options))
    try:
        cache._ensure_ready()
        if os.path.exists(cache._path("data", name)):
            return None
        lock = cache._claim(name)
    except OSError as exc:  # the consumer opens it as usual, and deals with the disk
        logger.debug("cache: no download ahead of %s: %s", redact_url(url), exc)
        return None
    if lock is None:
        return None
    try:
        # Not counted as uncached when it cannot be cached: the consumer streams it, and counts.
        stream = cache._download(
            url,
            name,
            options,
            shard_index,
            lock,
            open_store=open_store,
            count_uncached=False,
        )
    except Exception as exc:  # the consumer opens it again and reports what fails
        logger.debug("cache: no download ahead of %s: %s", redact_url(url), exc)
        return None
    if not isinstance(stream, TeeStream):  # not cacheable: the consumer streams it
        cache._save_stats()
        stream.close()
        return None
    return run_in_background(cache, name, stream, cancel=cancel, keep_bytes=keep_bytes)[0]


def run_in_background(
    cache: ShardCache,
    name: str,
    stream: TeeStream,
    *,
    cancel: threading.Event | None,
    keep_bytes: int,
    own: bool = False,
) -> tuple[threading.Thread, Handoff]:
    """Read the download ``stream`` of entry ``name`` to its end in a background thread,
    handing its blocks to this process's reader: the handoff returned, also found in
    ``cache.stats._ahead[name]`` by the reader of a download ahead (not ``own``).

    Also what a reader's own download runs as (:meth:`ShardCache.open_entry`), so that the
    processes following it never wait on that reader's pace. Under DDP they would: a rank
    reading the end of a shard whose start another rank downloads waits for bytes which that
    rank's reader, held in a collective by the waiting rank, would not fetch (for 60 s, until
    the follower read them from the store itself)."""
    stats = cache.stats
    handoff = Handoff(keep_bytes)
    handoff.tee = stream

    def cancelled() -> None:
        # Nobody reads a cancelled download ahead: it is no miss, nor a shard streamed
        # uncached (the stream was handed back); a later open of it is no longer this
        # process's own download, and counts as usual.
        if stats._ahead.get(name) is handoff:
            del stats._ahead[name]
        handoff.clear()
        cache._save_stats()

    thread = threading.Thread(
        target=_download_in_background,
        args=(stream, handoff, cancel, cancelled, own),
        name="cloudshards-cache-ahead",
        daemon=True,
    )
    if not own:
        stats._ahead[name] = handoff
    thread.start()
    return thread, handoff


def follow_own(
    cache: ShardCache, name: str, stream: TeeStream, cancel: threading.Event, keep_bytes: int
) -> tuple[int, Handoff] | None:
    """Run a reader's own download ``stream`` in the background (:func:`run_in_background`);
    a descriptor of its partial file, opened first (a full disk may drop the file), and the
    handoff of its blocks, for the reader to follow it. None: the reader reads ``stream``."""
    try:
        fd = open_file(stream.partial, os.O_RDONLY)
    except OSError:
        return None
    thread, handoff = run_in_background(
        cache, name, stream, cancel=cancel, keep_bytes=keep_bytes, own=True
    )
    downloads = cache.stats._downloads
    downloads[:] = [pair for pair in downloads if pair[0].is_alive()]
    downloads.append((thread, cancel))
    return fd, handoff


def join_downloads(stats: CacheStats, cancel: threading.Event, timeout: float) -> None:
    """Wait for the background downloads of readers closed with ``cancel`` (set: they stop
    at their next block), at most ``timeout`` seconds each."""
    downloads = stats._downloads
    for thread, event in list(downloads):
        if event is cancel:
            thread.join(timeout)
    downloads[:] = [pair for pair in downloads if pair[0].is_alive()]


#: A reader's own download runs ahead of it by at most its handoff's ``keep_bytes`` while
#: the reader reads, and to the end once it has read nothing for this long (see Handoff.pace);
#: ``CLOUDSHARDS_CACHE_IDLE_MS`` sets it.
_IDLE_READER_MS = 500

#: The most one block of a download ahead holds: a whole part of the largest size (parts are
#: handed on as they came, see PartStream.read_view).
_BLOCK_BYTES = 16 << 20


def _download_in_background(
    tee: TeeStream,
    handoff: Handoff,
    cancel: threading.Event | None,
    on_cancelled: Callable[[], None],
    own: bool = False,
) -> None:
    """Read ``tee`` to its end (it writes the entry and commits it), unless cancelled or it
    can no longer be cached (the consumer then streams the shard itself). Every block read
    (already in the partial file) is published to ``handoff`` for this process's reader.

    Cancelled, it stops at once and abandons the partial file (then ``on_cancelled``), however
    little is left: completing it, as closing a consumer's stream does, would go on fetching
    after the iterator was closed, and race the prefetcher shutting its pool down.

    ``own``: the download of a reader that follows it now (see :meth:`ShardCache.open_entry`),
    which gets the stream when the disk fills up, and the error when the download fails,
    instead of fetching the shard again."""
    handed = complete = False
    idle_s = config.env_int("CACHE_IDLE_MS", _IDLE_READER_MS) / 1000
    try:
        while (cancel is None or not cancel.is_set()) and not (own and handoff.released):
            if own:
                handoff.pace(idle_s)
            block = tee.read_view(_BLOCK_BYTES)
            if not block:
                complete = True
                break
            if tee.partial_dropped:
                if own:  # the reader streams the rest (counted uncached when it closes it)
                    handed = handoff.hand_over(block, tee)
                else:
                    tee.handed_back = True  # the consumer streams it, and counts it
                break
            handoff.publish(block)
    except Exception as exc:
        logger.debug("cache: download ahead of %s stopped: %s", redact_url(tee.url), exc)
        if own:
            handoff.fail(exc)
    finally:
        with contextlib.suppress(Exception):
            if handed:
                pass  # the reader's to close
            elif own or cancel is None or not cancel.is_set():
                # A reader that stopped early: a small remainder is still fetched and the
                # entry committed, a large one abandoned (see TeeStream.close), as when the
                # reader read its download itself. The prefetcher joins this thread before
                # it shuts the pool these reads use down.
                tee.close()
            elif tee.cancel():
                on_cancelled()
        handoff.finish(complete=complete)
