"""The node's request budget: slots held by requests in flight, shared by threads and by
separate processes, and one throttling backoff for the whole node."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cloudshards.source import budget
from cloudshards.source.options import FetchOptions
from cloudshards.source.retries import is_throttled, retry

HOLD_S = 0.15


def _hold(log: Path, count: int) -> None:
    """Hold a slot ``count`` times in threads of this process, logging (start, end)."""

    def one() -> None:
        with budget.node_budget().slot():
            start = time.monotonic()
            time.sleep(HOLD_S)
            with open(log, "a") as out:
                out.write(json.dumps([start, time.monotonic()]) + "\n")

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _most_at_once(log: Path) -> int:
    events = []
    for line in log.read_text().splitlines():
        start, end = json.loads(line)
        events += [(start, 1), (end, -1)]
    most = now = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        now += change
        most = max(most, now)
    return most


def test_slots_bound_requests_in_flight_across_threads_and_processes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_NODE_REQUESTS", "3")
    budget.forget()
    log = tmp_path / "held.jsonl"
    context = multiprocessing.get_context("spawn")  # an independent process, as a rank is
    other = context.Process(target=_child, args=(str(log), dict(os.environ)))
    other.start()
    _hold(log, 4)
    other.join(30)
    assert other.exitcode == 0
    assert len(log.read_text().splitlines()) == 8
    assert _most_at_once(log) == 3  # never more than the node's 3, and all 3 used


def _child(log: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    _hold(Path(log), 4)


def test_a_throttled_request_makes_the_whole_node_wait(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    budget.forget()
    calls = []

    def call() -> str:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ConnectionError("503 SlowDown: Please reduce your request rate.")
        return "ok"

    options = FetchOptions(retries=2, backoff_s=0.4, max_backoff_s=0.4)
    caplog.set_level(logging.WARNING, logger="cloudshards.fetch")
    before = time.time()
    assert retry(call, url="s3://b/k", offset=0, options=options) == "ok"
    assert "this node waits" in caplog.text
    state = json.loads((Path(os.environ["CLOUDSHARDS_NODE_DIR"]) / "state").read_text())
    until = state["until"]
    assert before < until <= before + 0.4 + 0.05  # the retry's own delay, published
    # An ordinary failure (a reset connection) is this request's business only.
    calls.clear()
    budget.forget()
    (Path(os.environ["CLOUDSHARDS_NODE_DIR"]) / "state").unlink()

    def reset() -> str:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert retry(reset, url="s3://b/k", offset=0, options=options) == "ok"
    assert not (Path(os.environ["CLOUDSHARDS_NODE_DIR"]) / "state").exists()


def test_a_throttled_request_gets_more_tries_than_a_failing_one_and_still_ends() -> None:
    """A store asking to slow down (503 SlowDown at 5 GETs/s) failed a 2-worker epoch within
    3 s: its 5 quick tries ran out before the node slowed down. Throttling gets
    ``throttle_retries`` more, within the time a request may take (give_up_s); anything
    else still fails after ``retries``."""
    budget.forget()
    options = FetchOptions(retries=2, throttle_retries=3, backoff_s=0.001, max_backoff_s=0.001)

    def failing(exc: Exception, succeed_at: int) -> Any:
        calls: list[int] = []

        def call() -> str:
            calls.append(1)
            if len(calls) < succeed_at:
                raise exc
            return "ok"

        return call, calls

    call, calls = failing(ConnectionError("503 SlowDown: Please reduce your request rate."), 6)
    assert retry(call, url="s3://b/k", offset=0, options=options) == "ok"  # the 6th try
    call, calls = failing(ConnectionError("503 SlowDown: Please reduce your request rate."), 99)
    with pytest.raises(OSError, match="gave up after 6 attempts"):
        retry(call, url="s3://b/k", offset=0, options=options)
    assert len(calls) == 6
    call, calls = failing(ConnectionResetError("connection reset by peer"), 99)
    with pytest.raises(OSError, match="gave up after 3 attempts"):
        retry(call, url="s3://b/k", offset=0, options=options)
    # Tries spent on throttling do not use up the retries of other failures after them.
    answers = [ConnectionError("503 SlowDown")] * 3 + [ConnectionResetError("reset")] * 2
    mixed = iter([*answers, None])

    def throttled_then_reset() -> str:
        answer = next(mixed)
        if answer is not None:
            raise answer
        return "ok"

    assert retry(throttled_then_reset, url="s3://b/k", offset=0, options=options) == "ok"
    # Throttle tries that would outlast give_up_s (a reader's wait for the part) are not made.
    short = FetchOptions(
        retries=1, throttle_retries=50, backoff_s=0.5, max_backoff_s=0.5, stall_timeout_s=0.1
    )
    call, calls = failing(ConnectionError("503 SlowDown"), 999)
    began = time.monotonic()
    with pytest.raises(OSError, match="SlowDown"):
        retry(call, url="s3://b/k", offset=0, options=short)
    assert time.monotonic() - began < short.give_up_s
    assert len(calls) < 20  # give_up_s (1.5 s of tries, 0.5 s of backoff) allows a few only


def test_every_process_of_the_node_waits_out_a_backoff() -> None:
    budget.forget()
    budget.node_budget().back_off(0.5)  # one process was told to slow down
    budget.forget()  # another process of the node: a handle of its own
    began = time.monotonic()
    with budget.node_budget().slot():
        waited = time.monotonic() - began
    assert 0.4 <= waited < 2.0


def test_a_directory_others_can_write_is_not_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("CLOUDSHARDS_NODE_DIR", str(shared))
    budget.forget()
    with caplog.at_level(logging.WARNING, logger="cloudshards.fetch"):
        assert budget.node_budget().slots == 0
    assert "writable by others" in caplog.text


def test_throttling_halves_the_node_limit_and_successes_give_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_NODE_REQUESTS", "16")
    budget.forget()
    node = budget.node_budget()
    assert node.limit() == 16
    node.back_off(0.01)
    assert node.limit() == 8
    node.back_off(0.01)  # the same burst (within its delay): not halved again
    assert node.limit() == 8
    time.sleep(0.02)
    node.back_off(0.01)
    assert node.limit() == 4
    time.sleep(0.02)
    for _ in range(8 * 4):  # rounds of successes: one slot back per round
        with node.slot():
            pass
    assert 5 <= node.limit() <= 8


def _member(ready: Any, done: Any) -> None:
    """Another process of the node reading remote shards, until told to go."""
    budget.node_budget().members()
    ready.set()
    done.wait(30)


def test_the_buffer_budget_is_shared_by_the_node_s_live_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_NODE_BUFFER_BYTES", str(100 << 20))
    monkeypatch.setattr(budget, "_MEMBERS_TTL_S", 0.0)
    budget.forget()
    mine = budget.node_budget()
    shard = 32 << 20  # concurrency x part_bytes: what one shard in flight may hold
    assert mine.members() == 1
    assert mine.shards_ahead(2, shard) == 2  # alone: all of it (3 shards fit in 100 MiB)
    directory = Path(os.environ["CLOUDSHARDS_NODE_DIR"])
    (directory / "member-999999-00").touch()  # a process that died: not counted, removed
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    others = [context.Process(target=_member, args=(ready, done)) for _ in range(2)]
    for process in others:
        process.start()
        assert ready.wait(60)
        ready.clear()
    try:
        assert mine.members() == 3
        assert mine.shards_ahead(2, shard) == 0  # 33 MiB each: the shard being read only
        assert mine.shards_ahead(2, 8 << 20) == 2
        assert not (directory / "member-999999-00").exists()
    finally:
        done.set()
        for process in others:
            process.join(30)
    assert mine.members() == 1  # their locks went with them
    assert mine.shards_ahead(2, shard) == 2


def test_no_buffer_budget_keeps_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDSHARDS_NODE_BUFFER_BYTES", "0")
    budget.forget()
    assert budget.node_budget().shards_ahead(2, 1 << 40) == 2


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("HTTP status server error (503 Service Unavailable) for url (http://h/k)"),
        ConnectionError("An error occurred (503) when calling the GetObject operation"),
        ConnectionError("503, message='Service Unavailable', url='http://h/b/k'"),
        ConnectionError("503 Server Error: Slow Down for url: http://h/b/k"),
        ConnectionError("ServiceUnavailable: please retry"),
        ConnectionError("got HTTP/1.1 429 from the store"),
        ConnectionError("status_code=429"),
        ConnectionError("Error 503 while reading"),
        ConnectionError("Server returned non-2xx status code: 503 Service Unavailable"),
        # s3fs turns exactly 503, SlowDown and ServiceUnavailable into EBUSY, S3's text kept
        OSError(errno.EBUSY, "Please reduce your request rate."),
    ],
    ids=repr,
)
def test_a_status_of_429_or_503_in_an_error_is_throttling(error: Exception) -> None:
    assert is_throttled(error)


def test_a_429_under_fsspecs_not_found_is_throttling() -> None:
    """fsspec's HTTP ``info()`` turns every failure into FileNotFoundError, the store's answer
    as its cause."""
    cause = ConnectionError("Too Many Requests")
    cause.status = 429  # type: ignore[attr-defined]
    error = FileNotFoundError("http://h/b/k")
    error.__cause__ = cause
    assert is_throttled(error)


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("error: read 503 bytes of 1048576"),
        ConnectionError("connection reset at offset 429"),
        TimeoutError("stalled: no answer within 503 s"),
        ConnectionError("member 000503.jpg is truncated"),
        asyncio.IncompleteReadError(b"x" * 503, 1048576),
        ConnectionError("failed to decode 429 bytes"),
        ConnectionError("reset while reading s3://b/logs/http_503.tar"),
        ConnectionError("reset while reading error_429-000001.tar"),
    ],
    ids=repr,
)
def test_a_number_429_or_503_that_is_no_status_is_not_throttling(error: Exception) -> None:
    """Throttling slows the whole node down: a failure that only mentions such a number (a
    count of bytes, an offset, a key) is this request's own."""
    assert not is_throttled(error)


def test_an_obstore_503_is_throttling_however_long_the_key_in_its_message() -> None:
    """obstore's message names the URL before the status; the error cloudshards makes of it
    keeps only the first 300 characters, and the status with it."""
    from cloudshards.source.objread import translate_error

    key = "/".join(["d" * 40] * 6)
    text = (
        f"Generic S3 error: Error performing GetObject http://h/b/{key}.tar in 21ms - "
        "Server returned non-2xx status code: 503 Service Unavailable: "
    )
    assert len(text) > 300
    error = translate_error(RuntimeError(text))
    assert isinstance(error, ConnectionError)  # retried
    assert is_throttled(error)
