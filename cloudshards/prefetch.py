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
from collections.abc import Callable, Iterable, Iterator
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
from cloudshards.types import ByteSource, ClosingStream
from cloudshards.urls import protocol_of, resolve

__all__ = ["PartStream", "ShardPrefetcher"]

logger = logging.getLogger(__name__)

#: Size of each shard's first ranged GET (the rest use ``part_bytes``): time to first sample.
FIRST_PART_BYTES = 64 << 10

#: Hosts seen answering ranged GETs with whole objects: streamed with one GET from then on.
_UNRANGED_HOSTS: set[str] = set()


def _host_key(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class PartStream(ClosingStream):
    """The bytes of one remote object, fetched as a window of ranged GETs in flight.

    The object's metadata (size, ETag) comes from a lookup sent together with the first ranged
    GET; reading starts as soon as the first part arrives, without waiting for the lookup.

    Attributes:
        size: Object size in bytes (from the store; waits for the lookup), or None if the
            store does not say (the rest after the first part is then streamed).
        details: The store's metadata for the object (ETag etc.).
    """

    def __init__(
        self,
        url: str,
        fs: Any,
        path: str,
        details: dict[str, Any] | cf.Future[dict[str, Any]],
        *,
        executor: cf.ThreadPoolExecutor,
        options: FetchOptions,
        stats: IOStats,
        shard_index: int | None = None,
        cancel: threading.Event | None = None,
        first_part: cf.Future[bytes] | None = None,
        open_tail: Callable[[int], ByteSource] | None = None,
    ) -> None:
        self.url = url
        self.shard_index = shard_index
        if isinstance(details, dict):
            resolved: cf.Future[dict[str, Any]] = cf.Future()
            resolved.set_result(details)
            details = resolved
        self._details = details
        self._fs = fs
        self._path = path
        self._executor = executor
        self._options = options
        self._open_tail = open_tail
        # Per-shard counters; every increment also lands in the process totals.
        self._stats = IOStats(parent=stats)
        self._process_stats = stats
        self._started = time.perf_counter()
        self._cancel_event = cancel
        # The window is filled by the reader and by the lookup's completion callback.
        self._lock = threading.Lock()
        # (future, start, requested length) of the ranged GETs in flight, in order.
        self._window: deque[tuple[cf.Future[bytes], int, int]] = deque()
        self._next_start = 0
        if first_part is not None:
            # Sent together with the size lookup, before the size was known.
            first_length = min(FIRST_PART_BYTES, options.part_bytes)
            self._window.append((first_part, 0, first_length))
            self._next_start = first_length
        self._current = memoryview(b"")
        self._position = 0
        self._tail: ByteSource | None = None
        self.offset = 0
        self.closed = False
        self._fell_back = False

    @property
    def details(self) -> dict[str, Any]:
        if not self._details.done():
            start = time.perf_counter()
            try:
                cf.wait([self._details], timeout=self._options.stall_timeout_s)
            finally:
                self._stats.add(wait_s=time.perf_counter() - start)
            if not self._details.done():
                raise self._stalled()
        return self._details.result()

    @property
    def size(self) -> int | None:
        size = self.details.get("size")
        return None if size is None else int(size)

    def start(self, on_first_part: Callable[[], None] | None = None) -> None:
        """Put the first ``concurrency`` ranged GETs in flight once the size is known; call
        ``on_first_part`` when the first part has arrived (or failed)."""
        self._details.add_done_callback(lambda _: self._fill())
        if on_first_part is not None:
            with self._lock:
                first = self._window[0][0] if self._window else None
            if first is None:
                on_first_part()
            else:
                first.add_done_callback(lambda _: on_first_part())

    def _known_size(self) -> int | None:
        """The size if the lookup succeeded already, else None (never waits)."""
        future = self._details
        if not future.done() or future.cancelled() or future.exception() is not None:
            return None
        size = future.result().get("size")
        return None if size is None else int(size)

    def _fill(self) -> None:
        size = self._known_size()
        if size is None:
            return  # not known yet (the lookup's callback fills), or unknown (streamed)
        options = self._options
        with self._lock:
            # The part being read counts against ``concurrency``: memory stays within
            # (prefetch + 1) x concurrency x part_bytes.
            held = 1 if self._position < len(self._current) else 0
            while (
                not self.closed
                and len(self._window) + held < options.concurrency
                and self._next_start < size
            ):
                start = self._next_start
                end = min(start + options.part_bytes, size)
                self._next_start = end
                future = self._executor.submit(
                    fetch_range,
                    self._fs,
                    self._path,
                    start,
                    end,
                    url=self.url,
                    size=size,
                    options=options,
                    stats=self._stats,
                    cancel=self._cancel_event,
                )
                self._window.append((future, start, end - start))

    def read(self, size: int = -1) -> bytes:
        """Return up to ``size`` bytes (a whole part when ``size`` is -1); ``b""`` at the end."""
        if self._position >= len(self._current):
            self._current = memoryview(b"")  # release the finished part before refilling
            if self._tail is not None:
                return self._read_tail(size)
            data = self._next_part()
            if data is None:
                return b""
            self._current = memoryview(data)
            self._position = 0
            self._fill()
        end = len(self._current) if size < 0 else min(len(self._current), self._position + size)
        data = bytes(self._current[self._position : end])
        self._position = end
        self.offset += len(data)
        return data

    def _next_part(self) -> bytes | None:
        """The next part in order (waiting for it), or None at the end of the object."""
        with self._lock:
            entry = self._window.popleft() if self._window else None
        if entry is None:
            total = self.size  # waits for the lookup
            if total is None:
                return self._start_tail()
            self._fill()
            with self._lock:
                entry = self._window.popleft() if self._window else None
            if entry is None:
                return None
        future, start, requested = entry
        data = self._wait(future)
        if self._fell_back:
            return data
        expected = requested
        if len(data) < requested:
            # Short: the object ends inside this part, or it changed. The lookup decides.
            total = self.size
            expected = requested if total is None else max(0, min(requested, total - start))
            if total is None and start == 0:
                self._next_start = len(data)  # a small object of unknown size: all of it
                return data
        if len(data) != expected:
            raise ShardOpenError(
                f"ranged GET returned {len(data)} bytes, expected {expected} "
                "(the object changed while it was read?)",
                url=self.url,
                shard_index=self.shard_index,
                offset=self.offset,
            )
        return data

    def _start_tail(self) -> bytes | None:
        # No size from the store: after the first part, one resumable streaming GET.
        if self._open_tail is None or self.offset < self._next_start:
            return None
        self._tail = self._open_tail(self.offset)
        return self._read_tail(-1) or None

    def _read_tail(self, size: int) -> bytes:
        assert self._tail is not None
        data = self._tail.read(size)
        self.offset += len(data)
        return data

    def _stalled(self) -> ShardOpenError:
        return ShardOpenError(
            f"stalled: no bytes for {self._options.stall_timeout_s:.0f} s",
            url=self.url,
            shard_index=self.shard_index,
            offset=self.offset,
        )

    def _wait(self, future: cf.Future[bytes]) -> bytes:
        start = time.perf_counter()
        try:
            return future.result(timeout=self._options.stall_timeout_s)
        except cf.TimeoutError:
            raise self._stalled() from None
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
        size = self.size
        if size is not None and len(body) != size:
            raise ShardOpenError(
                f"server ignored Range and sent {len(body)} bytes of a {size}-byte object",
                url=self.url,
                shard_index=self.shard_index,
                offset=self.offset,
            )
        self._fell_back = True
        self._cancel()
        self._next_start = len(body)
        return body[self.offset :]

    def _cancel(self) -> None:
        with self._lock:
            for future, _, _ in self._window:
                future.cancel()
            self._window.clear()

    def close(self) -> None:
        """Cancel the parts not yet started; parts in flight finish and are dropped."""
        if not self.closed:
            self.closed = True
            self._cancel()
            self._details.cancel()
            self._current = memoryview(b"")
            if self._tail is not None:
                self._tail.close()
            record: dict[str, Any] = dict(self._stats.as_dict())
            del record["shards"]
            record.update(
                url=redact_url(self.url),
                size=self._known_size(),
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
            is written, as parallel ranged GETs), or following a download in progress. The
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
        first_bytes = threading.Event()
        first_submitted = False
        ahead: list[threading.Thread] = []  # downloads into the cache, joined at the end
        try:
            while True:
                while len(pending) <= fetch.prefetch:
                    shard = next(self._shards, None)
                    if shard is None:
                        break
                    remote = protocol_of(shard["url"]) not in ("file", "pipe")
                    if self._cache is not None and remote and pending:
                        task = executor.submit(self._download_ahead, shard, executor, ahead)
                        pending.append((shard, task))
                    elif self._fetch_later(shard["url"]):
                        later: cf.Future[Opened | None] = cf.Future()
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
                    opened: Opened | BaseException | None = future.result()
                except Exception as exc:
                    opened = exc
                self._stats.add(wait_s=time.perf_counter() - start)
                yield shard, opened
        finally:
            self._cancel.set()  # in-flight ranged GETs stop retrying
            first_bytes.set()
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
            for thread in ahead:
                thread.join(fetch.stall_timeout_s)

    def _download_ahead(
        self,
        shard: dict[str, Any],
        executor: cf.ThreadPoolExecutor,
        threads: list[threading.Thread],
    ) -> Opened | None:
        """Start downloading a later shard into the node cache (see ShardCache.download_ahead);
        the consumer opens it through the cache, so there is no stream to hand on."""
        assert self._cache is not None
        thread = self._cache.download_ahead(
            shard["url"],
            self._options,
            shard_index=shard.get("shard_index"),
            open_store=lambda: self.open_remote(shard, executor),
            cancel=self._cancel,
        )
        if thread is not None:
            threads.append(thread)
        return None

    def _fetch_later(self, url: str) -> bool:
        """Local files, pipes and cached shards open at consumption time."""
        return self._cache is not None or protocol_of(url) in ("file", "pipe")

    def _open(
        self,
        shard: dict[str, Any],
        executor: cf.ThreadPoolExecutor,
        wait_for: threading.Event | None,
        signal: threading.Event | None,
    ) -> Opened | None:
        """Start fetching one remote shard: its size, then its first ranged GETs.

        Waits for ``wait_for`` (bounded) first; sets ``signal`` when its first bytes are in.
        """
        if wait_for is not None:
            wait_for.wait(self._fetch.stall_timeout_s)
        try:
            stream = self.open_remote(shard, executor)
        except BaseException:
            if signal is not None:
                signal.set()
            raise
        if isinstance(stream, PartStream):
            stream.start(on_first_part=None if signal is None else signal.set)
        elif signal is not None:
            signal.set()
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

        # The first (small) part goes out with the size lookup: one round trip to first byte,
        # and the reader starts on it without waiting for the lookup.
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
        details = executor.submit(
            retry,
            info,
            url=url,
            offset=0,
            options=self._fetch,
            stats=self._stats,
            what="HEAD",
            cancel=self._cancel,
        )
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
            open_tail=lambda offset: self._stream(url, index, start=offset),
        )

    def _stream(self, url: str, index: int | None, *, start: int = 0) -> ResumableStream:
        return open_remote(
            url, self._options, fetch=self._fetch, stats=self._stats, shard_index=index, start=start
        )


def current_thread_count() -> int:
    """Threads started by prefetchers that are still alive (for tests and diagnostics)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("cloudshards"))
