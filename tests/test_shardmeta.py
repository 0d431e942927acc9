"""Sample counts from the metadata dataset tools write beside shards (sizes.json, timm's
_info.json, img2dataset's *_stats.json): balanced epochs use them instead of counting."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import cloudshards as wds
from cloudshards.balance import resolve_sample_counts
from cloudshards.shardmeta import counts_from_metadata

SIZES = [4, 7, 5]


def _urls(shards: Any) -> list[str]:
    return [str(path) for path in shards.paths]


def _write(directory: Path, name: str, data: Any) -> None:
    (directory / name).write_text(json.dumps(data))


def test_sizes_json(make_shards: Any) -> None:
    shards = make_shards(SIZES)
    directory = shards.paths[0].parent
    _write(directory, "sizes.json", {p.name: n for p, n in zip(shards.paths, SIZES, strict=True)})
    assert counts_from_metadata(_urls(shards), None) == SIZES


def test_timm_info(make_shards: Any) -> None:
    shards = make_shards(SIZES)
    directory = shards.paths[0].parent
    info = {
        "name": "demo",
        "splits": {
            "train": {
                "name": "train",
                "num_samples": sum(SIZES),
                "filenames": [p.name for p in shards.paths],
                "shard_lengths": SIZES,
            }
        },
    }
    _write(directory, "_info.json", info)
    assert counts_from_metadata(_urls(shards), None) == SIZES


def test_img2dataset_stats(make_shards: Any) -> None:
    shards = make_shards(SIZES)
    for path, count in zip(shards.paths, SIZES, strict=True):
        stats = {"count": count + 2, "successes": count, "failed_to_download": 2}
        _write(path.parent, path.name.replace(".tar", "_stats.json"), stats)
    assert counts_from_metadata(_urls(shards), None) == SIZES


@pytest.mark.parametrize(
    "sizes",
    [
        {"shard-000000.tar": 4},  # does not name every shard
        {"shard-000000.tar": 4, "shard-000001.tar": -7, "shard-000002.tar": 5},  # not a count
        ["not", "a", "table"],
    ],
)
def test_metadata_that_does_not_cover_the_shards_is_passed_over(
    make_shards: Any, sizes: Any
) -> None:
    shards = make_shards(SIZES)
    _write(shards.paths[0].parent, "sizes.json", sizes)
    (shards.paths[0].parent / "_info.json").write_text("{not json")
    assert counts_from_metadata(_urls(shards), None) is None


def test_balanced_epochs_use_the_metadata_instead_of_counting(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards(SIZES)
    # Counts chosen to differ from the shards' real ones: only the metadata can give them.
    claimed = [3, 6, 5]
    _write(
        shards.paths[0].parent,
        "sizes.json",
        dict(zip([p.name for p in shards.paths], claimed, strict=True)),
    )
    caplog.set_level(logging.INFO, logger="cloudshards")
    assert resolve_sample_counts(_urls(shards)) == claimed
    assert "counting the samples" not in caplog.text
    assert "from their sizes_json" in caplog.text
    both = [
        [s["__key__"] for s in wds.WebDataset(shards.spec(), rank=rank, world_size=2)]
        for rank in (0, 1)
    ]
    assert len(both[0]) == len(both[1]) == sum(claimed) // 2
