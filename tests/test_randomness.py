"""Library randomness is private and seeded: retries never move the user's global RNGs, and an
explicit seed alone fixes the sample order under a multi-worker DataLoader."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch.utils.data import DataLoader

import cloudshards as wds

PACKAGE = Path(wds.__file__).parent


class FailOnceFileSystem(MemoryFileSystem):
    """``failonce://``: memory objects whose first ranged GET raises a connection reset."""

    protocol = "failonce"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    failures_left = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if path.startswith("failonce://"):
            path = path[len("failonce://") :]
        return "/" + path.lstrip("/")

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> bytes:
        cls = type(self)
        if cls.failures_left > 0:
            cls.failures_left -= 1
            raise ConnectionResetError("connection reset by peer (injected)")
        data: bytes = super().cat_file(path, start=start, end=end, **kw)
        return data


@pytest.fixture
def failonce() -> Iterator[type[FailOnceFileSystem]]:
    fsspec.register_implementation("failonce", FailOnceFileSystem, clobber=True)
    FailOnceFileSystem.store.clear()
    FailOnceFileSystem.failures_left = 0
    yield FailOnceFileSystem
    FailOnceFileSystem.store.clear()


def _global_draws() -> list[float]:
    return [random.random() for _ in range(5)] + [float(np.random.random()) for _ in range(2)]


def test_a_retry_leaves_the_users_random_sequence_alone(
    make_shards: Any, failonce: type[FailOnceFileSystem]
) -> None:
    shards = make_shards([4, 4])
    fs = fsspec.filesystem("failonce", skip_instance_cache=True)
    for path in shards.paths:
        fs.pipe(f"/bucket/{path.name}", path.read_bytes())
    url = "failonce://bucket/shard-{000000..000001}.tar"

    random.seed(0)
    np.random.seed(0)
    expected = _global_draws()

    failonce.failures_left = 1
    random.seed(0)
    np.random.seed(0)
    torch_state = torch.get_rng_state()
    ds = wds.WebDataset(url, shardshuffle=True, seed=3, retries=3, prefetch=0)
    before = ds.stats()["io"]["retries"]
    keys = [sample["__key__"] for sample in ds.shuffle(5)]
    assert ds.stats()["io"]["retries"] > before, "no retry happened: the test proves nothing"
    assert failonce.failures_left == 0
    assert sorted(keys) == sorted(shards.keys)
    assert _global_draws() == expected
    assert torch.equal(torch.get_rng_state(), torch_state)


_GLOBAL_RNG_CALL = re.compile(
    r"(?<![\w.])random\.(random|uniform|randint|randrange|choice|choices|shuffle|sample|gauss|"
    r"getrandbits|seed|triangular|betavariate|expovariate|normalvariate)\("
    r"|np\.random\.(?!default_rng\(|Generator\b|RandomState\()\w+"
    r"|torch\.(rand|randn|randint|randperm|rand_like|randn_like|bernoulli|multinomial|normal)"
    r"\((?![^)]*generator=)"
)


def test_no_module_level_rng_calls_in_the_package() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _GLOBAL_RNG_CALL.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == []


# ------------------------------------------------------------------ an explicit seed is enough


def _loader_orders(
    spec: str,
    *,
    torch_seed: int,
    workers: int = 2,
    epochs: int = 1,
    epoch: int | None = None,
    persistent: bool = False,
    **kw: Any,
) -> list[list[str]]:
    """Each epoch's sample keys through a fresh DataLoader, after ``torch.manual_seed``."""
    torch.manual_seed(torch_seed)
    ds = wds.WebDataset(spec, shardshuffle=True, **kw).shuffle(6)
    if epoch is not None:
        ds.set_epoch(epoch)
    loader = DataLoader(
        ds, batch_size=None, num_workers=workers, persistent_workers=persistent and workers > 0
    )
    return [[sample["__key__"] for sample in loader] for _ in range(epochs)]


@pytest.mark.parametrize("workers", [1, 2])
def test_seed_alone_fixes_the_order_whatever_the_torch_seed(make_shards: Any, workers: int) -> None:
    shards = make_shards([5] * 6)
    first = _loader_orders(shards.spec(), torch_seed=1, workers=workers, seed=7)
    again = _loader_orders(shards.spec(), torch_seed=2, workers=workers, seed=7)
    assert sorted(first[0]) == sorted(shards.keys)
    assert again == first


def test_seed_and_epoch_both_change_the_order(make_shards: Any) -> None:
    shards = make_shards([5] * 6)
    base = _loader_orders(shards.spec(), torch_seed=1, seed=7, epoch=0)
    assert _loader_orders(shards.spec(), torch_seed=1, seed=8, epoch=0) != base
    later = _loader_orders(shards.spec(), torch_seed=2, seed=7, epoch=1)
    assert later != base
    assert _loader_orders(shards.spec(), torch_seed=3, seed=7, epoch=1) == later
    # Persistent workers count epochs themselves: new order per epoch, same on a rerun.
    persistent = _loader_orders(shards.spec(), torch_seed=4, seed=7, epochs=2, persistent=True)
    assert persistent[0] == base[0]
    assert persistent[1] == later[0]


