"""Exact resume: ``state_dict()`` after k items, ``load_state_dict()`` in a fresh pipeline, and
the rest of the stream is what an uninterrupted run delivers (shuffle buffers: see
test_shuffle_resume.py); states from another dataset or layout are refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import cloudshards as wds
from cloudshards.errors import StateMismatchError

UNEVEN = [3, 1, 4, 1, 5, 9, 2, 6]


def keys(items: Any) -> list[str]:
    result: list[str] = []
    for item in items:
        if isinstance(item, dict) and isinstance(item["__key__"], list):
            result.extend(item["__key__"])
        else:
            result.append(item["__key__"])
    return result


def resume_after(build: Callable[[], Any], k: int, epoch: int = 0) -> tuple[list[Any], list[Any]]:
    """(uninterrupted epoch, first k items + the items after restoring at k)."""
    full = build()
    full.set_epoch(epoch)
    everything = list(full)
    first = build()
    first.set_epoch(epoch)
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = first.state_dict()
    it.close()  # type: ignore[attr-defined]
    second = build()
    second.load_state_dict(state)
    return everything, head + list(second)


@pytest.mark.parametrize("k", [0, 1, 3, 4, 9, 20, 31])
def test_resume_is_exact_mid_shard_and_at_boundaries(make_shards: Any, k: int) -> None:
    shards = make_shards(UNEVEN)
    everything, resumed = resume_after(
        lambda: wds.WebDataset(shards.spec(), shardshuffle=True, seed=4), k, epoch=2
    )
    assert keys(resumed) == keys(everything)


def test_resume_with_batches_and_decoding(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)

    def build() -> Any:
        return (
            wds.WebDataset(shards.spec(), shardshuffle=True, seed=1)
            .decode()
            .map(lambda s: {**s, "n": len(s["bin"])})
            .batched(4)
        )

    everything, resumed = resume_after(build, 3)
    assert keys(resumed) == keys(everything)


def test_resume_resampled_with_epoch(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)

    def build() -> Any:
        return wds.WebDataset(shards.spec(), resampled=True, seed=2).with_epoch(50)

    everything, resumed = resume_after(build, 37)
    assert len(everything) == 50
    assert keys(resumed) == keys(everything)


def test_resume_balanced_rank(make_shards: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards(UNEVEN)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    everything, resumed = resume_after(
        lambda: wds.WebDataset(shards.spec(), shardshuffle=True, seed=8), 5, epoch=1
    )
    assert len(everything) == 31 // 3
    assert keys(resumed) == keys(everything)


def test_after_the_restored_epoch_the_next_one_follows(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)
    reference = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
    epochs = [keys(reference) for _ in range(2)]
    first = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
    it = iter(first)
    head = [next(it)["__key__"] for _ in range(7)]
    state = first.state_dict()
    second = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
    second.load_state_dict(state)
    assert head + keys(second) == epochs[0]
    assert keys(second) == epochs[1]


def test_a_finished_epoch_resumes_at_the_next(make_shards: Any) -> None:
    shards = make_shards([2, 2])
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
    list(ds)
    state = ds.state_dict()
    assert state["epoch"] == 1
    again = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
    again.load_state_dict(state)
    reference = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
    reference.set_epoch(1)
    assert keys(again) == keys(reference)


def test_shuffle_buffer_resume_loses_at_most_the_buffer(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)
    buffer = 5

    def build() -> Any:
        return wds.WebDataset(shards.spec(), shardshuffle=True, seed=6).shuffle(buffer)

    everything, resumed = resume_after(build, 10)
    got = keys(resumed)
    assert len(set(got)) == len(got)  # nothing twice
    assert set(got) <= set(keys(everything))
    assert len(everything) - len(got) <= buffer


def test_state_from_another_dataset_is_refused(make_shards: Any, tmp_path: Any) -> None:
    shards = make_shards([3, 3])
    other = make_shards([3, 3, 3], directory=tmp_path / "other")
    ds = wds.WebDataset(shards.spec(), shardshuffle=True)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    with pytest.raises(StateMismatchError, match="different dataset"):
        wds.WebDataset(other.spec(), shardshuffle=True).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not a cloudshards"):
        wds.WebDataset(shards.spec()).load_state_dict({"epoch": 3})


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"epoch": "x"}, "epoch"),
        ({"consumer": None}, "consumer"),
        ({"stages": {"reader": {"shards": 1, "samples": -5}}}, "reader position"),
        ({"stages": {"reader": {"shards": "x", "samples": 1}}}, "reader position"),
    ],
    ids=["epoch", "consumer", "negative", "not a number"],
)
def test_a_damaged_state_of_this_dataset_is_refused(
    make_shards: Any, edit: dict[str, Any], named: str
) -> None:
    """Its fingerprint matches, but a position in it is not a count: a negative sample number
    gave samples twice, others a bare KeyError or ValueError."""
    spec = make_shards([3, 3]).spec()
    ds = wds.WebDataset(spec, shardshuffle=True)
    it = iter(ds)
    next(it)
    state = {**ds.state_dict(), **edit}
    with pytest.raises(StateMismatchError, match=f"whose {named}"):
        wds.WebDataset(spec, shardshuffle=True).load_state_dict(state)


def test_state_from_another_rank_layout_is_refused(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    ds = wds.WebDataset(shards.spec(), shardshuffle=True)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    restored = wds.WebDataset(shards.spec(), shardshuffle=True)
    restored.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="same number of ranks"):
        next(iter(restored))


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(make_shards: Any, workers: int) -> None:
    shards = make_shards(UNEVEN * 2)

    def loader() -> StatefulDataLoader:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=7).batched(3)
        ds.set_epoch(1)  # as training loops do; without it workers mix in torch's seed
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    everything = keys(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    assert keys(head) + keys(second) == everything


def test_a_worker_whose_share_ended_resumes_with_nothing_more(make_shards: Any) -> None:
    """Loader-side batches, 2 workers, uneven shares: a state saved after one worker sent
    its last batch, while the other still reads, restores that worker empty for the rest of
    the epoch (torchdata asks it for one more batch; a new pass would repeat its share)."""
    shards = make_shards([5, 13, 7, 11, 3, 9])

    def loader(epoch: int = 0) -> StatefulDataLoader:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5).to_tuple("__key__")
        ds.set_epoch(epoch)
        return wds.StatefulLoader(ds, batch_size=4, num_workers=2)

    def batches(source: Any) -> list[list[str]]:
        return [list(batch[0]) for batch in source]

    everything, following = batches(loader()), batches(loader(1))
    assert sorted(key for batch in everything for key in batch) == sorted(shards.keys)
    for k in range(len(everything) - 4, len(everything)):  # the last ones: a share has ended
        first = loader()
        it = iter(first)
        head = [list(next(it)[0]) for _ in range(k)]
        state = first.state_dict()
        del it
        second = loader()
        second.load_state_dict(state)
        assert head + batches(second) == everything, k
        second.dataset.set_epoch(1)
        assert batches(second) == following, k


def test_plain_dataloader_still_works_without_state(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)
    ds = wds.WebDataset(shards.spec(), shardshuffle=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(keys(loader)) == sorted(shards.keys)


def test_stateful_dataloader_resume_keeps_the_workers_seed(make_shards: Any) -> None:
    # No set_epoch: the workers' shard order mixes in torch's per-iteration seed, which the
    # state carries, so the restored loader continues the interrupted run's own order.
    shards = make_shards(UNEVEN * 2)

    def loader() -> StatefulDataLoader:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True).batched(2)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2)

    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = first.state_dict()
    tail = list(it)
    second = loader()
    second.load_state_dict(state)
    assert keys(second) == keys(tail)
    assert sorted(keys(head) + keys(tail)) == sorted(shards.keys)


@pytest.mark.parametrize("k", [30, 31, 32])
def test_with_epoch_resumes_exactly_at_the_end_of_a_pass(make_shards: Any, k: int) -> None:
    # with_epoch(50) over 31 samples runs a second pass; a state saved after the first pass's
    # last sample restores a pass with nothing left, which must not end the epoch.
    shards = make_shards(UNEVEN)
    everything, resumed = resume_after(
        lambda: wds.WebDataset(shards.spec(), shardshuffle=True, seed=4).with_epoch(50), k
    )
    assert len(everything) == 50
    assert keys(resumed) == keys(everything)


@pytest.mark.parametrize("k", [31, 62])
def test_repeat_resumes_exactly_at_the_end_of_a_pass(make_shards: Any, k: int) -> None:
    shards = make_shards(UNEVEN)
    everything, resumed = resume_after(
        lambda: wds.WebDataset(shards.spec(), shardshuffle=True, seed=4).repeat(3), k
    )
    assert len(everything) == 93
    assert keys(resumed) == keys(everything)


@pytest.mark.parametrize(
    "stage",
    [
        pytest.param(lambda ds: ds.slice(20), id="slice(20)"),
        pytest.param(lambda ds: ds.slice(1, 30, 3), id="slice(1, 30, 3)"),
        pytest.param(lambda ds: ds.rsample(0.5), id="rsample(0.5)"),
        pytest.param(lambda ds: ds.rsample(0.3).slice(8), id="rsample, then slice"),
    ],
)
@pytest.mark.parametrize("k", [0, 1, 5, 7])
def test_slices_and_random_samples_resume_exactly(
    make_shards: Any, stage: Callable[[Any], Any], k: int
) -> None:
    """slice and rsample keep their position (the items taken, the draws made): a restored
    epoch once sliced again from its restored start, or drew new coins, so it delivered
    samples the epoch never had and left out others."""
    shards = make_shards(UNEVEN)
    everything, resumed = resume_after(
        lambda: stage(wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)), k, epoch=1
    )
    assert k <= len(everything)
    assert keys(resumed) == keys(everything)


@pytest.mark.parametrize("flatten", ["unbatched", "unlisted"])
def test_a_checkpoint_inside_a_batch_being_split_says_what_it_loses(
    make_shards: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    flatten: str,
) -> None:
    """The rest of a batch that unbatched (or unlisted) is splitting is in no stage's state:
    a checkpoint taken inside it warns that a restore loses those samples, and only then."""
    from cloudshards.stages import base, batch

    monkeypatch.setattr(batch, "_WARNED", set())  # once per process: not yet in this test
    monkeypatch.setattr(base, "_DEFERRED", {})  # nor one kept from another test's pipeline
    shards = make_shards(UNEVEN)

    def build() -> Any:
        dataset = wds.WebDataset(shards.spec(), shardshuffle=False)
        if flatten == "unbatched":
            return dataset.to_tuple("__key__").batched(4).unbatched()
        return dataset.listed(4).unlisted()

    pipeline = build()
    it = iter(pipeline)
    for _ in range(4):  # a whole batch: nothing is lost
        next(it)
    pipeline.state_dict()
    assert f"{flatten}: a checkpoint" not in caplog.text
    next(it)
    state = pipeline.state_dict()
    it.close()  # type: ignore[attr-defined]
    assert f"{flatten}: a checkpoint taken inside a batch cannot hold the rest" in caplog.text
    restored = build()
    restored.load_state_dict(state)
    assert len(list(restored)) == sum(UNEVEN) - 8  # the 3 left in the batch are lost
