"""Shared unit-test fixtures: a shard factory (tars generated, never committed), a clean
environment, and a check that no test leaks threads."""

from __future__ import annotations

import io
import json
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class Shards:
    """Shards written by :func:`make_shards`.

    Attributes:
        paths: Shard files, in order.
        samples: Expected samples in order: ``(key, {field: bytes})``.
        per_shard: Number of samples in each shard.
    """

    paths: list[Path]
    samples: list[tuple[str, dict[str, bytes]]] = field(default_factory=list)
    per_shard: list[int] = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        """Sample keys in order."""
        return [key for key, _ in self.samples]

    def spec(self) -> str:
        """A brace spec covering all shards (they share a directory and a 6-digit pattern)."""
        directory = self.paths[0].parent
        return f"{directory}/shard-{{000000..{len(self.paths) - 1:06d}}}.tar"


def sample_fields(shard: int, index: int, payload_bytes: int) -> dict[str, bytes]:
    """The fields of sample ``index`` of shard ``shard``: deterministic, distinct contents."""
    key = f"s{shard:04d}_{index:06d}"
    payload = (key.encode() * (payload_bytes // len(key) + 1))[:payload_bytes]
    return {
        "bin": payload,
        "json": json.dumps({"key": key, "shard": shard, "index": index}).encode(),
        "cls": str((shard * 7 + index) % 10).encode(),
    }


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]], fmt: int) -> None:
    """Write samples as a WebDataset tar (one member per field, ``key.field``)."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def make_shards(tmp_path: Path) -> Callable[..., Shards]:
    """Factory: ``make_shards(sizes=[3, 5], payload_bytes=100, fmt=tarfile.PAX_FORMAT)``."""

    def make(
        sizes: list[int] | None = None,
        *,
        payload_bytes: int = 100,
        fmt: int = tarfile.PAX_FORMAT,
        directory: Path | None = None,
    ) -> Shards:
        sizes = sizes if sizes is not None else [5, 5, 5, 5]
        directory = directory or tmp_path / "shards"
        directory.mkdir(parents=True, exist_ok=True)
        shards = Shards(paths=[])
        for shard, count in enumerate(sizes):
            samples = [
                (f"s{shard:04d}_{i:06d}", sample_fields(shard, i, payload_bytes))
                for i in range(count)
            ]
            path = directory / f"shard-{shard:06d}.tar"
            write_tar(path, samples, fmt)
            shards.paths.append(path)
            shards.samples.extend(samples)
            shards.per_shard.append(count)
        return shards

    return make


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Remove variables that change cloudshards' behaviour (rank, seeds, opt-ins); sample
    counts for balanced epochs go to a temporary directory, not the user's home."""
    import os

    for name in list(os.environ):
        if name.startswith(("CLOUDSHARDS_", "WDS_")) or name in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "WORKER",
            "NUM_WORKERS",
        ):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSHARDS_COUNTS_DIR", str(tmp_path_factory.mktemp("counts")))
    from cloudshards.source import adapt

    adapt.forget()  # part sizes measured by earlier tests
    from cloudshards.source import budget

    # The node's request slots and shared backoff: a directory of the test's own, so that a
    # throttling test does not make the next ones wait.
    monkeypatch.setenv("CLOUDSHARDS_NODE_DIR", str(tmp_path_factory.mktemp("node")))
    budget.forget()


#: Every thread cloudshards starts is named with this prefix (threading.Thread(name=...),
#: ThreadPoolExecutor(thread_name_prefix=...)); they are daemon threads, or pool threads
#: that inherit daemon from a daemon thread, so the daemon flag alone would hide them.
LIBRARY_THREAD_PREFIX = "cloudshards"

#: How long, in all, threads a test stopped may take to finish before they count as leaked.
THREAD_GRACE_S = 2.0


def _leak_candidates(before: set[threading.Thread]) -> list[threading.Thread]:
    """New threads still alive: any non-daemon thread, and cloudshards' own, daemon or not."""
    return [
        thread
        for thread in threading.enumerate()
        if thread not in before
        and thread.is_alive()
        and (not thread.daemon or thread.name.startswith(LIBRARY_THREAD_PREFIX))
    ]


@pytest.fixture(autouse=True)
def no_thread_leaks() -> Iterator[None]:
    """Fail a test that leaves new threads running: non-daemon threads, and cloudshards'
    threads whether daemon or not (a leaked download or pool thread keeps running into
    later tests and into the workers they fork). Threads that are finishing get
    THREAD_GRACE_S in all; the list is re-read after each join, so threads started while
    others finish are waited for and counted too."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_GRACE_S
    leaked = _leak_candidates(before)
    while leaked and time.monotonic() < deadline:
        leaked[0].join(timeout=max(0.0, deadline - time.monotonic()))
        leaked = _leak_candidates(before)
    assert not leaked, (
        f"test leaked threads (still alive {THREAD_GRACE_S:.0f} s after it ended): "
        + ", ".join(f"{t.name} (daemon={t.daemon})" for t in leaked)
    )
