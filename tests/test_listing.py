"""Glob listings are shared by the processes of one job on a node: listed once, reused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import cloudshards as wds
from cloudshards.urls import expand_urls


def test_a_glob_is_listed_once_per_job_and_node(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shards = make_shards([3, 3])
    directory = shards.paths[0].parent
    pattern = f"{directory}/shard-*.tar"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    first = expand_urls(pattern)
    assert len(first) == 2
    make_shards([3], directory=tmp_path / "more")
    (tmp_path / "more" / "shard-000000.tar").rename(directory / "shard-000002.tar")
    assert expand_urls(pattern) == first  # the same job: the node's listing, not a new one
    saved = list((Path(os.environ["CLOUDSHARDS_COUNTS_DIR"]) / "listings").glob("*"))
    assert saved
    assert all("shard" not in path.name for path in saved)  # names are hashes
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    assert len(expand_urls(pattern)) == 3  # another job lists again
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert len(wds.WebDataset(pattern).pipeline[0].urls) == 3  # outside a job: every time
