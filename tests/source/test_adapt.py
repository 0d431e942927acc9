"""Part sizes follow the measured link: larger parts where one connection is fast, never more
bytes in flight per shard than the fixed settings hold, the fixed settings when the user gives
them."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator

import pytest

from cloudshards.source import FetchOptions, IOStats, adapt
from cloudshards.source.parts import PartStream

PART = 2 << 20
CONCURRENCY = 16
FIRST = 64 << 10


@pytest.fixture(autouse=True)
def fresh_links() -> Iterator[None]:
    adapt.forget()
    yield
    adapt.forget()


def measure(url: str, latency_s: float, rate: float, parts: int = 5) -> None:
    """Record what a link with this first-byte latency and per-connection rate would show: a
    small first part, then parts of the size planned for it, one after the other."""
    for _ in range(parts):
        adapt.record(url, FIRST, latency_s + FIRST / rate)
        size = adapt.plan(url, PART, CONCURRENCY, FIRST).part_bytes
        adapt.record(url, size, latency_s + size / rate)


def test_parts_alone_measure_nothing_without_a_first_byte_time() -> None:
    adapt.record("s3://bucket/a.tar", 16 << 20, 0.01)
    assert adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST).part_bytes == PART


def test_before_any_measurement_the_fixed_settings_with_a_small_first_part() -> None:
    plan = adapt.plan("s3://bucket/a.tar", PART, CONCURRENCY, FIRST)
    assert plan == adapt.PartPlan(FIRST, PART, CONCURRENCY)


def test_a_slow_connection_keeps_small_parts_and_many_in_flight() -> None:
    # The cloud simulator: 30 ms before each request, 25 MB/s per connection.
    measure("s3://bucket/a.tar", 0.030, 25e6)
    plan = adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST)
    assert plan == adapt.PartPlan(FIRST, PART, CONCURRENCY)


def test_a_fast_connection_gets_large_parts_and_fewer_in_flight() -> None:
    measure("s3://bucket/a.tar", 0.001, 250e6)
    plan = adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST)
    assert plan.part_bytes == adapt.MAX_PART_BYTES
    assert plan.first_bytes == FIRST  # the shards prefetched behind it wait for its first part
    assert plan.in_flight == PART * CONCURRENCY // adapt.MAX_PART_BYTES


def test_a_connection_in_between_gets_parts_of_about_80_ms() -> None:
    # S3 from a cloud VM: ~20 ms to first byte, ~90 MB/s per connection: 90 MB/s x 80 ms is
    # 7.2 MB, in whole MiB 6 (the first part's own transfer counts as latency: maybe 7).
    measure("s3://bucket/a.tar", 0.020, 90e6, parts=30)
    plan = adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST)
    assert plan.part_bytes in (6 << 20, 7 << 20)
    assert plan.in_flight == PART * CONCURRENCY // plan.part_bytes


@pytest.mark.parametrize("rate", [1e5, 1e6, 3e7, 5e7, 1e8, 3e8, 1e9, 1e11])
def test_bytes_in_flight_never_exceed_the_fixed_budget(rate: float) -> None:
    measure("s3://bucket/a.tar", 0.01, rate)
    for part, concurrency in [(PART, CONCURRENCY), (1 << 20, 4), (8 << 20, 2), (64 << 10, 1)]:
        plan = adapt.plan("s3://bucket/b.tar", part, concurrency, min(FIRST, part))
        assert plan.part_bytes * plan.in_flight <= part * concurrency
        assert plan.part_bytes >= part
        assert 1 <= plan.in_flight <= concurrency


def test_hosts_are_measured_apart() -> None:
    measure("s3://fast-bucket/a.tar", 0.001, 250e6)
    assert adapt.plan("s3://slow-bucket/b.tar", PART, CONCURRENCY, FIRST).first_bytes == FIRST
    assert adapt.plan("s3://fast-bucket/c.tar", PART, CONCURRENCY, FIRST).part_bytes > PART


def test_the_estimate_follows_a_link_that_slows_down() -> None:
    measure("s3://bucket/a.tar", 0.001, 250e6)
    assert adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST).part_bytes > PART
    measure("s3://bucket/a.tar", 0.030, 20e6, parts=20)
    assert adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST).part_bytes == PART


def test_adaptive_unless_the_user_fixes_the_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PART_BYTES", "CONCURRENCY"):
        monkeypatch.delenv(f"CLOUDSHARDS_{name}", raising=False)
    assert FetchOptions.from_env().adaptive
    assert FetchOptions.from_env(prefetch=4, retries=1).adaptive
    assert not FetchOptions.from_env(part_bytes=4 << 20).adaptive
    assert not FetchOptions.from_env(concurrency=8).adaptive
    assert not FetchOptions().adaptive
    monkeypatch.setenv("CLOUDSHARDS_CONCURRENCY", "8")
    assert not FetchOptions.from_env().adaptive
    monkeypatch.delenv("CLOUDSHARDS_CONCURRENCY")
    monkeypatch.setenv("CLOUDSHARDS_PART_BYTES", str(4 << 20))
    assert not FetchOptions.from_env().adaptive


# ---------------------------------------------------------------- bytes in flight: the reader
SHARD_BYTES = 26 << 20


def read_at(url: str, rate: float, shards: int = 1) -> None:
    """Record readers that took whole shards at ``rate`` bytes/s of their own time."""
    for _ in range(shards):
        adapt.record_reading(url, SHARD_BYTES, SHARD_BYTES / rate)


def test_a_slow_reader_keeps_fewer_parts_in_flight() -> None:
    # A reader that trains on a GPU and takes 40 MB/s, behind 30 ms and 25 MB/s a connection:
    # one connection brings 2 MiB every 30 + 84 ms (18.4 MB/s); 2 x 40 MB/s needs 5 of them.
    measure("s3://bucket/a.tar", 0.030, 25e6)
    read_at("s3://bucket/a.tar", 40e6)
    plan = adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST)
    assert plan == adapt.PartPlan(FIRST, PART, 5)


def test_a_reader_faster_than_the_link_keeps_the_whole_budget() -> None:
    measure("s3://bucket/a.tar", 0.030, 25e6)
    read_at("s3://bucket/a.tar", 400e6)
    assert adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST).in_flight == CONCURRENCY


def test_a_fast_link_needs_few_large_parts_for_a_slow_reader() -> None:
    measure("s3://bucket/a.tar", 0.001, 250e6)
    read_at("s3://bucket/a.tar", 20e6)
    plan = adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST)
    assert plan.part_bytes == adapt.MAX_PART_BYTES
    assert plan.in_flight == 2  # one being read, one coming: never fewer


def test_the_demand_alone_plans_nothing_before_the_link_is_measured() -> None:
    read_at("s3://bucket/a.tar", 1e6)
    plan = adapt.plan("s3://bucket/b.tar", PART, CONCURRENCY, FIRST)
    assert plan == adapt.PartPlan(FIRST, PART, CONCURRENCY)


def test_more_demand_is_believed_at_once_less_only_gradually() -> None:
    url = "s3://bucket/a.tar"
    measure(url, 0.030, 25e6)
    read_at(url, 40e6)
    assert adapt.plan(url, PART, CONCURRENCY, FIRST).in_flight == 5
    read_at(url, 160e6)  # the reader got faster: the very next shard gets the window for it
    assert adapt.plan(url, PART, CONCURRENCY, FIRST).in_flight == 16  # ceil(17.4), capped
    read_at(url, 20e6)  # one slow shard (a pause): 0.7 x 160 + 0.3 x 20 = 118 MB/s, 13 parts
    assert adapt.plan(url, PART, CONCURRENCY, FIRST).in_flight == 13
    read_at(url, 20e6, shards=20)  # a reader slow for good: the window follows it down
    assert adapt.plan(url, PART, CONCURRENCY, FIRST).in_flight == 3


def test_short_readings_say_nothing() -> None:
    url = "s3://bucket/a.tar"
    measure(url, 0.030, 25e6)
    adapt.record_reading(url, 512 << 10, 1.0)  # half a MiB: a reader stopped early
    adapt.record_reading(url, 26 << 20, 0.005)  # 5 ms: no time to measure
    assert adapt.plan(url, PART, CONCURRENCY, FIRST).in_flight == CONCURRENCY


@pytest.mark.parametrize("demand", [1e3, 1e6, 4e7, 4e8, 1e11])
@pytest.mark.parametrize("rate", [1e5, 3e7, 1e9])
def test_the_window_stays_between_two_parts_and_the_budget(demand: float, rate: float) -> None:
    measure("s3://bucket/a.tar", 0.01, rate)
    read_at("s3://bucket/a.tar", demand)
    for part, concurrency in [(PART, CONCURRENCY), (1 << 20, 4), (8 << 20, 2), (64 << 10, 1)]:
        plan = adapt.plan("s3://bucket/b.tar", part, concurrency, min(FIRST, part))
        assert plan.part_bytes * plan.in_flight <= part * concurrency
        assert min(2, part * concurrency // plan.part_bytes) <= plan.in_flight <= concurrency


class SlowSource:
    """A store object whose every ranged read takes ``delay_s`` (in memory: what is measured
    here is the reader's own time, not a transport)."""

    url = "mem://bucket/slow.tar"

    def __init__(self, size: int, delay_s: float) -> None:
        self.data = bytes(size)
        self.delay_s = delay_s

    def info(self, timeout: float | None = None) -> dict[str, int]:
        return {"size": len(self.data)}

    def cat_range(self, start: int, end: int, timeout: float | None = None) -> bytes:
        time.sleep(self.delay_s)
        return self.data[start:end]


@pytest.mark.parametrize(("store_delay_s", "reader_delay_s"), [(0.0, 0.02), (0.06, 0.02)])
def test_the_reader_is_measured_without_its_waits(
    store_delay_s: float, reader_delay_s: float
) -> None:
    """A reader that spends 20 ms on each 128 KiB part is measured at 6.5 MB/s whether the
    store answers at once or makes it wait 60 ms a part: a starved reader is not taken for a
    slow one."""
    part, parts = 128 << 10, 16
    source = SlowSource(part * parts, store_delay_s)
    options = FetchOptions(part_bytes=part, concurrency=2)
    with cf.ThreadPoolExecutor(2) as executor:
        stream = PartStream(
            source, source.info(), executor=executor, options=options, stats=IOStats()
        )
        stream.start()
        while stream.read_view(part):
            time.sleep(reader_delay_s)
        stream.close()
    demand = adapt._link(source.url).demand
    assert demand is not None
    expected = part / reader_delay_s
    assert 0.6 * expected < demand <= 1.05 * expected, (demand, expected)


# ------------------------------------------------- connections that share one bottleneck
def measure_crowded(url: str, latency_s: float, rate: float, crowd: float, parts: int = 5) -> None:
    """:func:`measure`, with ``crowd`` large GETs of the host in flight during each part."""
    for _ in range(parts):
        adapt.record(url, FIRST, latency_s + FIRST / rate)
        size = adapt.plan(url, PART, CONCURRENCY, FIRST).part_bytes
        adapt.record(url, size, latency_s + size / rate, crowd)


def test_a_connection_alone_much_faster_than_under_load_gets_large_parts() -> None:
    # A store on the local network: 16 parts in flight share 200 MB/s, 12.5 MB/s each; the
    # first shard's probe, alone, got all 200.
    url = "s3://bucket/a.tar"
    measure_crowded(url, 0.002, 12.5e6, crowd=16)
    assert adapt.plan(url, PART, CONCURRENCY, FIRST) == adapt.PartPlan(FIRST, PART, CONCURRENCY)
    adapt.record(url, PART, 0.002 + PART / 200e6, crowd=1.0)
    plan = adapt.plan(url, PART, CONCURRENCY, FIRST)
    assert plan.part_bytes == adapt.MAX_PART_BYTES
    assert plan.in_flight == PART * CONCURRENCY // adapt.MAX_PART_BYTES


def test_a_connection_capped_alone_as_under_load_keeps_small_parts() -> None:
    # The cloud simulator: 25 MB/s per connection, however many are in flight.
    url = "s3://bucket/a.tar"
    measure_crowded(url, 0.030, 25e6, crowd=16)
    adapt.record(url, PART, 0.030 + PART / 25e6, crowd=1.0)
    assert adapt.plan(url, PART, CONCURRENCY, FIRST) == adapt.PartPlan(FIRST, PART, CONCURRENCY)


def test_a_fast_part_among_others_in_flight_is_not_taken_for_one_alone() -> None:
    url = "s3://bucket/a.tar"
    measure_crowded(url, 0.002, 12.5e6, crowd=16, parts=30)
    adapt.record(url, PART, 0.002 + PART / 200e6, crowd=adapt.ALONE + 0.5)
    # One fast sample moves the average under load a little, not to 16 MiB parts.
    assert adapt.plan(url, PART, CONCURRENCY, FIRST).part_bytes < adapt.MAX_PART_BYTES


def test_tickets_measure_the_large_gets_in_flight_beside_each() -> None:
    url = "s3://bucket/a.tar"
    alone = adapt.started(url, PART)
    time.sleep(0.02)
    alone.done()
    assert alone.crowd == pytest.approx(1.0, abs=0.05)
    first = adapt.started(url, PART)
    small = adapt.started(url, FIRST)  # a first part or a lookup: not counted
    others = [adapt.started(url, PART) for _ in range(3)]
    time.sleep(0.02)
    for ticket in [*others, small]:
        ticket.done()
    time.sleep(0.02)
    first.done()
    assert first.crowd is not None
    assert 2.0 < first.crowd < 3.0  # 4 for half its time, then 1
    assert first.done() == first.seconds  # once: a second call changes nothing
    again = adapt.started(url, PART)  # the count is back to none in flight
    time.sleep(0.01)
    again.done()
    assert again.crowd == pytest.approx(1.0, abs=0.05)


def test_one_probe_per_host_and_the_shards_that_waited_go_on_after_it() -> None:
    url, other = "s3://bucket/a.tar", "s3://other/a.tar"
    assert not adapt.wait_for_probe(url, lambda: None)  # no probe: go on
    assert adapt.claim_probe(url)
    assert not adapt.claim_probe("s3://bucket/b.tar")  # one per host and process
    assert adapt.claim_probe(other)
    resumed: list[str] = []
    assert adapt.wait_for_probe("s3://bucket/c.tar", lambda: resumed.append("c"))
    assert adapt.wait_for_probe("s3://bucket/d.tar", lambda: resumed.append("d"))
    adapt.probe_done(url)
    assert resumed == ["c", "d"]
    assert not adapt.wait_for_probe(url, lambda: resumed.append("late"))
    adapt.probe_done(url)  # again (a closed shard after its probe's callback): nothing
    assert resumed == ["c", "d"]
    adapt.probe_done(other)


def test_a_probe_that_never_ends_holds_nobody_back_for_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = "s3://bucket/a.tar"
    assert adapt.claim_probe(url)
    adapt.probe_sent(url)
    assert adapt.wait_for_probe(url, lambda: None)
    monkeypatch.setattr(adapt, "_PROBE_WAIT_S", 0.0)
    time.sleep(0.001)
    assert not adapt.wait_for_probe(url, lambda: None)
    assert not adapt.await_probe(url)


def test_a_probe_not_sent_soon_after_its_claim_holds_nobody_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its shard's size came late (a store far away) or never: the others go on.
    url = "s3://bucket/a.tar"
    assert adapt.claim_probe(url)
    assert adapt.wait_for_probe(url, lambda: None)
    monkeypatch.setattr(adapt, "PROBE_FIRST_BYTE_S", 0.0)
    time.sleep(0.001)
    assert not adapt.wait_for_probe(url, lambda: None)
    assert not adapt.await_probe(url)


def test_a_probe_back_before_the_first_byte_time_is_known_still_counts() -> None:
    url = "s3://bucket/a.tar"
    adapt.record(url, PART, 0.002 + PART / 400e6, crowd=1.0)  # before any small GET
    adapt.record(url, FIRST, 0.002 + FIRST / 400e6)
    assert adapt.plan(url, PART, CONCURRENCY, FIRST).part_bytes == adapt.MAX_PART_BYTES
