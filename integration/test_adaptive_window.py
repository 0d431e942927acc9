"""Bytes in flight follow the reader (issue 17): behind the cloud simulator (30 ms before each
request, 25 MB/s per connection), a reader that takes about 20 MB/s (a training step per
sample) keeps a few ranged GETs (and their buffers) in flight per shard once its demand is
measured, where the same reader with the fixed settings (16 parts of 2 MiB per shard) asks
for every part of each shard it opens ahead at once. Both read every sample once."""

from __future__ import annotations

import time
from typing import Any

import pytest
from cloudsim_fixtures import cloudsim_process_factory  # noqa: F401 - the fixture
from servers import NginxServer
from test_node_budget import _write_shards

import cloudshards as wds
from cloudshards.source import adapt

SHARDS, SAMPLES, PAYLOAD = 7, 256, 64 << 10  # 16 MiB shards: 8 parts of 2 MiB
#: The reader's own time per sample: ~64 KiB / 3 ms, about 20 MB/s.
STEP_S = 0.003
#: Shards read before the counters start (the first ones are fetched before any
#: measurement, with the fixed settings, and the two prefetched behind them too).
WARMUP = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _read(urls: list[str], sim: Any, **fetch: int) -> tuple[list[str], int]:
    """Read every sample at the reader's pace; the most GETs in flight once warmed up."""
    adapt.forget()
    keys: list[str] = []
    dataset = wds.WebDataset(urls, shardshuffle=False, **fetch)
    shards_done: set[str] = set()
    for sample in dataset:
        shard = sample["__url__"]
        if shard not in shards_done:
            shards_done.add(shard)
            if len(shards_done) == WARMUP + 1:
                sim.reset_stats()
        keys.append(sample["__key__"])
        time.sleep(STEP_S)
    return keys, sim.stats().gets_in_flight_max


def test_a_slow_reader_keeps_fewer_gets_in_flight(
    http_server: NginxServer, cloudsim_process: Any
) -> None:
    names = _write_shards(http_server.root, "window", SHARDS, SAMPLES, PAYLOAD)
    sim = cloudsim_process(http_server.base_url, latency_s=0.03, bandwidth_bps=25e6)
    urls = [f"{sim.url}/{name}" for name in names]
    expected = [f"s{shard:04d}_{index:04d}" for shard in range(SHARDS) for index in range(SAMPLES)]

    adaptive_keys, adaptive_most = _read(urls, sim)
    fixed_keys, fixed_most = _read(urls, sim, part_bytes=2 << 20, concurrency=16)

    assert adaptive_keys == expected
    assert fixed_keys == expected
    # Fixed: each shard opened ahead asks for all 8 of its parts at once (measured: 9, with
    # the next shard's first part). Measured: ~20 MB/s of demand over ~18 MB/s a connection
    # brings is 3 parts a shard (measured: 4 GETs in flight, with a first part); a loaded
    # machine whose simulator carries ~10 MB/s a connection needs up to 5 (6 with a first
    # part). Without the demand, the windows hold all 8 parts, as the fixed ones do.
    assert fixed_most >= 8, fixed_most
    assert adaptive_most <= 6, (adaptive_most, fixed_most)


def test_connections_sharing_one_bottleneck_get_larger_parts(
    http_server: NginxServer, cloudsim_process: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose connections share one bottleneck (a server on the local network: no
    added latency, 100 MB/s for every answer together). 16 parts in flight carry about 6 MB/s
    each, which keeps 2 MiB parts; the first shard's part sent alone carries several times
    that, so the shards planned after it are read in fewer, larger parts."""
    # The gate (only where the first answer came fast) is the unit tests'; a loaded machine's
    # first answer through the Python simulator can take longer than a local store's.
    monkeypatch.setattr(adapt, "PROBE_FIRST_BYTE_S", 0.5)
    shards, samples = 12, 256  # 16 MiB shards: 11 GETs each in 2 MiB parts
    names = _write_shards(http_server.root, "shared", shards, samples, PAYLOAD)
    sim = cloudsim_process(http_server.base_url, total_bandwidth_bps=100e6)
    urls = [f"{sim.url}/{name}" for name in names]
    expected = [f"s{shard:04d}_{index:04d}" for shard in range(shards) for index in range(samples)]

    def read() -> tuple[int, float | None, float | None]:
        """GETs for the epoch; what one connection carried alone, and under load."""
        adapt.forget()
        dataset = wds.WebDataset(urls, shardshuffle=False)
        before = dataset.stats()["io"]["requests"]  # the process's counters
        assert [sample["__key__"] for sample in dataset] == expected
        link = adapt._link(urls[0])
        return int(dataset.stats()["io"]["requests"] - before), link.alone, link.rate

    probed, alone, loaded = read()
    monkeypatch.setattr(adapt, "claim_probe", lambda url: False)
    unprobed, _, _ = read()
    # Measured: alone 43-48 MB/s, under load 6-7; 3 MiB parts for the nine shards planned
    # after the probe: 96-105 GETs, against 132 in 2 MiB parts without it.
    assert alone is not None, "the probe measured nothing"
    assert loaded is not None
    assert alone > 3 * loaded, (alone, loaded)
    assert probed < unprobed, (probed, unprobed)
