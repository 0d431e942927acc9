"""RandomMix and RoundRobin resume exactly: their state holds which sources are left, the
turn or the RNG's state, and each source's own state (a cloudshards pipeline, shuffle buffer
included) or the number of items taken from it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_state import keys
from torchdata.stateful_dataloader import StatefulDataLoader

import cloudshards as wds


def _sources(make_shards: Any, tmp_path: Any) -> tuple[str, str]:
    first = make_shards([7, 3, 9], directory=tmp_path / "a")
    second = make_shards([4, 6], directory=tmp_path / "b")
    return first.spec(), second.spec()


def _pipelines(a: str, b: str, buffer: int) -> list[Any]:
    """The two datasets mixed: the first shuffled through a buffer."""
    return [
        wds.WebDataset(a, shardshuffle=True, seed=1).shuffle(buffer),
        wds.WebDataset(b, shardshuffle=True, seed=2),
    ]


def _resume(build: Any, k: int) -> tuple[list[Any], list[Any]]:
    """(a run, its first k items + what a mix restored at k delivers). A mix's draws are
    random unless a pipeline seeds them: the restored one must continue that run's."""
    first = build()
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = first.state_dict()
    json.dumps(state)  # plain data
    rest = list(it)
    second = build()
    second.load_state_dict(state)
    return head + rest, head + list(second)


@pytest.mark.parametrize(("longest", "k"), [(False, 1), (False, 8), (True, 5), (True, 20)])
@pytest.mark.parametrize("seeded", [False, True], ids=["on-its-own", "in-a-pipeline"])
def test_random_mix_of_pipelines_resumes_exactly(
    make_shards: Any, tmp_path: Any, k: int, longest: bool, seeded: bool
) -> None:
    """On its own a mix draws at random (webdataset's behaviour); in a pipeline its draws
    follow the pipeline's seed. Either way a restored mix continues the saved run."""
    a, b = _sources(make_shards, tmp_path)

    def build() -> Any:
        mix = wds.RandomMix(
            _pipelines(a, b, 5),
            [0.7, 0.3],
            longest=longest,
        )
        return wds.DataPipeline(mix, wds.to_tuple("__key__")) if seeded else mix

    everything, resumed = _resume(build, k)
    assert resumed == everything
    if longest:
        assert len(everything) == 29
    if seeded:
        assert list(build()) == everything  # the same draws every time


@pytest.mark.parametrize("k", [1, 4, 7])
def test_round_robin_of_plain_sources_resumes_by_counting(k: int) -> None:
    def build() -> Any:
        return wds.RoundRobin([[1, 2, 3, 4, 5], ["a", "b"], [10, 20, 30]], longest=True)

    everything, resumed = _resume(build, k)
    assert resumed == everything == [1, "a", 10, 2, "b", 20, 3, 30, 4, 5]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mix_in_a_stateful_dataloader_resumes_exactly(
    make_shards: Any, tmp_path: Any, workers: int
) -> None:
    a, b = _sources(make_shards, tmp_path)

    def loader() -> StatefulDataLoader:
        mix = wds.RandomMix(
            _pipelines(a, b, 4),
            [0.5, 0.5],
            longest=True,
        )
        return StatefulDataLoader(
            wds.DataPipeline(mix, wds.batched(2)), batch_size=None, num_workers=workers
        )

    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = first.state_dict()
    rest = list(it)
    assert len(keys(head + rest)) == 29
    second = loader()
    second.load_state_dict(state)
    assert keys(second) == keys(rest)


def test_a_mix_that_ran_can_still_be_pickled_for_spawned_workers() -> None:
    import pickle

    mix = wds.RoundRobin([[1, 2, 3], ["a", "b"]])
    it = iter(mix)
    next(it)
    state = mix.state_dict()
    copy = pickle.loads(pickle.dumps(mix))  # a spawned DataLoader worker gets such a copy
    assert list(copy) == [1, "a", 2, "b", 3]
    copy.load_state_dict(state)
    assert list(copy) == ["a", 2, "b", 3]


