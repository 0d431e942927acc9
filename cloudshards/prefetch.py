"""Shard prefetch and parallel ranged reads for remote stores.

While the consumer parses shard i, shards i+1..i+K (in the consumer's exact order) are already
being fetched; each remote shard is read as a window of ``concurrency`` ranged GETs of
``part_bytes``, handed on in order as soon as the next part is complete. Memory is bounded by
(K + 1) x concurrency x part_bytes. Closing (or garbage-collecting) the iterator cancels what
is pending and joins the threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

from cloudshards import fetch as fetch_module
from cloudshards.cache import ShardCache
from cloudshards.errors import ShardOpenError
from cloudshards.fetch import (
    FetchOptions,
    IOStats,
    RangeIgnoredError,
    ResumableStream,
    fetch_range,
    open_remote,
    retry,
)
from cloudshards.io import OpenOptions, ShardStream
from cloudshards.redact import redact_url
from cloudshards.urls import protocol_of, resolve

__all__ = ["PartStream", "ShardPrefetcher"]

logger = logging.getLogger(__name__)

#: Size of each shard's first ranged GET (the rest use ``part_bytes``): time to first sample.
FIRST_PART_BYTES = 256 << 10

#: Hosts seen answering ranged GETs with whole objects: streamed with one GET from then on.
_UNRANGED_HOSTS: set[str] = set()


def _host_key(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class PartStream:
    """The bytes of one remote object, fetched as a window of ranged GETs in flight.

    Attributes:
        size: Object size in bytes (from the store).
        details: The store's metadata for the object (ETag etc.).
    """

    def __init__(
        self,
        url: str,
        fs: Any,
        path: str,
        details: dict[str, Any],
        *,
        executor: cf.ThreadPoolExecutor,
        options: FetchOptions,
        stats: IOStats,
        shard_index: int | None = None,
        cancel: threading.Event | None = None,
        first_part: cf.Future[bytes] | None = None,
    ) -> None:
        self.url = url
        self.shard_index = shard_index
        self.details = details
        self.size = int(details["size"])
        self._fs = fs
        self._path = path
        self._executor = executor
        self._options = options
        # Per-shard counters; every increment also lands in the process totals.
        self._stats = IOStats(parent=stats)
        self._process_stats = stats
        self._started = time.perf_counter()
        self._cancel_event = cancel
        # (future, expected length) of the ranged GETs in flight, in order.
        self._window: deque[tuple[cf.Future[bytes], int]] = deque()
        self._next_start = 0
        if first_part is not None:
            # Sent together with the size lookup, before the size was known.
            first_length = min(FIRST_PART_BYTES, options.part_bytes, self.size)
            if first_length:
                self._window.append((first_part, first_length))
            else:
                first_part.cancel()
            self._next_start = first_length
        self._current = memoryview(b"")
        self._position = 0
        self.offset = 0
        self.closed = False
        self._fell_back = False

    def start(self) -> None:
        """Put the first ``concurrency`` ranged GETs in flight (reading starts them anyway)."""
        self._fill()

    def _fill(self) -> None:
        options = self._options
        # The part being read counts against ``concurrency``: memory stays within
        # (prefetch + 1) x concurrency x part_bytes.
        held = 1 if self._position < len(self._current) else 0
        while len(self._window) + held < options.concurrency and self._next_start < self.size:
            start = self._next_start
            # A small first part: the tar reader can start before a whole part has arrived.
            part = FIRST_PART_BYTES if start == 0 else options.part_bytes
            end = min(start + min(part, options.part_bytes), self.size)
            self._next_start = end
            future = self._executor.submit(
                fetch_range,
                self._fs,
                self._path,
                start,
                end,
                url=self.url,
                size=self.size,
                options=options,
                stats=self._stats,
                cancel=self._cancel_event,
            )
            self._window.append((future, end - start))

    def read(self, size: int = -1) -> bytes:
        """Return up to ``size`` bytes (a whole part when ``size`` is -1); ``b""`` at the end."""
        if self._position >= len(self._current):
            self._current = memoryview(b"")  # release the finished part before refilling
            self._fill()
            if not self._window:
                return b""
            future, expected = self._window.popleft()
            data = self._wait(future)
            if len(data) != expected and not self._fell_back:
                raise ShardOpenError(
                    f"ranged GET returned {len(data)} bytes, expected {expected} "
                    "(the object changed while it was read?)",
                    url=self.url,
                    shard_index=self.shard_index,
                    offset=self.offset,
                )
            self._current = memoryview(data)
            self._position = 0
            self._fill()
        end = len(self._current) if size < 0 else min(len(self._current), self._position + size)
        data = bytes(self._current[self._position : end])
        self._position = end
        self.offset += len(data)
        return data

    def _wait(self, future: cf.Future[bytes]) -> bytes:
        start = time.perf_counter()
        try:
            return future.result(timeout=self._options.stall_timeout_s)
        except cf.TimeoutError:
            raise ShardOpenError(
                f"stalled: no bytes for {self._options.stall_timeout_s:.0f} s",
                url=self.url,
                shard_index=self.shard_index,
                offset=self.offset,
            ) from None
        except RangeIgnoredError as exc:
            return self._fall_back(exc.body)
        finally:
            self._stats.add(wait_s=time.perf_counter() - start)

    def _fall_back(self, body: bytes) -> bytes:
        # The server sent the whole object for a ranged GET: never splice parts from it.
        # Serve the rest of this shard from that body and stream later shards of this host.
        host = _host_key(self.url)
        if host not in _UNRANGED_HOSTS:
            _UNRANGED_HOSTS.add(host)
            logger.warning(
                "%s ignores Range requests; streaming its shards with one GET each",
                redact_url(host),
            )
        if len(body) != self.size:
            raise ShardOpenError(
                f"server ignored Range and sent {len(body)} bytes of a {self.size}-byte object",
                url=self.url,
                shard_index=self.shard_index,
                offset=self.offset,
            )
        self._fell_back = True
        self._cancel()
        self._next_start = self.size
        return body[self.offset :]

    def _cancel(self) -> None:
        for future, _ in self._window:
            future.cancel()
        self._window.clear()

    def close(self) -> None:
        """Cancel the parts not yet started; parts in flight finish and are dropped."""
        if not self.closed:
            self.closed = True
            self._cancel()
            self._current = memoryview(b"")
            record: dict[str, Any] = dict(self._stats.as_dict())
            del record["shards"]
            record.update(
                url=redact_url(self.url),
                size=self.size,
                delivered=self.offset,
                seconds=time.perf_counter() - self._started,
            )
            self._process_stats.per_shard.append(record)
            logger.debug("shard done: %s", record)


Opened = ShardStream | PartStream | ResumableStream


class ShardPrefetcher:
    """Yield ``(shard, stream_or_error)`` in order, keeping the next shards in flight.

    Args:
        shards: Shard dicts (``{"url": ..., "shard_index": ...}``) in consumer order.
        options: How to open shards (storage options).
        fetch: Prefetch depth, part size, concurrency, retries, stall timeout.
        stats: Counters to update (default: this process's).
        cache: With a node cache, shards are yielded as None and the consumer opens them
            through the cache: a hit, a download it claims itself (streamed through while it
            is written, as parallel ranged GETs), or following another process's download.
            Fetching ahead into the cache is not done yet: a claim held for a consumer that is
            still busy elsewhere could make processes wait on each other.
    """

    def __init__(
        self,
        shards: Iterable[dict[str, Any]],
        *,
        options: OpenOptions,
        fetch: FetchOptions,
        stats: IOStats | None = None,
        cache: ShardCache | None = None,
    ) -> None:
        self._shards = iter(shards)
        self._options = options
        self._fetch = fetch
        self._stats = stats if stats is not None else fetch_module.process_stats()
        self._cache = cache
        self._pool: cf.ThreadPoolExecutor | None = None
        self._cancel = threading.Event()

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Opened | BaseException | None]]:
        fetch = self._fetch
        # Each shard in flight: its opening task (size lookup) plus its ranged GETs.
        workers = (fetch.prefetch + 1) * (fetch.concurrency + 1)
        # Threads start on the first remote shard only: local datasets never create any.
        executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cloudshards")
        pending: deque[tuple[dict[str, Any], cf.Future[Opened | None]]] = deque()
        try:
            while True:
                while len(pending) <= fetch.prefetch:
                    shard = next(self._shards, None)
                    if shard is None:
                        break
                    if self._fetch_later(shard["url"]):
                        later: cf.Future[Opened | None] = cf.Future()
                        later.set_result(None)
                        pending.append((shard, later))
                    else:
                        pending.append((shard, executor.submit(self._open, shard, executor)))
                if not pending:
                    return
                shard, future = pending.popleft()
                start = time.perf_counter()
                try:
                    opened: Opened | BaseException | None = future.result()
                except Exception as exc:
                    opened = exc
                self._stats.add(wait_s=time.perf_counter() - start)
                yield shard, opened
        finally:
            self._cancel.set()  # in-flight ranged GETs stop retrying
            for _, future in pending:
                future.cancel()
                if future.done() and not future.cancelled() and future.exception() is None:
                    stream = future.result()
                    if stream is not None:
                        stream.close()
            executor.shutdown(wait=True, cancel_futures=True)
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def _fetch_later(self, url: str) -> bool:
        """Local files, pipes and cached shards open at consumption time."""
        return self._cache is not None or protocol_of(url) in ("file", "pipe")

    def _open(self, shard: dict[str, Any], executor: cf.ThreadPoolExecutor) -> Opened | None:
        """Start fetching one remote shard: its size, then its first ranged GETs."""
        stream = self.open_remote(shard, executor)
        if isinstance(stream, PartStream):
            stream.start()
        return stream

    def executor(self) -> cf.ThreadPoolExecutor:
        """A pool for ranged GETs opened at consumption time (created on first use)."""
        if self._pool is None:
            fetch = self._fetch
            self._pool = cf.ThreadPoolExecutor(
                max_workers=fetch.concurrency + 1, thread_name_prefix="cloudshards"
            )
        return self._pool

    def open_remote(self, shard: dict[str, Any], executor: cf.ThreadPoolExecutor) -> Opened:
        """Look up the shard's size and start its first ranged GETs."""
        url = shard["url"]
        index = shard.get("shard_index")
        self._stats.add(shards=1)
        if _host_key(url) in _UNRANGED_HOSTS:
            return self._stream(url, index)
        fs, path = resolve(url, self._options.storage_options)

        def info() -> dict[str, Any]:
            self._stats.add(requests=1)
            details: dict[str, Any] = fs.info(path)
            return details

        # The first (small) part goes out with the size lookup: one round trip to first byte.
        first = executor.submit(
            fetch_range,
            fs,
            path,
            0,
            min(FIRST_PART_BYTES, self._fetch.part_bytes),
            url=url,
            size=None,
            options=self._fetch,
            stats=self._stats,
            cancel=self._cancel,
        )
        try:
            details = retry(
                info, url=url, offset=0, options=self._fetch, stats=self._stats, what="HEAD"
            )
        except BaseException:
            first.cancel()
            raise
        if details.get("size") is None:
            # No size (some HTTP servers): one streaming GET instead of ranged parts.
            first.cancel()
            return self._stream(url, index)
        return PartStream(
            url,
            fs,
            path,
            details,
            executor=executor,
            options=self._fetch,
            stats=self._stats,
            shard_index=index,
            cancel=self._cancel,
            first_part=first,
        )

    def _stream(self, url: str, index: int | None) -> ResumableStream:
        return open_remote(
            url, self._options, fetch=self._fetch, stats=self._stats, shard_index=index
        )


def current_thread_count() -> int:
    """Threads started by prefetchers that are still alive (for tests and diagnostics)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("cloudshards"))
