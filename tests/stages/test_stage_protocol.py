"""The Stage protocol: a stage owns its state and declares its configuration.

A stateful stage written here, with no edit to the pipeline or the reader, is saved and
restored exactly (also under ``StatefulDataLoader`` with workers); a state saved under another
configuration (shuffle buffer, batch size, epoch length, seed, a stage's own config) is refused;
a stage that can decode fewer fields is told which ones ``to_tuple`` keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

import cloudshards as wds
import cloudshards.stages.base
from cloudshards.errors import StateMismatchError

# The convenience base class (a plain iterator before it existed: the duck-typed tests below
# then fail on their assertions, not on an import).
_StageIterator: Any = getattr(cloudshards.stages.base, "StageIterator", Iterator)

UNEVEN = [3, 1, 4, 1, 5, 9, 2, 6]


class _NumberedIterator:
    """A running stateful stage, duck-typed (no cloudshards base class): numbers the samples
    it delivers and remembers the key of the previous one."""

    state_key = "numbered"

    def __init__(self, src: Iterable[dict[str, Any]], start: int) -> None:
        self.src = iter(src)
        self.count = start
        self.previous: str | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        sample = next(self.src)
        self.count += 1
        result = {**sample, "n": self.count, "previous": str(self.previous)}
        self.previous = sample["__key__"]
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "previous": self.previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.previous = state["previous"]


class Numbered:
    """The stage: configuration only; each pass gets a fresh running iterator."""

    def __init__(self, start: int = 0) -> None:
        self.start = start

    def stage_config(self) -> dict[str, Any]:
        return {"start": self.start}

    def __call__(self, src: Iterable[dict[str, Any]]) -> _NumberedIterator:
        return _NumberedIterator(src, self.start)


class Counted(_StageIterator):
    """The same kind of stage on the convenience base class (the class is the stage)."""

    state_key = "counted"

    def __init__(self, src: Iterable[dict[str, Any]]) -> None:
        self.src, self.count = iter(src), 0

    def __next__(self) -> dict[str, Any]:
        sample = next(self.src)
        self.count += 1
        return {**sample, "n": self.count}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count} if self.count else {}

    def load_state_dict(self, state: Any) -> None:
        self.count = int(state["count"])


def rows(items: Iterable[Any]) -> list[tuple[Any, ...]]:
    """(key, n, previous) of every sample, batches flattened."""
    result: list[tuple[Any, ...]] = []
    for item in items:
        if isinstance(item["__key__"], list):
            result.extend(zip(item["__key__"], list(item["n"]), item["previous"], strict=True))
        else:
            result.append((item["__key__"], item["n"], item["previous"]))
    return result


def build(spec: str, *, start: int = 100, batch: int = 3, shuffle: int = 0) -> Any:
    ds = wds.WebDataset(spec, shardshuffle=True, seed=7).compose(Numbered(start))
    if shuffle:
        ds = ds.shuffle(shuffle)
    return ds.batched(batch)


def test_a_new_stateful_stage_resumes_exactly_in_a_pipeline(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)
    everything = rows(build(shards.spec()))
    first = build(shards.spec())
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = first.state_dict()
    second = build(shards.spec())
    second.load_state_dict(state)
    assert rows(head) + rows(second) == everything
    # Under its own key: what it delivered (4 batches of 3 after 100).
    assert state["stages"]["numbered"] == {"count": 112, "previous": head[-1]["__key__"][-1]}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_stateful_stage_resumes_exactly_under_stateful_dataloader(
    make_shards: Any, workers: int
) -> None:
    shards = make_shards(UNEVEN * 2)

    def loader() -> StatefulDataLoader:
        ds = build(shards.spec())
        ds.set_epoch(1)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers)

    everything = rows(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    assert rows(head) + rows(second) == everything


def test_two_stages_with_the_same_key_keep_separate_states(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)

    def twice() -> Any:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=7)
        return ds.compose(Numbered(0)).map(lambda s: {**s, "inner": s["n"]}).compose(Numbered(50))

    everything = [(s["__key__"], s["inner"], s["n"]) for s in twice()]
    first = twice()
    it = iter(first)
    head = [next(it) for _ in range(6)]
    state = first.state_dict()
    second = twice()
    second.load_state_dict(state)
    got = [(s["__key__"], s["inner"], s["n"]) for s in head + list(second)]
    assert got == everything
    assert state["stages"]["numbered"]["count"] == 6
    assert state["stages"]["numbered.1"]["count"] == 56


def _state_mid_epoch(ds: Any, k: int = 3) -> dict[str, Any]:
    it = iter(ds)
    for _ in range(k):
        next(it)
    return ds.state_dict()  # type: ignore[no-any-return]


def test_a_changed_shuffle_buffer_is_refused(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)
    state = _state_mid_epoch(build(shards.spec(), shuffle=10))
    build(shards.spec(), shuffle=10).load_state_dict(state)  # the same configuration resumes
    with pytest.raises(StateMismatchError, match=r"different dataset or configuration.*Shuffler"):
        build(shards.spec(), shuffle=20).load_state_dict(state)


def test_a_changed_batch_size_is_refused(make_shards: Any) -> None:
    shards = make_shards(UNEVEN)
    state = _state_mid_epoch(build(shards.spec(), batch=3))
    build(shards.spec(), batch=3).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="different dataset or configuration"):
        build(shards.spec(), batch=4).load_state_dict(state)


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(lambda spec: build(spec, start=0), id="a stage's own config"),
        pytest.param(lambda spec: build(spec).with_epoch(40), id="with_epoch length"),
        pytest.param(
            lambda spec: (
                wds.WebDataset(spec, shardshuffle=True, seed=8).compose(Numbered(100)).batched(3)
            ),
            id="seed",
        ),
        pytest.param(
            lambda spec: (
                wds.WebDataset(spec, shardshuffle=False, seed=7).compose(Numbered(100)).batched(3)
            ),
            id="shard shuffle",
        ),
        pytest.param(
            lambda spec: (
                wds.WebDataset(spec, shardshuffle=True, seed=7, balance=None)
                .compose(Numbered(100))
                .batched(3)
            ),
            id="balance mode",
        ),
    ],
)
def test_other_changed_configuration_is_refused(make_shards: Any, changed: Any) -> None:
    shards = make_shards(UNEVEN)
    state = _state_mid_epoch(build(shards.spec()))
    with pytest.raises(StateMismatchError, match="different dataset or configuration"):
        changed(shards.spec()).load_state_dict(state)


def test_a_version_1_state_still_resumes(make_shards: Any) -> None:
    # Version 1 (before stages owned their state) was one flat dict with the reader's and the
    # epoch's counters; its fingerprint covered class names and URLs only.
    from cloudshards.stages.state import legacy_fingerprint

    shards = make_shards(UNEVEN)

    def build_plain() -> Any:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5).decode()
        return ds.to_tuple("__key__", "cls").with_epoch(40).batched(2)

    reference = build_plain()
    reference.set_epoch(3)
    everything = [b[0] for b in reference]
    for k in (3, 14, 17):
        first = build_plain()
        first.set_epoch(3)
        it = iter(first)
        head = [next(it)[0] for _ in range(k)]
        state = first.state_dict()
        passes, reader = state["stages"].get("passes", {}), state["stages"].get("reader", {})
        old = {
            "version": 1,
            "fingerprint": legacy_fingerprint("WebDataset", first.pipeline),
            "repetition": passes.get("repetition", 0),
            "yielded": passes.get("yielded", 0),
            "shards": reader.get("shards", 0),
            "samples": reader.get("samples", 0),
            "epoch": state["epoch"],
            "seed": state["seed"],
            "consumer": state["consumer"],
        }
        second = build_plain()
        second.load_state_dict(old)
        assert head + [b[0] for b in second] == everything
    with pytest.raises(StateMismatchError, match="different dataset"):
        build_plain().load_state_dict({**old, "fingerprint": "0"})


def test_a_stage_that_can_decode_less_is_told_what_to_tuple_keeps(make_shards: Any) -> None:
    shards = make_shards([2, 2])
    told: list[set[str]] = []

    class Lazy:
        """Declares ``for_fields``, as ``.decode()``'s stage does."""

        def __init__(self, fields: set[str] | None = None) -> None:
            self.fields = fields

        def for_fields(self, fields: set[str]) -> Lazy:
            told.append(set(fields))
            return Lazy(fields)

        def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            for sample in src:
                yield {k: v for k, v in sample.items() if self.fields is None or k in self.fields}

    ds = wds.WebDataset(shards.spec(), shardshuffle=False).compose(Lazy()).to_tuple("cls;txt")
    assert told == [{"cls", "txt"}]
    assert len(list(ds)) == 4


