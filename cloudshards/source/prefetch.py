"""Shard prefetch: while the consumer parses shard i, shards i+1..i+K (in the consumer's exact
order) are already being fetched, each as a window of ranged GETs (see
:mod:`cloudshards.source.parts`). Memory is bounded by (K + 1) x concurrency x part_bytes
(with a node cache, plus up to concurrency x part_bytes per shard downloaded ahead, held for
its reader: see :mod:`cloudshards.cache.handoff`).
Closing (or garbage-collecting) the iterator cancels what is pending and joins the threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from cloudshards.finalize import close_safely
from cloudshards.source.local import is_local
from cloudshards.source.opener import NodeCache, ShardSource, open_source, store_opener
from cloudshards.source.openparts import open_parts, plan_parts
from cloudshards.source.options import FetchOptions, OpenOptions
from cloudshards.source.parts import PartStream
from cloudshards.source.retries import IOStats, process_stats
from cloudshards.urls import rewrite_url

__all__ = ["ShardPrefetcher", "current_thread_count"]


class ShardPrefetcher:
    """Yield ``(shard, stream_or_error)`` in order, keeping the next shards in flight.

    Every shard is opened here (see :func:`~cloudshards.source.open_source`): remote ones
    ahead of time, local files, pipes and cached shards when the consumer gets to them.

    Args:
        shards: Shard dicts (``{"url": ..., "shard_index": ...}``) in consumer order.
        options: How to open shards (storage options).
        fetch: Prefetch depth, part size, concurrency, retries, stall timeout.
        stats: Counters to update (default: this process's).
        cache: With a node cache, shards open through it when the consumer gets to them: a
            hit, a download it claims itself (streamed through while it is written, as
            parallel ranged GETs), or following a download in progress. The
            shards after the next one are downloaded into the cache ahead, each by a thread
            that writes at the store's speed whatever its consumer does (so other processes
            following it never wait for this one); closing the iterator cancels them.
    """

    def __init__(
        self,
        shards: Iterable[dict[str, Any]],
        *,
        options: OpenOptions,
        fetch: FetchOptions,
        stats: IOStats | None = None,
        cache: NodeCache | None = None,
    ) -> None:
        self._shards = iter(shards)
        self._options = options
        self._fetch = fetch
        self._stats = stats if stats is not None else process_stats()
        self._cache = cache
        self._pool: cf.ThreadPoolExecutor | None = None
        self._cancel = threading.Event()

    def __iter__(self) -> Iterator[tuple[dict[str, Any], ShardSource | BaseException]]:
        fetch = self._fetch
        # Each shard in flight: its opening task (size lookup) plus its ranged GETs.
        workers = (fetch.prefetch + 1) * (fetch.concurrency + 1)
        # Threads start on the first remote shard only: local datasets never create any.
        executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cloudshards")
        pending: deque[tuple[dict[str, Any], cf.Future[ShardSource | None]]] = deque()
        first_bytes = threading.Event()
        first_submitted = False
        ahead: list[threading.Thread] = []  # downloads into the cache, joined at the end
        depth = _Depth(fetch)
        try:
            while True:
                while len(pending) <= depth.now():
                    shard = _rewritten(next(self._shards, None))
                    if shard is None:
                        break
                    remote = not is_local(shard["url"])
                    if remote:
                        depth.remote_url = shard["url"]
                    if self._cache is not None and remote and pending:
                        task = executor.submit(
                            self._download_ahead, shard, executor, ahead, first_bytes
                        )
                        pending.append((shard, task))
                    elif self._fetch_later(shard["url"]):
                        later: cf.Future[ShardSource | None] = cf.Future()
                        later.set_result(None)
                        pending.append((shard, later))
                    else:
                        # The first remote shard goes out alone: the shards after it start
                        # once its first bytes are in, so they do not slow its first sample.
                        if first_submitted:
                            task = executor.submit(self._open, shard, executor, first_bytes, None)
                        else:
                            first_submitted = True
                            task = executor.submit(self._open, shard, executor, None, first_bytes)
                        pending.append((shard, task))
                if not pending:
                    return
                shard, future = pending.popleft()
                start = time.perf_counter()
                try:
                    opened: ShardSource | BaseException | None = future.result()
                except Exception as exc:
                    opened = exc
                self._stats.add(wait_s=time.perf_counter() - start)
                if opened is None:  # opens now: a local file, a pipe, or through the cache
                    try:
                        opened = self._open_now(shard)
                    except Exception as exc:
                        opened = exc
                    # The shards after the first wait for its first bytes (see _download_ahead).
                    if not hasattr(opened, "wait_for_bytes"):
                        first_bytes.set()
                    elif not first_bytes.is_set():
                        executor.submit(self._signal_first_bytes, opened, first_bytes)
                yield _as_given(shard), opened
        finally:
            pool, self._pool = self._pool, None
            close_safely(lambda: self._close(first_bytes, pending, executor, pool, ahead))

    def _close(
        self,
        first_bytes: threading.Event,
        pending: deque[tuple[dict[str, Any], cf.Future[ShardSource | None]]],
        executor: cf.ThreadPoolExecutor,
        pool: cf.ThreadPoolExecutor | None,
        ahead: list[threading.Thread],
    ) -> None:
        """Stop everything in flight and wait for the threads (see :func:`close_safely`)."""
        self._cancel.set()  # in-flight ranged GETs stop retrying
        first_bytes.set()
        for _, future in pending:
            future.cancel()
        # Its readers' own downloads end (see open_entry), before the pool their reads use
        # shuts down; then those of shards whose opening was under way end too.
        for _ in range(2):
            for _, future in pending:
                if future.done() and not future.cancelled() and future.exception() is None:
                    stream = future.result()
                    if stream is not None:
                        stream.close()
            join = getattr(self._cache, "join_downloads", None)  # a cache of the user's may lack it
            if join is not None:
                join(self._cancel, self._fetch.stall_timeout_s)
            executor.shutdown(wait=True, cancel_futures=True)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for thread in ahead:
            thread.join(self._fetch.stall_timeout_s)

    def _download_ahead(
        self,
        shard: dict[str, Any],
        executor: cf.ThreadPoolExecutor,
        threads: list[threading.Thread],
        wait_for: threading.Event,
    ) -> ShardSource | None:
        """Start downloading a later shard into the node cache (see ShardCache.download_ahead);
        the consumer opens it through the cache, so there is no stream to hand on. Waits for
        ``wait_for`` (bounded) first: the first shard's first answer, which the shards
        after it would otherwise slow down (as :meth:`_open` waits without a cache).

        Where nothing is downloaded ahead (before this process's first commit, on a full disk,
        for an entry complete or being downloaded by another process), the shard is opened
        through the cache now instead (never under a byte budget): its bytes are in flight (or
        its hit open) before the consumer gets to it, as without a cache, and still cross the
        network once.
        """
        assert self._cache is not None
        wait_for.wait(self._fetch.stall_timeout_s)
        if self._cancel.is_set():  # closed while it waited: nothing more starts
            return None
        thread = self._cache.download_ahead(
            shard["url"],
            self._options,
            shard_index=shard.get("shard_index"),
            open_store=store_opener(
                shard["url"],
                self._options,
                self._fetch,
                shard_index=shard.get("shard_index"),
                executor=executor,
                stats=self._stats,
                cancel=self._cancel,
            ),
            cancel=self._cancel,
            # The reader takes the blocks it reaches from memory; at most a shard's window.
            keep_bytes=self._fetch.concurrency * self._fetch.part_bytes,
        )
        if thread is not None:
            threads.append(thread)
            return None
        if getattr(self._cache, "max_bytes", None) is not None:
            return None  # under a byte budget, a shard opened ahead would take room in use
        return open_source(
            shard["url"],
            self._options,
            fetch=self._fetch,
            cache=self._cache,
            shard_index=shard.get("shard_index"),
            executor=executor,
            stats=self._stats,
            cancel=self._cancel,
        )

    def _signal_first_bytes(self, opened: Any, signal: threading.Event) -> None:
        """Set ``signal`` once the shard ``opened`` through the cache has its first bytes
        (see FollowStream.wait_for_bytes)."""
        try:
            opened.wait_for_bytes(self._fetch.stall_timeout_s)
        finally:
            signal.set()

    def _fetch_later(self, url: str) -> bool:
        """Local files, pipes and cached shards open at consumption time."""
        return self._cache is not None or is_local(url)

    def _open_now(self, shard: dict[str, Any]) -> ShardSource:
        """Open a shard at consumption time (its ranged GETs, if any, on a pool of their own)."""
        url = shard["url"]
        return open_source(
            url,
            self._options,
            fetch=self._fetch,
            cache=self._cache,
            shard_index=shard.get("shard_index"),
            executor=None if is_local(url) else self._executor(),
            stats=self._stats,
            cancel=self._cancel,
        )

    def _open(
        self,
        shard: dict[str, Any],
        executor: cf.ThreadPoolExecutor,
        wait_for: threading.Event | None,
        signal: threading.Event | None,
    ) -> ShardSource | None:
        """Start fetching one remote shard: its size, then its first ranged GETs.

        Waits for ``wait_for`` (bounded) first; sets ``signal`` when its first bytes are in.
        """
        if wait_for is not None:
            wait_for.wait(self._fetch.stall_timeout_s)
            if self._cancel.is_set():  # closed while it waited: nothing more starts
                return None
        try:
            stream = open_parts(
                shard["url"],
                self._options,
                self._fetch,
                executor=executor,
                stats=self._stats,
                shard_index=shard.get("shard_index"),
                cancel=self._cancel,
            )
        except BaseException:
            if signal is not None:
                signal.set()
            raise
        if isinstance(stream, PartStream):
            stream.start(on_first_part=None if signal is None else signal.set)
        elif signal is not None:
            signal.set()
        return stream

    def _executor(self) -> cf.ThreadPoolExecutor:
        """A pool for ranged GETs opened at consumption time (created on first use)."""
        if self._pool is None:
            fetch = self._fetch
            self._pool = cf.ThreadPoolExecutor(
                max_workers=fetch.concurrency + 1, thread_name_prefix="cloudshards"
            )
        return self._pool


#: Where a shard opened under webdataset's ``GOPEN_REWRITE`` keeps the URL it was given.
_GIVEN_URL = "_given_url"


def _rewritten(shard: dict[str, Any] | None) -> dict[str, Any] | None:
    """``shard`` to open: its URL after ``GOPEN_REWRITE`` (:func:`~cloudshards.urls.rewrite_url`),
    the URL it was given kept for its samples' ``__url__``, as webdataset keeps it."""
    if shard is None:
        return None
    url = rewrite_url(shard["url"])
    return shard if url == shard["url"] else {**shard, "url": url, _GIVEN_URL: shard["url"]}


def _as_given(shard: dict[str, Any]) -> dict[str, Any]:
    """``shard`` as it was given (see :func:`_rewritten`)."""
    if _GIVEN_URL not in shard:
        return shard
    given = {key: value for key, value in shard.items() if key != _GIVEN_URL}
    return {**given, "url": shard[_GIVEN_URL]}


class _Depth:
    """Shards to keep ahead: the fetch settings' ``prefetch``, or fewer once remote shards
    are read and the node's buffer budget, shared with its other processes, holds fewer.

    A shard takes what its parts in flight hold: the plan for the last remote shard's host
    (with adaptive parts, sized from the reader's demand; else the fixed bound).
    """

    def __init__(self, fetch: FetchOptions) -> None:
        self.fetch = fetch
        self.remote_url: str | None = None  # local datasets never touch the node's budget

    def now(self) -> int:
        fetch = self.fetch
        if self.remote_url is None:
            return fetch.prefetch
        from cloudshards.source.budget import node_budget

        plan = plan_parts(self.remote_url, fetch)
        return node_budget().shards_ahead(fetch.prefetch, plan.part_bytes * plan.in_flight)


def current_thread_count() -> int:
    """Threads started by prefetchers that are still alive (for tests and diagnostics)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("cloudshards"))
