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

Connections that share one bottleneck (a store on the local network, or on the same machine:
one server process, one disk) look slow when many are in flight: each carries its share of
the bottleneck, and parts sized from that share stay small, as many GETs as behind a slow
link. So each host's first shard in a process (the first with a part of :data:`LARGE` bytes
after its first) sends one part alone (no other GET of that host from the process in flight)
and keeps the rate that part was carried at; the parts are sized from the faster of that rate
and the rate measured under load. Behind a link that caps each connection (S3's ~100 MB/s,
the cloud simulator's 25 MB/s) a connection alone is no faster than under load; against a
shared bottleneck it is many times faster, and the parts grow to match: s3rver directly,
moto, a MinIO nearby. The probe holds the host's other GETs back for one part's time, once
per process and host, only where the first shard's size came back within
:data:`PROBE_FIRST_BYTE_S` (a store nearby): behind a cloud's latency it costs more than it
tells. Hosts that ignore Range are kept here too (:func:`mark_unranged`).

A process-wide estimate is written by hand: no library sizes ranged reads from measurements
(fsspec's and obstore's part sizes are fixed numbers).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from cloudshards.process import PerProcess
from cloudshards.redact import redact_url

__all__ = [
    "ALONE",
    "FIRST_PART_BYTES",
    "HEADROOM",
    "LARGE",
    "MAX_PART_BYTES",
    "PROBE_FIRST_BYTE_S",
    "TARGET_PART_S",
    "UNRANGED_HOSTS",
    "PartPlan",
    "Ticket",
    "await_probe",
    "claim_probe",
    "connection_rate",
    "fixed_plan",
    "forget",
    "host_key",
    "mark_unranged",
    "plan",
    "probe_done",
    "probe_sent",
    "record",
    "record_reading",
    "started",
    "wait_for_probe",
]

#: Size of each shard's first ranged GET (the rest use ``part_bytes``): time to first sample.
FIRST_PART_BYTES = 64 << 10
#: Transfer time one part should take once the first byte is in.
TARGET_PART_S = 0.08
MAX_PART_BYTES = 16 << 20
#: Planned part sizes are whole multiples of this (rounded down); never below ``part_bytes``.
_PART_STEP = 1 << 20
_SMALL = 256 << 10  #: Requests up to this size measure the time to first byte.
LARGE = 512 << 10  #: Requests from this size on measure a connection's throughput.
_WEIGHT = 0.3  # of a new measurement in the moving averages
#: Bytes in flight per shard: this many times the reader's demand over one part's time.
HEADROOM = 2.0
#: A shard read for less than this (or fewer bytes) says nothing about its reader's demand.
_MIN_READ_S = 0.02
_MIN_READ_BYTES = 1 << 20
#: A GET with at most this many of its host's GETs in flight (itself too) measures one alone.
ALONE = 1.5
#: The probe is sent only where the shard's size came back this fast: it holds the host's
#: other GETs back for one part's time, a few ms nearby, too long behind a cloud's 20-60 ms.
PROBE_FIRST_BYTE_S = 0.015
#: Other shards wait at most this long for a host's probe (then it no longer counts).
_PROBE_WAIT_S = 5.0
#: A shard with no part of :data:`LARGE` bytes hands the probe on at most this many times.
_PROBE_SPARES = 4


@dataclass(frozen=True, slots=True)
class PartPlan:
    """How one shard is fetched: the size of its first GET (sent before its size is known),
    of the others, and how many are in flight."""

    first_bytes: int
    part_bytes: int
    in_flight: int
    #: Send the part after the first one alone, to measure a connection alone.
    probe: bool = False


class _Link:
    """Moving averages of one host's time to first byte (from the small first parts, sent for
    every shard), of what one connection carries after it, and of what this process's readers
    of the host's shards take."""

    __slots__ = (
        "active",
        "alone",
        "area",
        "demand",
        "early",
        "latency_s",
        "lock",
        "probe",
        "probe_began",
        "probe_out",
        "probed",
        "rate",
        "spares",
        "stamp",
        "waiting",
    )

    def __init__(self) -> None:
        self.latency_s: float | None = None
        self.rate: float | None = None  # bytes/s of one connection, after the first byte
        self.alone: float | None = None  # the same, of a connection with no other in flight
        self.demand: float | None = None  # bytes/s a reader takes while not waiting for bytes
        self.lock = threading.Lock()
        # GETs in flight now, and their integral over time (mean crowding of each GET).
        self.active = 0
        self.area = 0.0
        self.stamp = time.perf_counter()
        self.probe = _NOT_YET
        self.early: tuple[int, float, float | None] | None = None
        self.probe_began = 0.0
        self.probe_out = False  # the probe's part was sent
        self.probed = threading.Event()
        self.spares = _PROBE_SPARES
        self.waiting: list[Callable[[], None]] = []

    def advance(self, now: float) -> None:
        self.area += self.active * (now - self.stamp)
        self.stamp = now

    def add_reading(self, nbytes: int, busy_s: float) -> None:
        new = nbytes / busy_s
        with self.lock:
            # Up at once (a reader that got faster must not starve), down gradually (a pause
            # mid-shard, an evaluation, does not shrink the window for long).
            old = self.demand
            self.demand = new if old is None or new > old else _average(old, new)

    def add(self, nbytes: int, seconds: float, crowd: float | None) -> None:
        with self.lock:
            if nbytes <= _SMALL:
                self.latency_s = _average(self.latency_s, seconds)
                if self.early is not None:  # a large GET back before any small one
                    self._add_large(*self.early)
                    self.early = None
            elif nbytes >= LARGE and self.latency_s is None:
                self.early = (nbytes, seconds, crowd)  # measured once a first byte time is
            elif nbytes >= LARGE:
                self._add_large(nbytes, seconds, crowd)

    def _add_large(self, nbytes: int, seconds: float, crowd: float | None) -> None:
        assert self.latency_s is not None
        transfer = max(seconds - self.latency_s, seconds / 4)
        self.rate = _average(self.rate, nbytes / transfer)
        if crowd is not None and crowd <= ALONE:
            self.alone = _average(self.alone, nbytes / transfer)


# A host's probe: not sent yet, in flight, done.
_NOT_YET, _IN_FLIGHT, _DONE = 0, 1, 2


class Ticket:
    """One GET in flight to a host (from :func:`started`): :meth:`done` ends it once. Its
    ``crowd`` is the mean number of large GETs of the host in flight from this process while
    it was (itself included, if large)."""

    __slots__ = ("_area", "_began", "_counted", "_link", "crowd", "seconds")

    def __init__(self, link: _Link, nbytes: int) -> None:
        self._link = link
        # Small GETs (first parts, lookups) take little of the link: not counted as crowding.
        self._counted = nbytes >= LARGE
        with link.lock:
            now = time.perf_counter()
            link.advance(now)
            link.active += self._counted
            self._began, self._area = now, link.area
        self.crowd: float | None = None  # mean GETs of the host in flight during this one
        self.seconds = 0.0

    def done(self) -> float:
        """End the GET (once; later calls change nothing); returns its duration."""
        link = self._link
        with link.lock:
            if self.crowd is None:
                now = time.perf_counter()
                link.advance(now)
                link.active -= self._counted
                self.seconds = now - self._began
                area = link.area - self._area
                self.crowd = area / self.seconds if self.seconds > 0 else 1.0
        return self.seconds


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + _WEIGHT * (new - old)


_links: PerProcess[dict[str, _Link]] = PerProcess(dict)
_links_lock = threading.Lock()


def host_key(url: str) -> str:
    """``scheme://netloc`` of ``url``: what this process measures each host by."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


UNRANGED_HOSTS: set[str] = set()  #: Hosts that answered a ranged GET with a whole object.


def mark_unranged(url: str) -> None:
    """``url``'s host ignores Range: its shards are streamed with one GET from now on."""
    host = host_key(url)
    if host not in UNRANGED_HOSTS:
        UNRANGED_HOSTS.add(host)
        msg = "%s ignores Range requests; streaming its shards with one GET each"
        logging.getLogger("cloudshards.prefetch").warning(msg, redact_url(host))


def _link(url: str) -> _Link:
    links = _links.get()
    host = host_key(url)
    link = links.get(host)
    if link is None:
        with _links_lock:
            link = links.setdefault(host, _Link())
    return link


def started(url: str, nbytes: int) -> Ticket:
    """A GET of ``nbytes`` to ``url``'s host starts; end it with :meth:`Ticket.done`
    whatever happens."""
    return Ticket(_link(url), nbytes)


def record(url: str, nbytes: int, seconds: float, crowd: float | None = None) -> None:
    """One completed GET of ``nbytes`` from ``url``'s host that took ``seconds``, with on
    average ``crowd`` of the host's GETs in flight (itself included; None: not known)."""
    if nbytes > 0 and seconds > 0:
        _link(url).add(nbytes, seconds, crowd)


def _probe_left(link: _Link) -> float:
    """Seconds the host's probe may still hold its other GETs back (0: none does). One not
    sent within :data:`PROBE_FIRST_BYTE_S` of its claim holds nothing (its shard's size came
    late, or will not come)."""
    if link.probe != _IN_FLIGHT:
        return 0.0
    bound = _PROBE_WAIT_S if link.probe_out else PROBE_FIRST_BYTE_S
    return max(0.0, bound - (time.perf_counter() - link.probe_began))


def wait_for_probe(url: str, then: Callable[[], None]) -> bool:
    """True if a shard of ``url``'s host is measuring a connection alone: ``then`` is called
    when it is done (start no GET of the host before). False: go on now."""
    link = _link(url)
    with link.lock:
        if _probe_left(link) <= 0:
            return False
        if then not in link.waiting:
            link.waiting.append(then)
        return True


def await_probe(url: str) -> bool:
    """Wait until the probe of ``url``'s host is over or holds nothing back any more; False
    at once if none does now."""
    link = _link(url)
    with link.lock:
        left = _probe_left(link)
    if left <= 0:
        return False
    link.probed.wait(left)
    return True


def probe_sent(url: str) -> None:
    """The probe's part of ``url``'s host went out: the others wait for it to come back."""
    link = _link(url)
    with link.lock:
        link.probe_out = True


def probe_done(url: str, *, spare: bool = False) -> None:
    """The probe of ``url``'s host is over (measured, failed or abandoned): the shards that
    waited for it go on. ``spare``: its shard was too small to send a part of :data:`LARGE`
    bytes, so the host's next shard claims the probe instead (a few times at most)."""
    link = _link(url)
    with link.lock:
        link.probe = _NOT_YET if spare and link.spares > 0 else _DONE
        link.spares -= 1 if spare else 0
        link.probed.set()
        waiting, link.waiting = link.waiting, []
    for then in waiting:
        then()


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


def fixed_plan(part_bytes: int, concurrency: int) -> PartPlan:
    """The parts as the settings fix them, with a small first part."""
    return PartPlan(min(FIRST_PART_BYTES, part_bytes), part_bytes, concurrency)


def plan(url: str, part_bytes: int, concurrency: int, first_bytes: int) -> PartPlan:
    """The parts for the next shard of ``url``'s host; ``part_bytes`` x ``concurrency`` (the
    fixed settings) bound the bytes in flight. Before anything is measured: the fixed
    settings, with a small first part (``first_bytes``) for a quick first sample."""
    link = _link(url)
    with link.lock:
        rate, latency_s, demand = link.rate, link.latency_s, link.demand
        if rate is not None and link.alone is not None:
            rate = max(rate, link.alone)  # connections that share one bottleneck
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


def claim_probe(url: str) -> bool:
    """True once per host and process: the shard about to be opened measures a connection
    alone (its :class:`PartPlan` says ``probe``); it must end with :func:`probe_done`."""
    link = _link(url)
    with link.lock:
        if link.probe != _NOT_YET:
            return False
        link.probe, link.probe_began = _IN_FLIGHT, time.perf_counter()
        link.probe_out = False
        if link.probed.is_set():  # one spared before: its waiters were let go already
            link.probed = threading.Event()
        return True
