"""Exact resume through a shuffle buffer: the state names the buffered samples by position
(shard, sample), a restore reads them again, and the rest of the epoch is exactly what an
uninterrupted run delivers, at any point (filling, full, draining), with stages before the
shuffle, in DataLoader workers, from local files and from a store."""

from __future__ import annotations

import io
import json
import logging
import pickle
import tarfile
from pathlib import Path
from typing import Any

import pytest
from test_state import UNEVEN, keys, resume_after
from torchdata.stateful_dataloader import StatefulDataLoader

import cloudshards as wds
from cloudshards.errors import StateMismatchError
from cloudshards.webdataset.tariterators import shardlist


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


@pytest.mark.parametrize("k", [3, 11])
def test_balanced_ranks_resampled_shards_and_epochs_of_fixed_length(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """The reader's numbering (balanced ranks skip and take within shards; resampled shards
    repeat; with_epoch cuts passes) is what the restore reads again by."""
    shards = make_shards(UNEVEN)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    everything, resumed = resume_after(
        lambda: wds.WebDataset(shards.spec(), shardshuffle=True, seed=8).shuffle(6), k, epoch=1
    )
    assert len(everything) == 31 // 2
    assert keys(resumed) == keys(everything)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    everything, resumed = resume_after(
        lambda: wds.WebDataset(shards.spec(), resampled=True, seed=2).shuffle(8).with_epoch(40),
        k * 3,
    )
    assert len(everything) == 40
    assert keys(resumed) == keys(everything)


def test_webdataset_style_pipelines_and_detshuffle(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)
    urls = [str(p) for p in shards.paths]

    def build(stage: Any) -> Any:
        return wds.DataPipeline(
            wds.SimpleShardList(urls), wds.tarfile_to_samples(), stage, wds.to_tuple("__key__")
        )

    for stage in (lambda: wds.shuffle(7, seed=5), lambda: wds.detshuffle(7, seed=5)):
        everything, resumed = resume_after(lambda stage=stage: build(stage()), 9)
        assert resumed == everything


@pytest.fixture
def store(make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """8 shards of 20 samples in a store (``slowfile://``) that logs every open."""
    import fakes

    fakes.register()
    monkeypatch.setenv(fakes.OPEN_LOG_ENV, str(tmp_path / "opens.log"))
    shards = make_shards([20] * 8)
    shards.urls = [fakes.url_of(p) for p in shards.paths]
    shards.log = tmp_path / "opens.log"
    return shards


def _stop_after(dataset: Any, k: int) -> tuple[list[Any], dict[str, Any]]:
    """The first ``k`` items of ``dataset`` and its state there; the rest is not read."""
    it = iter(dataset)
    head = [next(it) for _ in range(k)]
    state = dataset.state_dict()
    it.close()
    return head, state


def test_a_restore_from_a_store_opens_only_the_shards_that_hold_buffered_samples(
    store: Any,
) -> None:
    import fakes

    def build() -> Any:
        return wds.WebDataset(store.urls, shardshuffle=False).shuffle(10)

    everything = keys(build())
    head, state = _stop_after(build(), 75)
    held = {shard for shard, _ in state["stages"]["shuffle"]["buffer"]}
    store.log.unlink()
    second = build()
    second.load_state_dict(state)
    after = list(second)
    reopened = fakes.opens(store.log)
    # The shards holding buffered samples (each once), then the one the reader goes on with
    # and those after it; none of the shards before it that hold nothing buffered.
    current = state["stages"]["reader"]["shards"] - 1
    assert current == 4
    assert held - {current}  # samples from earlier shards are still buffered
    assert max(held) <= current
    expected = held | set(range(current, 8))
    assert set(reopened) == {str(store.paths[n]) for n in expected}
    assert all(count == 1 for path, count in reopened.items() if path != str(store.paths[4]))
    assert keys(head) + keys(after) == everything


def test_with_a_node_cache_the_buffered_samples_come_from_the_cache(
    store: Any, tmp_path: Path
) -> None:
    import fakes

    cache = str(tmp_path / "cache")

    def build() -> Any:
        return wds.WebDataset(store.urls, shardshuffle=False, cache_dir=cache).shuffle(10)

    head, state = _stop_after(build(), 75)
    store.log.unlink()
    second = build()
    second.load_state_dict(state)
    rest = list(second)
    # Shards 0-4 were read (the last one completed when closed): nothing of them comes from
    # the store again, buffered samples included.
    assert set(fakes.opens(store.log)) <= {str(p) for p in store.paths[5:]}
    reference = list(wds.WebDataset(store.urls, shardshuffle=False).shuffle(10))
    assert keys(head) + keys(rest) == keys(reference)


def test_a_shard_that_changed_since_the_checkpoint_is_named(store: Any) -> None:
    """A buffered sample that is not in its shard any more (the shard was rewritten shorter):
    the restore refuses, naming the shard's URL, instead of filling the buffer with others."""

    def build() -> Any:
        return wds.WebDataset(store.urls, shardshuffle=False).shuffle(10)

    _, state = _stop_after(build(), 75)
    held = sorted({shard for shard, _ in state["stages"]["shuffle"]["buffer"]})
    shorter = store.paths[held[0]]
    with tarfile.open(shorter, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("only_000000.bin")
        tar.addfile(info, io.BytesIO(b""))
    second = build()
    second.load_state_dict(state)
    with pytest.raises(StateMismatchError, match=f"shard {held[0]} \\(slowfile://.*{shorter.name}"):
        next(iter(second))


def test_stages_that_count_their_calls_see_the_same_pass_when_read_again(
    make_shards: Any,
) -> None:
    """A shard-level detshuffle counts its epochs by calls: reading the buffer again must not
    advance it (the shard order of this pass and of the next one would change)."""
    shards = make_shards(UNEVEN)
    urls = [str(p) for p in shards.paths]

    def build() -> Any:
        return wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.detshuffle(8, seed=3),
            wds.tarfile_to_samples(),
            wds.shuffle(6, seed=1),
            wds.to_tuple("__key__"),
        )

    reference = build()
    epochs = [list(reference), list(reference)]  # two passes: the shard order changes
    assert epochs[0] != epochs[1]
    first = build()
    it = iter(first)
    head = [next(it) for _ in range(9)]
    state = first.state_dict()
    it.close()  # type: ignore[attr-defined]
    second = build()
    second.load_state_dict(state)
    assert head + list(second) == epochs[0]
    assert list(second) == epochs[1]  # the next pass follows on


class _CountingRng:
    """An rng that is not a random.Random (webdataset accepts anything with randint)."""

    def __init__(self) -> None:
        self.n = 0

    def randint(self, a: int, b: int) -> int:
        self.n += 1
        return a + self.n % (b - a + 1)


def test_a_shuffle_with_its_own_kind_of_rng_is_left_out_of_the_state(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards(UNEVEN)
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).shuffle(5, rng=_CountingRng())
    it = iter(ds)
    for _ in range(4):
        next(it)
    with caplog.at_level("WARNING", logger="cloudshards.stages.shuffle"):
        state = ds.state_dict()
    assert "shuffle" not in state["stages"]
    assert any("random.Random" in r.getMessage() for r in caplog.records)


def _forty() -> Any:
    return iter(range(40))


def test_an_unheld_buffer_is_warned_about_when_a_checkpoint_is_taken_only(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer no shard reader feeds cannot be saved: the user hears it when they save a
    state, not when the pipeline snapshots itself (an epoch's end, a pickle for workers) in a
    program that never checkpoints."""
    from cloudshards.stages import shuffle as shuffle_module

    monkeypatch.setattr(shuffle_module, "_WARNED", set())
    ds = wds.DataPipeline(_forty, wds.shuffle(8))
    warning = "does not hold this buffer (no shard reader feeds it)"
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        assert sorted(ds) == list(range(40))  # the epoch ends: it snapshots itself
        pickle.dumps(ds)  # handed to DataLoader workers after an epoch
        running = iter(ds)
        next(running)
        pickle.dumps(ds)  # and while one runs
        assert warning not in caplog.text
        ds.state_dict()
        ds.state_dict()
    assert caplog.text.count(warning) == 1


@pytest.mark.parametrize("k", [0, 2, 5, 8, 11, 15])
def test_urls_shuffled_before_the_reader_are_shuffled_the_same_when_read_again(
    make_shards: Any, k: int
) -> None:
    """webdataset's README pipeline: shard URLs through ``wds.shuffle``, samples through a
    second one. The URL shuffle holds no state: a restore draws its order again, in the main
    chain and in the chain that reads the buffered samples again, and both must be the order
    the checkpointed run drew (an unsaved stage drawing a new seed there gave other shards)."""
    shards = make_shards(UNEVEN)
    urls = [str(p) for p in shards.paths]

    def build() -> Any:
        return wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.shuffle(100),
            wds.split_by_worker,
            wds.tarfile_to_samples(),
            wds.shuffle(5),
            wds.to_tuple("__key__"),
        )

    everything, resumed = resume_after(build, k, epoch=1)
    assert resumed == everything


@pytest.mark.parametrize("k", [3, 31, 40, 55])
def test_a_later_pass_of_the_epoch_draws_the_seeds_it_drew_before(make_shards: Any, k: int) -> None:
    """A restore in the second pass of a repeated epoch: each pass draws its random stages'
    seeds afresh, so the restored pass's URL order is the one the checkpointed pass had."""
    shards = make_shards(UNEVEN)  # 31 samples a pass
    urls = [str(p) for p in shards.paths]

    def build() -> Any:
        return wds.DataPipeline(
            wds.SimpleShardList(urls),
            wds.shuffle(100),
            wds.tarfile_to_samples(),
            wds.shuffle(4),
            wds.to_tuple("__key__"),
        ).repeat(2)

    everything, resumed = resume_after(build, k)
    assert len(everything) == 62
    assert resumed == everything


@pytest.mark.parametrize("source", ["shardlist", "resampled", "ResampledShards"])
def test_random_stages_before_the_buffer_draw_their_seeds_as_the_chain_is_built(
    make_shards: Any, source: str
) -> None:
    """Stages that drew lazily (on their first item) drew other seeds in the chain that reads
    the buffer again, which builds fewer stages: shardlist(shuffle=True), resampled and
    ResampledShards draw when the chain is built."""
    shards = make_shards(UNEVEN)
    urls = [str(p) for p in shards.paths]

    def build() -> Any:
        if source == "shardlist":
            head = [lambda: shardlist(urls, shuffle=True)]
        elif source == "resampled":
            head = [wds.SimpleShardList(urls), wds.resampled(8)]
        else:
            head = [wds.ResampledShards(urls, nshards=8, deterministic=False)]
        return wds.DataPipeline(
            *head, wds.tarfile_to_samples(), wds.shuffle(6), wds.to_tuple("__key__")
        )

    for k in (2, 9):
        everything, resumed = resume_after(build, k, epoch=3)
        assert resumed == everything, k


def _readme_pipeline(urls: list[str]) -> Any:
    """webdataset's README pipeline: shuffle the URLs, split them, read, shuffle samples."""
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.shuffle(100),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.shuffle(5),
        wds.to_tuple("__key__"),
    )


def test_a_shuffle_of_shard_urls_before_the_splitters_is_one_order_for_every_worker(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker shuffling the URLs its own way made their shares overlap (half the samples
    twice, a quarter never, with webdataset 1.0.2 as well): a shuffle before the shard reader
    draws one order for all ranks and workers, new each epoch."""
    shards = make_shards([3, 4, 5, 6, 7, 8, 9, 10])
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    orders = []
    for epoch in range(2):
        seen: list[str] = []
        for rank in range(2):
            monkeypatch.setenv("RANK", str(rank))
            ds = _readme_pipeline(urls)
            ds.set_epoch(epoch)
            loader = wds.StatefulLoader(ds, batch_size=None, num_workers=2)
            seen.extend(key for (key,) in loader)
        assert sorted(seen) == sorted(shards.keys)
        orders.append(seen)
    assert orders[0] != orders[1]


@pytest.mark.parametrize("k", [3, 9, 14])
def test_the_readme_pipeline_resumes_exactly_in_dataloader_workers(
    make_shards: Any, k: int
) -> None:
    shards = make_shards([3, 4, 5, 6, 7, 8, 9, 10])
    urls = [str(p) for p in shards.paths]

    def run(state: dict[str, Any] | None = None, stop: int | None = None) -> Any:
        ds = _readme_pipeline(urls)
        loader = wds.StatefulLoader(ds, batch_size=None, num_workers=2)
        if state is not None:
            loader.load_state_dict(state)
        if stop is None:
            return [key for (key,) in loader]
        it = iter(loader)
        head = [next(it)[0] for _ in range(stop)]
        return head, loader.state_dict()

    everything = run()
    head, state = run(stop=k)
    assert head + run(state) == everything
    assert sorted(everything) == sorted(shards.keys)


def test_samples_are_shuffled_per_rank_and_worker_even_without_a_shard_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a shuffle of shards draws one order for all: items that are not shards (here
    numbers from a source of the user's own) are shuffled with each rank's own seed."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = wds.DataPipeline(lambda: iter(range(40)), wds.split_by_node, wds.shuffle(8, initial=8))
        ds.set_epoch(0)
        out.append(list(ds))
    assert sorted(out[0]) == list(range(0, 40, 2))
    assert [n + 1 for n in out[0]] != out[1]  # the same draws would pair them up


@pytest.mark.parametrize("k", [2, 5])
def test_an_elastic_restore_of_the_readme_pipeline_takes_every_sample_once(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """2 ranks' states restored on 1: the restore rebuilds each old rank's plan, whose URL
    shuffle must draw the order the ranks shared."""
    shards = make_shards([3, 4, 5, 6, 7, 8, 9, 10])
    urls = [str(p) for p in shards.paths]

    def build(rank: int, world: int) -> Any:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", str(rank))
        ds = wds.DataPipeline(
            wds.SimpleShardList(urls), wds.shuffle(100), wds.split_by_node, wds.tarfile_to_samples()
        )
        ds.set_epoch(1)
        return ds

    before, states = [], []
    for rank in range(2):
        loader = StatefulDataLoader(build(rank, 2), batch_size=None, num_workers=0)
        it = iter(loader)
        before += [next(it)["__key__"] for _ in range(k)]
        states.append(loader.state_dict())
        del it
    restored = wds.StatefulLoader(build(0, 1), batch_size=None, num_workers=0)
    restored.load_state_dict({"cloudshards_ranks": states, "world_size": 2})
    after = [sample["__key__"] for sample in restored]
    assert sorted(before + after) == sorted(shards.keys)
