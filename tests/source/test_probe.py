"""The probe that tells connections sharing one bottleneck from connections capped one by one
(:mod:`cloudshards.source.adapt`): the host's first shard sends one part with no other large
GET of the host in flight, shards that wait for it lose nothing, and it is sent only where the
store answers fast."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_prefetch import expected, spec, upload
from test_prefetch import faultmem as faultmem  # the fixture

import cloudshards as wds
from cloudshards.source import adapt, parts

HOST = "faultmem://bucket/shard-000000.tar"
#: Shards of ~3 MiB: the default adaptive parts (2 MiB) leave a part after the first.
SIZES, PAYLOAD = [150] * 4, 20_000


@pytest.fixture(autouse=True)
def fresh_links() -> Iterator[None]:
    adapt.forget()
    yield
    adapt.forget()


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shards whose probe part was sent and came back."""
    came_back: list[str] = []
    probed = parts.PartStream._probed

    def spy(stream: parts.PartStream, future: object) -> None:
        came_back.append(stream.url)
        probed(stream, future)

    monkeypatch.setattr(parts.PartStream, "_probed", spy)
    return came_back


def read(shards: Any) -> list[tuple[str, bytes]]:
    # Adaptive settings (no part_bytes or concurrency given), as users get them.
    dataset = wds.WebDataset(spec(shards), shardshuffle=False, prefetch=2)
    return [(sample["__key__"], sample["bin"]) for sample in dataset]


def test_the_probe_part_is_measured_alone(
    make_shards: Any, faultmem: Any, probes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every GET takes 10 ms: without holding the other shards back, the probe part would
    # share its time with their parts and measure no connection alone.
    monkeypatch.setattr(adapt, "PROBE_FIRST_BYTE_S", 1.0)  # the gate is the next test's
    shards = upload(make_shards, SIZES, PAYLOAD)
    faultmem.delay_s = 0.01
    assert read(shards) == expected(shards)
    assert probes == [HOST]  # once per host and process
    assert adapt._link(HOST).alone is not None


def test_no_probe_where_the_first_answer_is_slow(
    make_shards: Any, faultmem: Any, probes: list[str]
) -> None:
    # A store behind a cloud's latency: the first shard's size comes after 30 ms.
    shards = upload(make_shards, SIZES, PAYLOAD)
    faultmem.info_gate = threading.Event()
    opened = threading.Timer(2 * adapt.PROBE_FIRST_BYTE_S, faultmem.info_gate.set)
    opened.start()
    assert read(shards) == expected(shards)
    opened.join()
    assert probes == []
    assert not adapt.wait_for_probe(HOST, lambda: None)  # over: nobody waits


@pytest.mark.parametrize("ends", ["done", "never"])
def test_readers_held_back_by_another_shards_probe_lose_nothing(
    make_shards: Any, faultmem: Any, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    # Another shard of the host (a cache download ahead, say) holds the probe: every shard
    # read here waits for it, its reader included, and then reads all of its samples.
    monkeypatch.setattr(adapt, "_PROBE_WAIT_S", 0.5)
    shards = upload(make_shards, SIZES, PAYLOAD)
    assert adapt.claim_probe(HOST)
    if ends == "done":
        timer = threading.Timer(0.2, adapt.probe_done, args=(HOST,))
        timer.start()
    began = time.perf_counter()
    assert read(shards) == expected(shards)
    assert time.perf_counter() - began >= 0.2  # it did wait
    if ends == "done":
        timer.join()
