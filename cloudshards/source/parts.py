"""Remote shards read as a window of parallel ranged GETs, handed on in order.

Each remote shard is read as ``concurrency`` ranged GETs of ``part_bytes`` in flight, the next
part handed on as soon as it is complete; the size lookup goes out together with the first
(small) part. A host that answers ranged GETs with whole objects is streamed from then on.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from cloudshards import config
from cloudshards.errors import ShardOpenError
from cloudshards.redact import redact_url
from cloudshards.source import adapt
from cloudshards.source.adapt import FIRST_PART_BYTES
from cloudshards.source.options import FetchOptions
from cloudshards.source.remote import object_etag
from cloudshards.source.retries import IOStats, LinkedEvent, RangeIgnoredError
from cloudshards.source.stream import ShardSource
from cloudshards.source.transport import IfMatch, StoreObject, fetch_range
from cloudshards.types import ClosingStream

__all__ = ["FIRST_PART_BYTES", "PartStream"]

#: How often a wait for the object's size looks whether the reader was closed.
_CANCEL_CHECK_S = 0.1

# The logger's name from before the module moved: logging configurations name it.
logger = logging.getLogger("cloudshards.prefetch")


_UNRANGED_HOSTS = adapt.UNRANGED_HOSTS


class PartStream(ClosingStream):
    """The bytes of one remote object, fetched as a window of ranged GETs in flight. The
    object's metadata (size, ETag: :attr:`details`) comes with the first ranged GET, or from a
    lookup sent with it; reading starts as soon as the first part arrives. :attr:`size` is
    None when the store does not say (the rest after the first part is then streamed).
    """

    def __init__(
        self,
        source: StoreObject,
        details: dict[str, Any] | cf.Future[dict[str, Any]],
        *,
        executor: cf.ThreadPoolExecutor,
        options: FetchOptions,
        stats: IOStats,
        shard_index: int | None = None,
        cancel: threading.Event | None = None,
        first_part: cf.Future[Any] | None = None,
        open_tail: Callable[[int], ShardSource] | None = None,
        plan: adapt.PartPlan | None = None,
    ) -> None:
        self.url = source.url
        self.shard_index = shard_index
        if isinstance(details, dict):
            resolved: cf.Future[dict[str, Any]] = cf.Future()
            resolved.set_result(details)
            details = resolved
        self._details = details
        self._source = source
        self._executor = executor
        self._options = options
        self._wait_s = options.reader_wait_s
        # CLOUDSHARDS_IF_MATCH=0: for HTTP replicas behind one name whose ETags differ (an
        # mtime-based ETag on each host) while their bytes are the same.
        self._if_match = config.env_bool("IF_MATCH", True)
        self._if_match_state: IfMatch | None = None
        self._plan = plan or adapt.fixed_plan(options.part_bytes, options.concurrency)
        # adapt's probe: this shard's second part goes out alone (no other large GET of the host)
        self._probing, self._probe_sent = self._plan.probe, False
        self._open_tail = open_tail
        # Per-shard counters; every increment also lands in the process totals.
        self._stats = IOStats(parent=stats)
        self._process_stats = stats
        self._started = time.perf_counter()
        self._cancel_event = LinkedEvent(cancel)  # set when this shard's reading is over
        # The window is filled by the reader and by the lookup's completion callback.
        self._lock = threading.Lock()
        # (future, start, requested length) of the ranged GETs in flight, in order.
        self._window: deque[tuple[cf.Future[Any], int, int]] = deque()
        self._next_start = 0
        if first_part is not None:
            # Sent together with the size lookup, before the size was known.
            first_length = self._plan.first_bytes
            self._window.append((first_part, 0, first_length))
            self._next_start = first_length
        self._current = memoryview(b"")
        # The part ``_current`` views: handed on whole, without a copy.
        self._part: bytes | memoryview = b""
        self._position = 0
        self._tail: ShardSource | None = None
        self._failure: ShardOpenError | None = None  # raised once the bytes before it are read
        self.offset = 0
        self.closed = False
        self._fell_back = False
        # The reader's own time on this shard, for the demand that sizes the next windows:
        # when it first read, when it last got bytes, and how long it waited for them.
        self._read_began: float | None = None
        self._read_last = 0.0
        self._read_waited = 0.0

    @property
    def details(self) -> dict[str, Any]:
        if not self._details.done():
            start = time.perf_counter()
            deadline = start + self._wait_s
            try:
                # In slices: a reader closed meanwhile (its prefetcher cancels, then shuts its
                # pool down, which may drop the lookup before it runs) stops the wait at once.
                while not self._details.done() and time.perf_counter() < deadline:
                    left = deadline - time.perf_counter()
                    cf.wait([self._details], timeout=max(0.0, min(_CANCEL_CHECK_S, left)))
                    if self._cancel_event.is_set() and not self._details.done():
                        raise ShardOpenError(self._cancel_event.why(), url=self.url)
            finally:
                self._stats.add(wait_s=time.perf_counter() - start)
            if not self._details.done():
                raise self._failed()
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
        details = future.result()  # no parts after a whole-object answer: all are the object
        size = None if details.get("range_ignored") else details.get("size")
        return None if size is None else int(size)

    def _condition(self) -> IfMatch | None:
        """The object's strong ETag from its first answer, which every later part must match
        (a weak ``W/`` one never matches If-Match), shared by the parts; None without one."""
        if self._if_match_state is None and self._details.done():
            etag = object_etag(self.details) if self._if_match else None
            strong = isinstance(etag, str) and etag and not etag.startswith("W/")
            self._if_match_state = IfMatch(etag if strong else None)
        return self._if_match_state

    def _fill(self) -> None:
        size = self._known_size()
        if size is None:
            if self._details.done():
                self._end_probe()  # no size (streamed) or no object: nothing to measure
            return  # not known yet (the lookup's callback fills), or unknown (streamed)
        if self._probing and not self._probe_sent:
            if time.perf_counter() - self._started > adapt.PROBE_FIRST_BYTE_S:
                self._end_probe()  # a store this far away: the probe would cost a part's time
            elif size - self._next_start < adapt.LARGE:
                self._end_probe(spare=True)  # too small to measure: the next shard probes
        plan, probe = self._plan, None
        with self._lock:
            # The part being read counts against the parts in flight: memory stays within
            # (prefetch + 1) x concurrency x part_bytes (a plan's parts x size never exceed it).
            held = 1 if self._position < len(self._current) else 0
            most = plan.in_flight
            if self._probing:
                most = 0 if self._probe_sent else len(self._window) + held + 1
            elif adapt.wait_for_probe(self.url, self._fill):
                most = 0  # another shard's probe (a reader with nothing to read waits for it)
            while self._failure is None and not self.closed and self._next_start < size:
                if len(self._window) + held >= most:
                    break
                end = min(self._next_start + plan.part_bytes, size)
                future = self._submit(self._next_start, end)
                if future is None:
                    break
                if self._probing:
                    self._probe_sent, probe = True, future
                    adapt.probe_sent(self.url)
        if probe is not None:  # outside the lock: a part done already calls back at once
            probe.add_done_callback(self._end_probe)
        elif self._probing and not self._probe_sent:
            self._end_probe()  # a shard of one part, or closed: no probe

    def _submit(self, start: int, end: int) -> cf.Future[Any] | None:
        """Put ``[start, end)`` in flight at the window's end (lock held); None once closed."""
        try:
            future = self._executor.submit(
                fetch_range,
                self._source,
                start,
                end,
                size=self._known_size(),
                options=self._options,
                stats=self._stats,
                cancel=self._cancel_event,
                view=True,
                if_match=self._condition(),
            )
        except RuntimeError:  # the reader was closed, its pool shut down
            return None
        self._next_start = end
        self._window.append((future, start, end - start))
        return future

    def _end_probe(self, returned: cf.Future[Any] | None = None, *, spare: bool = False) -> None:
        """This shard's probe is over (its part ``returned``, or none sent): every shard goes on."""
        with self._lock:  # once: a spared probe may be another shard's already
            probing, self._probing = self._probing, False
        if probing:
            adapt.probe_done(self.url, spare=spare)
        if returned is not None:
            self._fill()

    def read(self, size: int = -1) -> bytes:  # up to size bytes (-1: a part); b"": the end
        return bytes(self.read_view(size))

    def read_view(self, size: int = -1) -> bytes | memoryview:
        """:meth:`read`, with a whole part handed on as the transport delivered it: a
        read-only memoryview, not copied into ``bytes``, where the transport fills its own
        buffers (obstore). For readers that slice what they need (the tar reader)."""
        if self._position >= len(self._current):
            if self._failure is not None:
                raise self._failure
            self._current = memoryview(b"")  # release the finished part before refilling
            self._part = b""
            began = time.perf_counter()
            if self._read_began is None:
                self._read_began = began
            try:
                if self._tail is not None:
                    return self._read_tail(size)
                data = self._next_part()
            finally:
                self._read_last = time.perf_counter()
                self._read_waited += self._read_last - began
            if data is None:
                return b""
            self._part = data
            self._current = memoryview(data)
            self._position = 0
            self._fill()
        end = len(self._current) if size < 0 else min(len(self._current), self._position + size)
        part: bytes | memoryview
        if self._position == 0 and end == len(self._current):
            part = self._part  # the whole part as it came
        else:  # a piece of a part larger than the read (adaptive parts reach 16 MiB): a view
            part = self._current[self._position : end]
        self._position = end
        self.offset += len(part)
        self._read_last = time.perf_counter()
        return part

    def _next_part(self) -> bytes | memoryview | None:
        """The next part in order (waiting for it), or None at the end of the object."""
        total: int | None = None
        for attempt in itertools.count():
            with self._lock:  # what is in flight and what is left, seen together
                entry = self._window.popleft() if self._window else None
                more = total is None or (self._next_start < total and not self.closed)
            if entry is not None or not more:
                break
            if total is None and (total := self.size) is None:  # waits for the lookup
                return self._start_tail()
            held = attempt > 0 and adapt.await_probe(self.url)  # a probe holds parts back
            if attempt > 1 and not held:  # twice none in flight, none held back
                raise self._failed("no ranged GET could be started")
            self._fill()
        if entry is None:
            return None
        future, start, requested = entry
        data = self._wait(future)
        if self._fell_back or self._failure is not None:
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
        # A part at a time: the streamed rest may be endless (no size, Range ignored).
        data = self._tail.read(self._options.part_bytes if size < 0 else size)
        self.offset += len(data)
        return data

    def _failed(self, why: str | None = None) -> ShardOpenError:  # None: it stalled
        return ShardOpenError(
            why or f"stalled: no bytes for {self._wait_s:.0f} s",
            url=self.url,
            shard_index=self.shard_index,
            offset=self.offset,
        )

    def _wait(self, future: cf.Future[Any]) -> bytes | memoryview:
        start = time.perf_counter()
        try:
            data: bytes | memoryview = future.result(timeout=self._wait_s)
            return data
        except cf.TimeoutError:
            raise self._failed() from None
        except RangeIgnoredError as exc:
            return self._fall_back(exc.body)
        except ShardOpenError as error:
            self._cancel()  # the parts after it retry no more
            if not error.received:
                raise
            self._failure = error  # after some of the part: hand that on, then the error
            data, error.received = error.received, b""  # the error does not keep them
            return data
        finally:
            self._stats.add(wait_s=time.perf_counter() - start)

    def _fall_back(self, body: bytes) -> bytes:
        # The server sent the whole object for a ranged GET: never splice parts from it.
        # Serve the rest of this shard from that body (too large to hold, b"": one streaming
        # GET from here), and stream later shards of this host.
        adapt.mark_unranged(self.url)
        size = self.size
        if not body:
            self._fell_back, self._next_start = True, self.offset
            self._cancel()
            return self._start_tail() or b""
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
        self._cancel_event.set()  # parts in flight stop retrying
        with self._lock:  # cancelled outside it: a cancelled part calls back at once
            window, self._window = list(self._window), deque()
        for future, _, _ in window:
            future.cancel()

    def close(self) -> None:
        """Cancel the parts not yet started; parts in flight finish and are dropped."""
        if not self.closed:
            self.closed = True
            self._cancel()
            self._end_probe()
            self._details.cancel()
            self._current = memoryview(b"")
            self._part = b""
            if self._tail is not None:
                self._tail.close()
            if self._read_began is not None:
                busy = self._read_last - self._read_began - self._read_waited
                adapt.record_reading(self.url, self.offset, busy)
            record: dict[str, Any] = {**self._stats.as_dict(), "url": redact_url(self.url)}
            del record["shards"]
            seconds = time.perf_counter() - self._started
            record.update(size=self._known_size(), delivered=self.offset, seconds=seconds)
            self._process_stats.per_shard.append(record)
            logger.debug("shard done: %s", record)
