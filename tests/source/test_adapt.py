"""Part sizes follow the measured link: larger parts where one connection is fast, never more
bytes in flight per shard than the fixed settings hold, the fixed settings when the user gives
them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cloudshards.source import FetchOptions, adapt

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
