"""Downloads ahead: a background thread per shard that will be read soon, writing the cache
entry at the store's speed whatever its consumer does (so processes following it never wait)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cloudshards.cache.handoff import Handoff
from cloudshards.cache.keys import entry_name, store_endpoint
from cloudshards.cache.tee import TeeStream
from cloudshards.redact import redact_url
from cloudshards.source import OpenOptions, StoreOpener, is_local

if TYPE_CHECKING:
    from cloudshards.cache.shardcache import ShardCache

__all__ = ["download_ahead"]

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
            skip=0,
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

    handoff = Handoff(keep_bytes)

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
        args=(stream, handoff, cancel, cancelled),
        name="cloudshards-cache-ahead",
        daemon=True,
    )
    stats._ahead[name] = handoff
    thread.start()
    return thread


#: The most one block of a download ahead holds: a whole part of the largest size (parts are
#: handed on as they came, see PartStream.read_view).
_BLOCK_BYTES = 16 << 20


def _download_in_background(
    tee: TeeStream,
    handoff: Handoff,
    cancel: threading.Event | None,
    on_cancelled: Callable[[], None],
) -> None:
    """Read ``tee`` to its end (it writes the entry and commits it), unless cancelled or it
    can no longer be cached (the consumer then streams the shard itself). Every block read
    (already in the partial file) is published to ``handoff`` for this process's reader.

    Cancelled, it stops at once and abandons the partial file (then ``on_cancelled``), however
    little is left: completing it, as closing a consumer's stream does, would go on fetching
    after the iterator was closed, and race the prefetcher shutting its pool down."""
    try:
        while cancel is None or not cancel.is_set():
            block = tee.read_view(_BLOCK_BYTES)
            if not block:
                break
            if tee.partial_dropped:
                tee.handed_back = True  # the consumer streams it, and counts it
                break
            handoff.publish(block)
    except Exception as exc:
        logger.debug("cache: download ahead of %s stopped: %s", redact_url(tee.url), exc)
    finally:
        with contextlib.suppress(Exception):
            if cancel is None or not cancel.is_set():
                tee.close()
            elif tee.cancel():
                on_cancelled()
        handoff.finish()
