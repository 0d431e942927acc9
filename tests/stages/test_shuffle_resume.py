"""Exact resume through a shuffle buffer: the state names the buffered samples by position
(shard, sample), a restore reads them again, and the rest of the epoch is exactly what an
uninterrupted run delivers, at any point (filling, full, draining), with stages before the
shuffle, in DataLoader workers, from local files and from a store."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_state import UNEVEN, keys, resume_after
from torchdata.stateful_dataloader import StatefulDataLoader

import cloudshards as wds


@pytest.mark.parametrize("k", [0, 1, 2, 7, 10, 25, 29, 30, 31])
@pytest.mark.parametrize("buffer", [5, 50])
def test_resume_through_a_shuffle_buffer_is_exact(make_shards: Any, k: int, buffer: int) -> None:
    shards = make_shards(UNEVEN)  # 31 samples

    def build() -> Any:
        return wds.WebDataset(shards.spec(), shardshuffle=True, seed=6).shuffle(buffer)

    everything, resumed = resume_after(build, k, epoch=1)
    assert keys(resumed) == keys(everything)
    assert [s["bin"] for s in resumed] == [s["bin"] for s in everything]


def _double_cls(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "cls": sample["cls"] * 2}


def _odd(sample: dict[str, Any]) -> bool:
    return int(sample["__key__"][-1]) % 2 == 1


@pytest.mark.parametrize("k", [0, 3, 8, 12])
def test_stages_before_the_shuffle_are_applied_to_the_samples_read_again(
    make_shards: Any, k: int
) -> None:
    shards = make_shards(UNEVEN)

    def build() -> Any:
        return (
            wds.WebDataset(shards.spec(), shardshuffle=True, seed=2)
            .map(_double_cls)
            .select(_odd)
            .shuffle(6)
            .to_tuple("__key__", "cls")
        )

    everything, resumed = resume_after(build, k)
    assert resumed == everything


def test_the_state_is_positions_and_json(make_shards: Any) -> None:
    """No sample bytes in the state: the RNG's state and a (shard, sample) per buffered item."""
    shards = make_shards([40, 40], payload_bytes=10_000)
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).shuffle(30)
    it = iter(ds)
    for _ in range(12):
        next(it)
    state = ds.state_dict()
    text = json.dumps(state)
    buffered = state["stages"]["shuffle"]["buffer"]
    assert len(buffered) == 29  # full at 30, one just given out
    assert all(len(place) == 2 for place in buffered)
    assert len(text) < 20_000  # 30 samples of 10 kB would be 300 kB
    # 30 taken to fill the buffer, then one per item after the first: 41 read.
    assert state["stages"]["reader"] == {"shards": 2, "samples": 1}
    assert state["stages"]["shuffle"]["pulled"] == 41


def test_a_buffer_of_batches_is_not_saved_and_says_so(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """batched() before shuffle() gives one item per several samples: the buffer cannot be
    read again by position, so it is left out of the state (the old, approximate resume) with
    a warning, never a wrong item."""
    shards = make_shards(UNEVEN)

    def build() -> Any:
        return wds.WebDataset(shards.spec(), shardshuffle=True, seed=6).batched(2).shuffle(4)

    ds = build()
    it = iter(ds)
    for _ in range(3):
        next(it)
    with caplog.at_level("WARNING", logger="cloudshards.stages.shuffle"):
        state = ds.state_dict()
    assert "shuffle" not in state["stages"]
    assert any("batched before it" in r.getMessage() for r in caplog.records)
    everything, resumed = resume_after(build, 5)
    got = keys(resumed)
    assert len(got) == len(set(got))
    assert set(got) <= set(keys(everything))


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_with_a_shuffle_buffer_resumes_exactly(
    make_shards: Any, workers: int
) -> None:
    """The case that lost 198 samples before: 6 shards, .shuffle(100), 2 workers, a checkpoint
    after 137 samples."""
    shards = make_shards([60] * 6)

    def loader() -> StatefulDataLoader:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3).shuffle(100)
        ds.set_epoch(2)
        return StatefulDataLoader(ds.batched(1), batch_size=None, num_workers=workers)

    everything = keys(loader())
    assert len(everything) == 360
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(137)]
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    assert keys(head) + keys(second) == everything