def test_a_weighted_mix_keeps_its_proportions_at_every_point() -> None:
    """0.5 / 0.3 / 0.2 over three sources: after any number of items each source has given its
    share to within one item, in one fixed order (no randomness: every rank mixes alike)."""
    sources = [[("a", i) for i in range(1000)], [("b", i) for i in range(1000)]]
    sources.append([("c", i) for i in range(1000)])
    mix = list(wds.WeightedMix(sources, [5, 3, 2]))
    assert len(mix) >= 1000
    counts = {"a": 0, "b": 0, "c": 0}
    for n, (name, _) in enumerate(mix, start=1):
        counts[name] += 1
        for source, share in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
            assert abs(counts[source] - share * n) <= 1, (n, counts)
    assert mix == list(wds.WeightedMix(sources, [0.5, 0.3, 0.2]))  # normalised, deterministic
    # Each source in its own order.
    assert [i for name, i in mix if name == "b"] == list(range(counts["b"]))


@pytest.mark.parametrize("k", [1, 7, 20])
def test_a_weighted_mix_in_a_pipeline_resumes_exactly_with_epochs_of_fixed_length(
    make_shards: Any, tmp_path: Any, k: int
) -> None:
    a, b = _sources(make_shards, tmp_path)

    def build() -> Any:
        mix = wds.WeightedMix(
            _pipelines(a, b, 5),
            [2, 1],
            longest=True,
        )
        return wds.DataPipeline(mix, wds.to_tuple("__key__")).with_epoch(24)

    everything, resumed = _resume(build, k)
    assert len(everything) == 24
    assert resumed == everything
    assert list(build()) == everything


def test_a_weighted_mix_goes_on_with_the_others_when_one_runs_out() -> None:
    mixed = list(wds.WeightedMix([[1, 2], list("abcdefgh")], [1, 1], longest=True))
    assert sorted(map(str, mixed)) == sorted(["1", "2", *"abcdefgh"])
    assert list(wds.WeightedMix([[1, 2], list("abcdefgh")], [1, 1])) == [1, "a", 2, "b"]
    with pytest.raises(ValueError, match="positive"):
        wds.WeightedMix([[1]], [0])


def _by_counts(make_shards: Any, tmp_path: Any, counts: list[int]) -> Any:
    """Three datasets (40, 12 and 30 samples) mixed by per-epoch counts in a pipeline."""
    specs = [
        make_shards(sizes, directory=tmp_path / name).spec()
        for name, sizes in (("a", [10, 10, 10, 10]), ("b", [6, 6]), ("c", [15, 15]))
    ]
    datasets = [
        wds.WebDataset(spec, shardshuffle=True, seed=n).shuffle(8) for n, spec in enumerate(specs)
    ]
    return wds.DataPipeline(wds.WeightedMix(datasets, counts=counts), wds.batched(3), seed=4)


def _source(path: str) -> str:
    return path.split("/")[-2]  # the dataset's directory: a, b or c


def test_a_mix_by_counts_takes_exactly_those_counts_each_epoch_and_resumes_exactly(
    make_shards: Any, tmp_path: Any
) -> None:
    # Per worker (2): 15 of a (of its 20: a subset), 9 of b (of its 6: read again), 6 of c.
    mix = _by_counts(make_shards, tmp_path, [30, 18, 12])
    epochs = []
    for epoch in (0, 1):
        mix.set_epoch(epoch)
        batches = list(StatefulDataLoader(mix, batch_size=None, num_workers=2))
        local = [_source(path) for batch in batches for path in batch["__local_path__"]]
        assert {s: local.count(s) for s in "abc"} == {"a": 30, "b": 18, "c": 12}
        # Any prefix of a worker's items holds each dataset's share to within one item.
        worker = local[:3] + local[6:9] + local[12:15]  # the first batches of worker 0
        for n in range(1, len(worker) + 1):
            for s, share in zip("abc", (0.5, 0.3, 0.2), strict=True):
                assert abs(worker[:n].count(s) - share * n) <= 1
        epochs.append(keys(batches))
    assert epochs[0] != epochs[1]  # every dataset reshuffles with the pipeline's epoch
    mix.set_epoch(1)
    loader = StatefulDataLoader(mix, batch_size=None, num_workers=2)
    it = iter(loader)
    head = [next(it) for _ in range(15)]  # mid-epoch, b in its second pass on worker 0
    state = loader.state_dict()
    json.dumps(state)
    del it
    again = _by_counts(make_shards, tmp_path, [30, 18, 12])
    restored = StatefulDataLoader(again, batch_size=None, num_workers=2)
    restored.load_state_dict(state)
    assert keys(head) + keys(restored) == epochs[1]


def test_mix_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="either weights or counts"):
        wds.WeightedMix([[1], [2]], [1, 1], counts=[1, 1])
    with pytest.raises(ValueError, match="counts must be"):
        wds.WeightedMix([[1], [2]], counts=[1, -1])
