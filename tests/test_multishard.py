"""Dataset specs (spec.yaml, or a dict): which environment variables a spec may read."""

from __future__ import annotations

from pathlib import Path

import pytest

import cloudshards
from cloudshards.errors import ConfigError
from cloudshards.multishard import MultiShardSample

SECRET = "hunter2"


def test_a_spec_cannot_read_variables_outside_wds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec file from someone else cannot put a credential from the environment into a URL
    (where it would be requested, and shown in errors): only ``${NAME}`` from ``WDS_NAME``,
    the rule of every other shard spec, as webdataset's ``expand_urls`` has it."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    for spec_dict in (
        {"datasets": [{"shards": "http://host/leak/${AWS_SECRET_ACCESS_KEY}/x.tar"}]},
        {"prefix": "http://host/${AWS_SECRET_ACCESS_KEY}/", "datasets": [{"shards": "a.tar"}]},
        {"buckets": "${AWS_SECRET_ACCESS_KEY}", "datasets": [{"shards": "a.tar"}]},
    ):
        with pytest.raises(ConfigError, match="WDS_AWS_SECRET_ACCESS_KEY") as info:
            MultiShardSample(spec_dict)
        assert SECRET not in str(info.value)
    spec = tmp_path / "spec.yaml"
    spec.write_text("datasets:\n  - shards: http://host/leak/${AWS_SECRET_ACCESS_KEY}/x.tar\n")
    with pytest.raises(ConfigError, match="needs the environment variable WDS_AWS_") as info:
        next(iter(cloudshards.WebDataset(str(spec), shardshuffle=False)))
    assert SECRET not in str(info.value)
    # $NAME without braces is no reference at all: left as it is.
    bare = MultiShardSample({"datasets": [{"shards": "http://h/$AWS_SECRET_ACCESS_KEY.tar"}]})
    assert bare.get_shards_for_epoch() == ["http://h/$AWS_SECRET_ACCESS_KEY.tar"]


def test_a_spec_reads_wds_variables_and_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WDS_ROOT", "s3://bucket/train")
    monkeypatch.setenv("HOME", "/home/alice")
    spec = {
        "datasets": [
            {"shards": "${ROOT}/a-{0..1}.tar"},
            {"buckets": "~/data", "shards": "b.tar"},
        ]
    }
    assert sorted(MultiShardSample(spec).get_shards_for_epoch()) == [
        "/home/alice/data/b.tar",
        "s3://bucket/train/a-0.tar",
        "s3://bucket/train/a-1.tar",
    ]
