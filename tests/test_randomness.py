"""Library randomness is private and seeded: retries never move the user's global RNGs, and an
explicit seed alone fixes the sample order under a multi-worker DataLoader."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

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
