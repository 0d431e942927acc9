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

A process-wide estimate is written by hand: no library sizes ranged reads from measurements
(fsspec's and obstore's part sizes are fixed numbers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from cloudshards.process import PerProcess

__all__ = ["MAX_PART_BYTES", "TARGET_PART_S", "PartPlan", "forget", "plan", "record"]

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


@dataclass(frozen=True, slots=True)
class PartPlan:
    """How one shard is fetched: the size of its first GET (sent before its size is known),
    of the others, and how many are in flight."""

    first_bytes: int
    part_bytes: int
    in_flight: int


class _Link:
    """Moving averages of one host's time to first byte (from the small first parts, sent for
    every shard) and of what one connection carries after it."""

    __slots__ = ("latency_s", "lock", "rate")

    def __init__(self) -> None:
        self.latency_s: float | None = None
        self.rate: float | None = None  # bytes/s of one connection, after the first byte
        self.lock = threading.Lock()

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


def forget() -> None:
    """Drop what this process measured of every host (its next shards start from the fixed
    settings again)."""
    with _links_lock:
        _links.get().clear()


def plan(url: str, part_bytes: int, concurrency: int, first_bytes: int) -> PartPlan:
    """The parts for the next shard of ``url``'s host; ``part_bytes`` x ``concurrency`` (the
    fixed settings) bound the bytes in flight. Before anything is measured: the fixed
    settings, with a small first part (``first_bytes``) for a quick first sample."""
    rate = _link(url).rate
    if rate is None:
        return PartPlan(first_bytes, part_bytes, concurrency)
    size = int(rate * TARGET_PART_S) // _PART_STEP * _PART_STEP
    budget = part_bytes * concurrency
    size = max(part_bytes, min(MAX_PART_BYTES, budget, size))
    in_flight = max(1, min(concurrency, budget // size))
    # The first part stays small: the shards prefetched behind one wait for its first part.
    return PartPlan(first_bytes, size, in_flight)
