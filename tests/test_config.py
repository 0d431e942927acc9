"""Environment defaults: CLOUDSHARDS_* first, webdataset's WDS_* variables as a fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import cloudshards as wds
from cloudshards import config
from cloudshards.errors import ConfigError
from cloudshards.indexed import IndexedDataset
from cloudshards.source import FetchOptions, OpenOptions


@pytest.mark.parametrize(
    ("text", "expected"), [("1000", 1000), ("1e18", 10**18), ("2.5e3", 2500), ("0", 0)]
)
def test_cache_size_accepts_webdatasets_float_format(
    monkeypatch: pytest.MonkeyPatch, text: str, expected: int
) -> None:
    monkeypatch.setenv("WDS_CACHE", "/tmp/somewhere")
    monkeypatch.setenv("WDS_CACHE_SIZE", text)
    assert config.cache_defaults() == ("/tmp/somewhere", expected)


@pytest.mark.parametrize("text", ["lots", "1.5", "inf", "nan"])
def test_cache_size_must_be_a_whole_number_of_bytes(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_CACHE_SIZE", text)
    with pytest.raises(ConfigError, match="whole number of bytes"):
        config.cache_defaults()


def test_cloudshards_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WDS_CACHE", "/tmp/wds")
    monkeypatch.setenv("CLOUDSHARDS_CACHE_DIR", "/tmp/cs")
    monkeypatch.setenv("WDS_CACHE_SIZE", "5")
    monkeypatch.setenv("CLOUDSHARDS_CACHE_SIZE", "7")
    assert config.cache_defaults() == ("/tmp/cs", 7)


# --- explicit arguments win over the environment -------------------------------------------


def test_explicit_fetch_options_win_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_RETRIES", "9")
    monkeypatch.setenv("CLOUDSHARDS_PREFETCH", "7")
    monkeypatch.setenv("CLOUDSHARDS_CONCURRENCY", "3")
    options = FetchOptions.from_env(retries=2, prefetch=0, concurrency=None)
    assert (options.retries, options.prefetch, options.concurrency) == (2, 0, 3)


def test_a_bad_variable_does_not_fail_the_argument_that_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("PREFETCH", "PART_BYTES", "CONCURRENCY", "RETRIES", "STALL_TIMEOUT_S"):
        monkeypatch.setenv("CLOUDSHARDS_" + name, "lots")
    options = FetchOptions.from_env(
        prefetch=1, part_bytes=1 << 20, concurrency=2, retries=0, stall_timeout_s=5.0
    )
    assert (options.prefetch, options.retries, options.stall_timeout_s) == (1, 0, 5.0)
    with pytest.raises(ConfigError, match="CLOUDSHARDS_RETRIES"):
        FetchOptions.from_env(prefetch=1, part_bytes=1 << 20, concurrency=2, stall_timeout_s=5.0)


def test_explicit_cache_dir_and_size_win_over_the_environment(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shards = make_shards([2])
    monkeypatch.setenv("CLOUDSHARDS_CACHE_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("CLOUDSHARDS_CACHE_SIZE", "5000")
    mine = tmp_path / "mine"
    dataset = wds.WebDataset(shards.spec(), shardshuffle=False, cache_dir=mine, cache_size=123)
    assert dataset.cache is not None
    assert (dataset.cache.directory, dataset.cache.max_bytes) == (str(mine), 123)
    with IndexedDataset(shards.spec(), cache_dir=mine, cache_size=456) as indexed:
        assert indexed.cache is not None
        assert (indexed.cache.directory, indexed.cache.max_bytes) == (str(mine), 456)
    # A bad size in the environment does not fail a call that gives the size.
    monkeypatch.setenv("CLOUDSHARDS_CACHE_SIZE", "lots")
    dataset = wds.WebDataset(shards.spec(), shardshuffle=False, cache_dir=mine, cache_size=123)
    assert dataset.cache is not None
    assert dataset.cache.max_bytes == 123
    with IndexedDataset(shards.spec(), cache_dir=mine, cache_size=456) as indexed:
        assert indexed.cache is not None
        assert indexed.cache.max_bytes == 456


def test_explicit_seed_pipe_and_member_limit_win_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_SEED", "7")
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PIPE", "1")
    monkeypatch.setenv("CLOUDSHARDS_MAX_MEMBER_BYTES", "4096")
    assert wds.DataPipeline(seed=3).seed == 3
    assert wds.DataPipeline().seed == 7
    assert OpenOptions(allow_pipe=False).pipe_allowed() is False
    assert OpenOptions(max_member_bytes=5000).member_limit() == 5000
    monkeypatch.setenv("CLOUDSHARDS_SEED", "junk")
    monkeypatch.setenv("CLOUDSHARDS_MAX_MEMBER_BYTES", "junk")
    assert wds.DataPipeline(seed=3).seed == 3
    assert OpenOptions(max_member_bytes=5000).member_limit() == 5000