def test_a_dropped_epoch_keeps_its_state_and_releases_its_stages(make_shards: Any) -> None:
    import gc
    import weakref

    shards = make_shards(UNEVEN)
    ds = build(shards.spec())
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    state = ds.state_dict()
    reader = weakref.ref(ds._live.registry.iterators["reader"])  # type: ignore[union-attr]
    gc.disable()  # released by reference counting, at once, not by the cyclic collector
    try:
        del it
        assert reader() is None
    finally:
        gc.enable()
    assert ds.state_dict() == state
    again = build(shards.spec())
    again.load_state_dict(state)
    assert rows(head) + rows(again) == rows(build(shards.spec()))


def test_stage_iterator_base_class_and_a_running_pipeline_pickles(make_shards: Any) -> None:
    import pickle

    shards = make_shards(UNEVEN)

    def counted() -> Any:
        return wds.WebDataset(shards.spec(), shardshuffle=True, seed=2).compose(Counted)

    everything = [(s["__key__"], s["n"]) for s in counted()]
    first = counted()
    it = iter(first)
    head = [next(it) for _ in range(9)]
    state = first.state_dict()
    assert state["stages"]["counted"] == {"count": 9}
    # A running pipeline still pickles (DataLoader workers): its stages' states travel.
    assert pickle.loads(pickle.dumps(first)).state_dict() == state
    second = counted()
    second.load_state_dict(state)
    assert [(s["__key__"], s["n"]) for s in head + list(second)] == everything
