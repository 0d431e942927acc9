"""Guards against DDP hangs that need no second process to show: which stages make the ranks
end an epoch together, when a WebLoader's ranks meet for it, and which node splitters keep an
epoch balanced. (integration/test_end_together.py runs the ranks themselves.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import webdataset

import cloudshards as wds
from cloudshards import countfree
from cloudshards.countfree import CountFree, _may_drop
from cloudshards.datasetstages import _Split


def _drop_odd(src: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for sample in src:
        if int(sample["__key__"][-1]) % 2 == 0:
            yield sample


def test_a_generator_of_the_users_own_may_drop_samples(make_shards: Any) -> None:
    """``.compose(f)`` and ``pipelinefilter(f)`` filters were not looked for: a rank whose
    filter dropped more ran out of batches first, and the others waited for it forever."""
    shards = make_shards([4, 4])
    plain = wds.WebDataset(shards.spec()).map(lambda s: s).to_tuple("__key__").batched(2)
    assert not _may_drop(plain.pipeline)
    assert _may_drop(wds.WebDataset(shards.spec()).compose(_drop_odd).pipeline)
    curried = wds.filters.pipelinefilter(_drop_odd)()
    assert _may_drop(wds.WebDataset(shards.spec()).compose(curried).pipeline)
    assert _may_drop(wds.WebDataset(shards.spec()).select(bool).pipeline)


def test_a_webloaders_ranks_meet_at_its_first_batch_not_at_iter(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning calls ``iter()`` once on a loader to check it, and drops the iterator: the
    ranks' one meeting of the loader was spent there, so the real epoch's first batch went
    unchecked and a rank with nothing to read hung the others."""
    met: list[int] = []
    real = CountFree.begin

    def begin(self: CountFree, *args: Any, **kwargs: Any) -> bool:
        met.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CountFree, "begin", begin)
    shards = make_shards([4, 4])
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).to_tuple("__key__").batched(2)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=0)
    iter(loader)  # Lightning's check
    assert met == []
    assert len(list(loader)) == 4
    assert met == [1]


def _split_of(dataset: Any) -> _Split:
    (split,) = (stage for stage in dataset.pipeline if isinstance(stage, _Split))
    return split


def test_webdatasets_own_node_splitter_keeps_the_epoch_balanced(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``nodesplitter=webdataset.split_by_node`` (the webdataset package's function) splits as
    cloudshards' does: it is taken as cloudshards', and the epoch stays balanced. A splitter
    of the user's own cannot be balanced, which a multi-rank job is told."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    shards = make_shards([4, 6])
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        ds = wds.WebDataset(shards.spec(), nodesplitter=webdataset.split_by_node)
        assert _split_of(ds).nodesplitter is wds.split_by_node
        assert _split_of(ds).balance == "auto"
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        ds = wds.WebDataset(shards.spec(), nodesplitter=lambda src: wds.split_by_node(src))
        assert _split_of(ds).balance is None
    (record,) = caplog.records
    assert "not balanced" in record.getMessage()
    assert "hang DDP" in record.getMessage()
    monkeypatch.setenv("WORLD_SIZE", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        wds.WebDataset(shards.spec(), nodesplitter=lambda src: src)
    assert caplog.records == []  # one rank: nothing to balance


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_map_that_drops_samples_in_a_multi_rank_job_says_so_once(
    make_shards: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    world_size: str,
) -> None:
    """A map returning None drops the sample, as in webdataset, but the loaders do not look
    for it when they decide to end an epoch together: ranks could take unequal steps without
    a word. One warning per process names the map and points to select()."""
    from cloudshards.stages import transform

    monkeypatch.setattr(transform, "_told_none", False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world_size)
    shards = make_shards([6])

    def odd_only(sample: dict[str, Any]) -> dict[str, Any] | None:
        return sample if int(sample["__key__"][-1]) % 2 else None

    ds = wds.WebDataset(shards.spec(), shardshuffle=False, nodesplitter=None).map(odd_only)
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        assert len(list(ds)) == 3
        assert len(list(ds)) == 3
    told = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert len(told) == (1 if world_size == "2" else 0)
    if told:
        assert "odd_only" in told[0]
        assert ".select()" in told[0]


def test_a_loader_whose_group_was_left_at_exit_never_talks_through_the_default_group() -> None:
    """After the exit handler let go of cloudshards' gloo group, a collective from a later
    exit handler must fail: ``group=None`` would send it through the job's default group."""
    free = CountFree()
    with pytest.raises(RuntimeError, match="no group"):
        free._pg()  # the ranks have not met
    free._group = countfree._Group(None)  # as _leave_groups leaves it
    with pytest.raises(RuntimeError, match="no group"):
        free._pg()
