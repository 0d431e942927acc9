"""pytest fixtures for the cloud simulator (``cloudsim.py``).

``cloudsim(upstream_url, **knobs)`` starts an in-process proxy (its own thread and event loop)
and ``cloudsim_process(upstream_url, **knobs)`` one in a subprocess; both are stopped at
teardown. ``via(sim, remote)`` re-points a ``RemoteDataset`` (conftest.py) at the proxy.

The fixture functions are named ``*_factory`` and registered as ``cloudsim`` and
``cloudsim_process``, so importing them does not clash with the parameter names (ruff F811):
``from cloudsim_fixtures import cloudsim_factory, cloudsim_process_factory  # noqa: F401``
in a test module or in ``integration/conftest.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from cloudsim import CloudSim, CloudSimProcess, SimConfig, SimStats

__all__ = ["Sim", "cloudsim_factory", "cloudsim_process_factory", "via"]


class Sim(Protocol):
    """What both kinds of simulator offer."""

    @property
    def url(self) -> str: ...

    def configure(self, **knobs: Any) -> SimConfig: ...

    def stats(self) -> SimStats: ...

    def reset_stats(self) -> None: ...


@pytest.fixture(name="cloudsim")
def cloudsim_factory() -> Iterator[Callable[..., CloudSim]]:
    """Factory: ``cloudsim(upstream_url, **knobs) -> CloudSim`` (in-process, stopped after)."""
    started: list[CloudSim] = []

    def start(upstream_url: str, **knobs: Any) -> CloudSim:
        sim = CloudSim(upstream_url, **knobs)
        started.append(sim)
        return sim.start()

    yield start
    for sim in reversed(started):
        sim.stop()


@pytest.fixture(name="cloudsim_process")
def cloudsim_process_factory(tmp_path: Path) -> Iterator[Callable[..., CloudSimProcess]]:
    """Factory: ``cloudsim_process(upstream_url, **knobs) -> CloudSimProcess`` (killed after)."""
    started: list[CloudSimProcess] = []

    def start(upstream_url: str, **knobs: Any) -> CloudSimProcess:
        log = tmp_path / f"cloudsim-{len(started)}.log"
        sim = CloudSimProcess.start(upstream_url, log_path=log, **knobs)
        started.append(sim)
        return sim

    yield start
    for sim in reversed(started):
        sim.stop()


def via(sim: Sim, remote: Any) -> Any:
    """Return a copy of a conftest ``RemoteDataset`` whose URLs/options go through ``sim``."""
    server = remote.server
    if remote.protocol == "http":
        base = remote.base_url.replace(server.base_url, sim.url, 1)
        url = remote.url.replace(server.base_url, sim.url, 1)
        return dataclasses.replace(remote, base_url=base, url=url)
    options = {
        proto: {**opts, "endpoint_url": sim.url} for proto, opts in remote.storage_options.items()
    }
    env = {name: value.replace(server.endpoint_url, sim.url) for name, value in remote.env.items()}
    return dataclasses.replace(remote, storage_options=options, env=env)
