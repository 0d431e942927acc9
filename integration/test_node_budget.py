"""The node's request budget under load: 2 processes ("ranks") x 8 DataLoader workers read
shards through the cloud simulator, which answers GETs beyond 60 per second with 503
SlowDown. The requests in flight never exceed the node's budget
(``CLOUDSHARDS_NODE_REQUESTS=6``, against 2 x 8 x 4 x 3 = 192 that the per-worker settings
alone allow), the throttling is answered by the node's shared backoff, and every sample
arrives once."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from cloudsim_fixtures import cloudsim_process_factory  # noqa: F401 - the fixture
from servers import NginxServer

READER = Path(__file__).with_name("node_budget_reader.py")
REPO = Path(__file__).resolve().parents[1]
SHARDS, SAMPLES, PAYLOAD = 16, 40, 16 << 10
BUDGET = 6

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _write_shards(
    root: Path,
    folder: str = "budget",
    shards: int = SHARDS,
    samples: int = SAMPLES,
    payload: int = PAYLOAD,
) -> list[str]:
    """``shards`` tar files under ``root/folder`` of ``samples`` members ``sSSSS_IIII.bin``
    of ``payload`` random bytes each; their names relative to ``root``."""
    names = []
    for shard in range(shards):
        name = f"{folder}/shard-{shard:04d}.tar"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(root / name, "w", format=tarfile.PAX_FORMAT) as tar:
            for index in range(samples):
                data = os.urandom(payload)
                info = tarfile.TarInfo(f"s{shard:04d}_{index:04d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        names.append(name)
    return names


def test_two_ranks_of_eight_workers_stay_inside_the_node_budget(
    http_server: NginxServer, cloudsim_process: Any, tmp_path: Path
) -> None:
    names = _write_shards(http_server.root)
    sim = cloudsim_process(http_server.base_url, latency_s=0.02, rate_limit_rps=60)
    urls = [f"{sim.url}/{name}" for name in names]
    env = {
        **os.environ,
        "CLOUDSHARDS_NODE_REQUESTS": str(BUDGET),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")])
        ),
    }
    outs = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(READER), json.dumps(urls), str(rank), "2", str(out)],
            env=env,
            stderr=subprocess.PIPE,
        )
        for rank, out in enumerate(outs)
    ]
    logs = []
    for process in processes:
        _, err = process.communicate(timeout=500)
        logs.append(err.decode(errors="replace"))
        assert process.returncode == 0, logs[-1][-3000:]
    keys = [key for out in outs for key in json.loads(out.read_text())]
    assert sorted(keys) == sorted(
        f"s{shard:04d}_{index:04d}" for shard in range(SHARDS) for index in range(SAMPLES)
    )
    stats = sim.stats()
    assert stats.gets_in_flight_max <= BUDGET, stats
    assert stats.gets_in_flight_max >= 2  # the budget is shared, not a lock on one request
    assert stats.throttled > 0, "the rate limit was never reached: the test shows nothing"
    assert any("this node waits" in log for log in logs), "no shared backoff"