_RUN_IN_A_FRESH_PROCESS = """
import json, sys
import torch
from torch.utils.data import DataLoader
import cloudshards as wds
torch.manual_seed(int(sys.argv[2]))
ds = wds.WebDataset(sys.argv[1], shardshuffle=True, seed=7).shuffle(6)
print(json.dumps([s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]))
"""


def test_seed_fixes_the_order_across_processes(make_shards: Any) -> None:
    shards = make_shards([5] * 6)
    result = subprocess.run(
        [sys.executable, "-c", _RUN_IN_A_FRESH_PROCESS, shards.spec(), "12345"],
        capture_output=True,
        text=True,
        check=True,
        timeout=100,
    )
    assert json.loads(result.stdout) == _loader_orders(shards.spec(), torch_seed=1, seed=7)[0]


def test_env_seed_counts_as_given(make_shards: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards([5] * 6)
    monkeypatch.setenv("CLOUDSHARDS_SEED", "7")
    from_env = _loader_orders(shards.spec(), torch_seed=1)
    assert from_env == _loader_orders(shards.spec(), torch_seed=2)
    monkeypatch.delenv("CLOUDSHARDS_SEED")
    assert from_env == _loader_orders(shards.spec(), torch_seed=3, seed=7)


def test_without_a_seed_one_rank_follows_the_torch_seed(make_shards: Any) -> None:
    shards = make_shards([5] * 6)
    first = _loader_orders(shards.spec(), torch_seed=1, epochs=2)
    assert _loader_orders(shards.spec(), torch_seed=1, epochs=2) == first
    assert first[0] != first[1]  # fresh workers still reshuffle each epoch
    assert _loader_orders(shards.spec(), torch_seed=2) != first[:1]


def test_without_a_seed_ranks_agree_whatever_their_torch_seeds(make_shards: Any) -> None:
    shards = make_shards([5] * 8)
    seen: list[str] = []
    for rank in range(2):
        (keys,) = _loader_orders(
            shards.spec(), torch_seed=100 + rank, rank=rank, world_size=2, balance=None
        )
        seen += keys
    assert sorted(seen) == sorted(shards.keys)


def test_fresh_workers_without_set_epoch_are_warned(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([2] * 4)
    # What a DataLoader worker of a non-persistent loader sees: epoch 0, every epoch.
    monkeypatch.setenv("WORKER", "0")
    monkeypatch.setenv("NUM_WORKERS", "2")
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=7)
    with caplog.at_level("WARNING", logger="cloudshards"):
        list(ds)
    assert "set_epoch" in caplog.text


@pytest.mark.parametrize(("passes", "warned"), [(1, False), (2, True)])
def test_a_stateful_loaders_first_pass_needs_no_set_epoch(
    make_shards: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    passes: int,
    warned: bool,
) -> None:
    """Lightning starts a StatefulLoader's workers before its epoch-start hooks, where
    training code calls set_epoch: the first pass (epoch 0, right by default) is not warned
    about; a second one without set_epoch is."""
    shards = make_shards([2] * 4)
    monkeypatch.setenv("WORKER", "0")
    monkeypatch.setenv("NUM_WORKERS", "2")
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=7)
    ds.__dict__["_loader_passes"] = passes  # what StatefulLoader counts before its workers fork
    with caplog.at_level("WARNING", logger="cloudshards"):
        list(ds)
    assert ("set_epoch" in caplog.text) is warned


def test_a_stateful_loader_counts_its_passes(make_shards: Any) -> None:
    shards = make_shards([2] * 4)
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=7)
    loader = wds.StatefulLoader(ds, batch_size=2)
    for expected in (1, 2):
        list(loader)
        assert ds.__dict__["_loader_passes"] == expected


def test_fresh_workers_draw_new_resampled_shards_each_epoch(make_shards: Any) -> None:
    """A plain DataLoader without persistent workers or set_epoch (Lightning's, HF's) gets
    new draws each epoch, as webdataset's do; a seed the user gives fixes them."""
    import torch

    shards = make_shards([4] * 6)

    def draws(epochs: int, **kw: Any) -> list[list[str]]:
        torch.manual_seed(1)
        data = wds.WebDataset(shards.spec(), resampled=True, **kw).to_tuple("__url__")
        loader = torch.utils.data.DataLoader(data.with_epoch(12), batch_size=None, num_workers=2)
        return [[url for (url,) in loader] for _ in range(epochs)]

    fresh = draws(3)
    assert len({tuple(epoch) for epoch in fresh}) == 3
    assert draws(3) == fresh  # the torch seed decides them
    seeded = draws(2, seed=5)
    assert seeded[0] == seeded[1]
