"""Part sizes that follow the link: each ranged GET's size and duration feed a per-host
estimate of the time to first byte and of what one connection carries after it; the parts of
the next shard are sized so that one takes about :data:`TARGET_PART_S` to transfer (a slow
connection keeps ``part_bytes`` parts, many in flight; a fast one gets larger parts, fewer in
flight), within the bytes per shard the fixed settings would hold. The memory bound stays
``(prefetch + 1) x concurrency x part_bytes``.

Measured with ``benchmarks/bench_s3.py`` (16 shards of 24 MB, samples/s at 0 DataLoader
workers): behind 30 ms and 25 MB/s per connection, 2 MiB parts 7,779 and 6,612, 8 MiB parts
5,201 and 4,938, 32 MiB parts 2,103 and 2,169; directly against the server (~200 MB/s per
connection), 2 MiB 7,573 and 8,158, 8 MiB 7,745 and 8,281, 32 MiB 8,696 and 9,045. No fixed
size is best for both; 80 ms of transfer per part picks 2 MiB for the first and 16 MiB for the
second.

The parts in flight follow the reader: a target of bytes in flight (as AWS's CRT keeps one)
of :data:`HEADROOM` times what the shard's reader takes while it is not waiting for bytes,
over the time one part takes to come (first byte, then its transfer). A reader that trains
on a GPU and takes 40 MB/s keeps 5 parts of 2 MiB in flight behind 30 ms and 25 MB/s per
connection, not 16: less memory, fewer connections and fewer GETs in flight on the node
(:mod:`cloudshards.source.budget`), at the same speed. A reader that waited is measured
without its waits, so a starved reader asks for more, never less; more demand is believed
at once, less only gradually.

A process-wide estimate is written by hand: no library sizes ranged reads from measurements
(fsspec's and obstore's part sizes are fixed numbers).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from cloudshards.process import PerProcess

__all__ = [
    "HEADROOM",
    "MAX_PART_BYTES",
    "TARGET_PART_S",
    "PartPlan",
    "connection_rate",
    "forget",
    "plan",
    "record",
    "record_reading",
]

#: Transfer time one part should take once the first byte is in.
TARGET_PART_S = 0.08
MAX_PART_BYTES = 16 << 20
#: Planned part sizes are whole multiples of this (rounded down); never below ``part_bytes``.
_PART_STEP = 1 << 20
#: Requests up to this size measure the time to first byte (their transfer is short).
_SMALL = 256 << 10
#: Requests from this size on measure a connection's throughput.
_LARGE = 512 << 10
_WEIGHT = 0.3  # of a new measurement in the moving averages
#: Bytes in flight per shard: this many times the reader's demand over one part's time.
HEADROOM = 2.0
#: A shard read for less than this (or fewer bytes) says nothing about its reader's demand.
_MIN_READ_S = 0.02
_MIN_READ_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class PartPlan:
    """How one shard is fetched: the size of its first GET (sent before its size is known),
    of the others, and how many are in flight."""

    first_bytes: int
    part_bytes: int
    in_flight: int


class _Link:
    """Moving averages of one host's time to first byte (from the small first parts, sent for
    every shard), of what one connection carries after it, and of what this process's readers
    of the host's shards take."""

    __slots__ = ("demand", "latency_s", "lock", "rate")

    def __init__(self) -> None:
        self.latency_s: float | None = None
        self.rate: float | None = None  # bytes/s of one connection, after the first byte
        self.demand: float | None = None  # bytes/s a reader takes while not waiting for bytes
        self.lock = threading.Lock()

    def add_reading(self, nbytes: int, busy_s: float) -> None:
        new = nbytes / busy_s
        with self.lock:
            # Up at once (a reader that got faster must not starve), down gradually (a pause
            # mid-shard, an evaluation, does not shrink the window for long).
            old = self.demand
            self.demand = new if old is None or new > old else _average(old, new)

    def add(self, nbytes: int, seconds: float) -> None:
        with self.lock:
            if nbytes <= _SMALL:
                self.latency_s = _average(self.latency_s, seconds)
            elif nbytes >= _LARGE and self.latency_s is not None:
                transfer = max(seconds - self.latency_s, seconds / 4)
                self.rate = _average(self.rate, nbytes / transfer)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _WEIGHT * (new - old)


_links: PerProcess[dict[str, _Link]] = PerProcess(dict)
_links_lock = threading.Lock()


def _host(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _link(url: str) -> _Link:
    links = _links.get()
    host = _host(url)
    link = links.get(host)
    if link is None:
        with _links_lock:
            link = links.setdefault(host, _Link())
    return link


def record(url: str, nbytes: int, seconds: float) -> None:
    """One completed GET of ``nbytes`` from ``url``'s host that took ``seconds``."""
    if nbytes > 0 and seconds > 0:
        _link(url).add(nbytes, seconds)


def record_reading(url: str, nbytes: int, busy_s: float) -> None:
    """A reader took ``nbytes`` of a shard from ``url``'s host in ``busy_s`` seconds of its own
    time: from its first read to its last, less the time it waited for bytes."""
    if nbytes >= _MIN_READ_BYTES and busy_s >= _MIN_READ_S:
        _link(url).add_reading(nbytes, busy_s)


def connection_rate() -> float | None:
    """What one request was measured to carry (bytes/s), first byte included, for a part
    sized as :func:`plan` sizes them (:data:`TARGET_PART_S` of transfer): the lowest over
    this process's hosts; None before any was measured."""
    with _links_lock:
        links = [(link.rate, link.latency_s or 0.0) for link in _links.get().values()]
    rates = [rate * TARGET_PART_S / (latency + TARGET_PART_S) for rate, latency in links if rate]
    return min(rates) if rates else None


def forget() -> None:
    """Drop what this process measured of every host (its next shards start from the fixed
    settings again)."""
    with _links_lock:
        _links.get().clear()


def plan(url: str, part_bytes: int, concurrency: int, first_bytes: int) -> PartPlan:
    """The parts for the next shard of ``url``'s host; ``part_bytes`` x ``concurrency`` (the
    fixed settings) bound the bytes in flight. Before anything is measured: the fixed
    settings, with a small first part (``first_bytes``) for a quick first sample."""
    link = _link(url)
    rate, latency_s, demand = link.rate, link.latency_s, link.demand
    if rate is None or latency_s is None:
        return PartPlan(first_bytes, part_bytes, concurrency)
    size = int(rate * TARGET_PART_S) // _PART_STEP * _PART_STEP
    budget = part_bytes * concurrency
    size = max(part_bytes, min(MAX_PART_BYTES, budget, size))
    most = max(1, min(concurrency, budget // size))
    in_flight = most
    if demand is not None:
        # One connection brings a part every latency + transfer: enough of them in flight to
        # bring HEADROOM x the demand, and never fewer than two (one read, one coming).
        per_connection = size / (latency_s + size / rate)
        in_flight = min(most, max(2, math.ceil(HEADROOM * demand / per_connection)))
    # The first part stays small: the shards prefetched behind one wait for its first part.
    return PartPlan(first_bytes, size, in_flight)
