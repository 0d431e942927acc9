"""The home page's S3 training loop (docs/index.md), run as a user would copy it: credentials
and endpoint from the environment only, against moto. Only the bucket URL and the cache
directory are put in for the page's placeholders."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import cloudshards as wds
from cloudshards.cache import ShardCache

if TYPE_CHECKING:
    from servers import S3Server

HOME = Path(__file__).resolve().parents[1] / "docs" / "index.md"
BUCKET = "docs-home"
SHARDS, PER_SHARD = 4, 16
PLACEHOLDER_URL = "s3://my-bucket/train-{000000..000099}.tar"
PLACEHOLDER_CACHE = "/local_nvme/cache"


def home_training_loop() -> str:
    text = HOME.read_text(encoding="utf-8")
    (code,) = re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert PLACEHOLDER_URL in code
    assert PLACEHOLDER_CACHE in code
    assert "storage_options" not in code  # credentials and endpoint come from the environment
    return code


def test_the_home_page_trains_from_s3(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    local = tmp_path / "shards"
    local.mkdir()
    with wds.ShardWriter(str(local / "train-%06d.tar"), maxcount=PER_SHARD) as sink:
        for index in range(SHARDS * PER_SHARD):
            image = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            sink.write({"__key__": f"s{index:05d}", "jpg": image, "cls": index % 10})
    fs = s3_server.filesystem()
    fs.mkdir(BUCKET)
    for path in sorted(local.iterdir()):
        fs.put(str(path), f"{BUCKET}/{path.name}")

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    cache_dir = tmp_path / "cache"
    url = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
    code = home_training_loop().replace(PLACEHOLDER_URL, url)
    code = code.replace(PLACEHOLDER_CACHE, str(cache_dir))
    namespace: dict[str, Any] = {"__name__": "docs_home"}
    with warnings.catch_warnings():
        # torch warns when num_workers exceeds this machine's cores; the page shows a real value.
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        exec(compile(code, str(HOME), "exec"), namespace)

    assert namespace["epoch"] == 1
    assert namespace["images"].shape[1:] == (3, 16, 16)
    assert bool(namespace["loss"].isfinite())
    info = ShardCache(str(cache_dir)).info()
    assert info["entries"] == SHARDS
    assert info["partial"] == 0
    counters = info["counters"]
    assert counters["misses"] == SHARDS  # the first epoch downloads each shard once
    assert counters["hits"] >= SHARDS  # the second reads them from the cache
