"""Elastic resume: continue an epoch checkpointed on N ranks x W workers on M ranks x V.

Every consumer (rank x DataLoader worker) of the old world left a state: its position in its
part of the epoch and the samples in its shuffle buffer. The remaining samples of the epoch
are, for each old consumer in order, the samples of its part it had not taken from its shard
reader, plus the ones still in its buffer. Laid end to end they are one sequence; each new
consumer takes a contiguous run of it (see :func:`share`), so every remaining sample is
delivered once over the new world. The new consumer's run is its *plan*: a list of pieces,
each a shard and spans of its sample numbers, read like any part of an epoch (its own shuffle
buffer shuffles it) and saved in its state, so that a checkpoint taken during the resumed
epoch restores it again, on the same world or another.

Balance: with ``balance`` (several ranks by default) every new rank gets the same number of
*batches*. Rank counts differ by one sample when the remainder does not divide; the extra
sample goes into a worker's last, partial batch (``batch``: the samples per batch, from
``.batched`` and the loader's ``batch_size``), which keeps batch counts equal. Where no batch
is partial (batches of one sample, or every worker's count a multiple of the batch), the mode
decides: ``drop`` leaves those few samples out (fewer than the number of ranks, logged),
``pad`` repeats a sample on the other ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cloudshards.dist import WorkerInfo
from cloudshards.errors import StateMismatchError
from cloudshards.stages.base import (
    IterationContext,
    iteration_context,
    run_in_context,
)
from cloudshards.stages.division import Piece, batch_size, closed, consumer_counts, cut, length
from cloudshards.stages.rebuffer import is_reader, snapshot
from cloudshards.stages.spans import Span, as_shard, delivered_from, merged, nth, spans_of

__all__ = [
    "ELASTIC_KEY",
    "KEPT",
    "PENDING",
    "Piece",
    "batch_size",
    "consumer_counts",
    "decode",
    "encode",
    "gathered",
    "items_share",
    "planned",
    "reader_index",
    "share",
]

logger = logging.getLogger("cloudshards.pipeline")

#: The key of a state that holds every old consumer's state (an elastic restore).
ELASTIC_KEY = "elastic"

#: What a consumer's state holds of an elastic restore's epoch: its plan, or its items.
KEPT = ("stages", "plan", "limit")
#: What an elastic restore not started yet keeps of its bundle in a consumer's state.
PENDING = (ELASTIC_KEY, "batch", "sizes")


def encode(plan: Sequence[Piece]) -> list[list[int]]:
    """A plan as plain data: ``[shard, start, stop, start, stop...]`` (stop -1: to the end)."""
    return [
        [shard, *(n for start, stop in spans for n in (start, -1 if stop is None else stop))]
        for shard, spans in plan
    ]


def decode(data: Sequence[Sequence[int]]) -> list[Piece]:
    """:func:`encode`'s plan back."""
    plan: list[Piece] = []
    for entry in data:
        bounds = [int(n) for n in entry[1:]]
        spans: list[Span] = [
            (bounds[i], None if bounds[i + 1] < 0 else bounds[i + 1])
            for i in range(0, len(bounds), 2)
        ]
        plan.append((int(entry[0]), spans))
    return plan


def share(
    steps: Sequence[Any],
    invoke: Callable[..., Any],
    bundle: Mapping[str, Any],
    context: IterationContext,
    split: Any,
    loop_batch: Callable[[int], int],
) -> list[Piece]:
    """This consumer's plan of the restored epoch (``context``: its own, with the old run's
    seed and epoch), from every old consumer's state (``bundle["elastic"]``; ``"batch"``: the
    loader's batch size; ``"sizes"``: the least each new consumer must get, as a mix asks of
    its datasets). ``steps``: the pipeline's stages up to its shard reader (the last one
    builds it), ``split``: its balancing stage if it has one; ``loop_batch``: the loop's
    samples per batch for a loader's batch size (the pipeline's ``.batched`` included)."""
    urls = steps[0].urls
    index_of = {url: number for number, url in enumerate(urls)}
    sequence: list[Piece] = []
    for state in _unfinished(bundle[ELASTIC_KEY]):
        if ELASTIC_KEY in state:  # its own elastic restore had not started: its share of it
            pieces = share(steps, invoke, state, _of(state, context), split, loop_batch)
            plan = [as_shard(_shard(urls, s), spans) for s, spans in pieces]
        elif "plan" in state:
            plan = [as_shard(_shard(urls, s), spans) for s, spans in decode(state["plan"])]
        else:
            plan = _old_plan(steps, invoke, _of(state, context))
        sequence.extend(_remaining(plan, state.get("stages", {}), index_of))
    info = context.info
    mode = split.mode(context) if split is not None else None
    least = bundle.get("sizes")
    open_ended = any(stop is None for _, spans in sequence for _, stop in spans)
    if open_ended and mode is None and least is None:
        # Counts unknown and not needed (no balance): whole pieces in turn, no counting pass.
        return sequence[info.global_worker :: info.num_consumers]
    counts: list[int] | None = list(split.counts()) if open_ended else None
    sized = [(shard, closed(spans, counts, shard)) for shard, spans in sequence]
    total = sum(length(spans) for _, spans in sized)
    batch = loop_batch(int(bundle.get("batch", 1)))
    sizes, left = consumer_counts(total, info.world_size, info.num_workers, batch, mode)
    if least is not None and total >= sum(least):  # each its least, the rest evenly
        spread, _ = consumer_counts(total - sum(least), info.world_size, info.num_workers, 1, None)
        sizes, left = [int(n) + extra for n, extra in zip(least, spread, strict=True)], 0
    if info.global_worker == 0:
        logger.info(
            "elastic restore: %d samples of epoch %d remain, for %d ranks x %d workers",
            total,
            context.epoch,
            info.world_size,
            info.num_workers,
        )
        if left:
            logger.warning(
                "elastic restore: %d samples %s to keep every rank's batches equal "
                "(balance=%r; the remainder does not divide by %d ranks)",
                abs(left),
                "left out" if left > 0 else "repeated",
                mode,
                info.world_size,
            )
    return cut(sized, sizes, info.global_worker)


def _by_consumer(states: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The old consumers' states in consumer order; one that saved nothing is at its start."""
    layouts = {tuple(state["consumer"][1::2]) for state in states}
    if len(layouts) != 1:
        raise StateMismatchError(f"the states come from different layouts: {sorted(layouts)}")
    world, workers = layouts.pop()
    found: dict[int, Mapping[str, Any]] = {}
    for state in states:
        rank, _, worker, _ = (int(n) for n in state["consumer"])
        number = rank * workers + worker
        if number in found:
            raise StateMismatchError(f"two states of rank {rank}, worker {worker}")
        found[number] = state
    missing = sorted(set(range(world)) - {number // workers for number in found})
    if missing:  # its samples delivered before the save would come again: duplicates
        raise StateMismatchError(
            f"no state of rank(s) {missing} of the {world} that saved this epoch: an elastic "
            "restore needs every rank's state (each rank's, or StatefulLoader's gathered one)"
        )
    epoch = next(iter(states))["epoch"]
    start = {"consumer": None, "epoch": epoch, "stages": {}}
    result: list[Mapping[str, Any]] = []
    for number in range(world * workers):
        rank, worker = divmod(number, workers)
        result.append(found.get(number) or {**start, "consumer": [rank, world, worker, workers]})
    return result


def _unfinished(states: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """:func:`_by_consumer` without the consumers whose share ran out (nothing left)."""
    return [state for state in _by_consumer(states) if state.get("ended") is None]


def _shard(urls: list[str], number: int) -> dict[str, Any]:
    if not 0 <= number < len(urls):
        raise StateMismatchError(f"the state names shard {number}; the list has {len(urls)}")
    return {"url": urls[number], "shard_index": number}


def _of(state: Mapping[str, Any], context: IterationContext) -> IterationContext:
    """The context of the old consumer that saved ``state``: its rank and worker, the
    restored epoch and seed."""
    rank, world, worker, workers = (int(n) for n in state["consumer"])
    info = WorkerInfo(rank=rank, world_size=world, worker=worker, num_workers=workers)
    return IterationContext(seed=context.seed, epoch=context.epoch, info=info)


def _old_plan(
    steps: Sequence[Any], invoke: Callable[..., Any], old: IterationContext
) -> list[dict[str, Any]]:
    """The shard dicts an old consumer's reader was given: the stages before the reader, run
    in that consumer's context (``old``)."""

    def build() -> Any:
        source = invoke(steps[0])
        for step in steps[1:-1]:
            source = invoke(step, source)
        return iter(source)

    return list(run_in_context(old, build))


def _remaining(
    plan: list[dict[str, Any]], stages: Mapping[str, Any], index_of: Mapping[str, int]
) -> list[Piece]:
    """What an old consumer had not delivered: its shuffle buffers' samples and the rest of
    its plan after its reader's position, as pieces in plan order."""
    reader = stages.get("reader", {})
    begun, taken = int(reader.get("shards", 0)), int(reader.get("samples", 0))
    buffered: dict[int, list[int]] = {}
    for key, state in stages.items():
        if key in ("passes", "reader"):
            continue
        if key.split(".")[0] != "shuffle" or "buffer" not in state:
            raise StateMismatchError(
                f"stage {key!r} holds a position that an elastic restore cannot divide"
            )
        for shard, sample in state["buffer"]:
            buffered.setdefault(int(shard), []).append(int(sample))
    pieces: list[Piece] = []
    for number, shard in enumerate(plan):
        index = index_of.get(shard.get("url", ""))
        if index is None:
            raise StateMismatchError("an elastic restore needs shards from the shard list")
        spans = spans_of(shard)
        rest = [] if number < begun - 1 else spans
        if number == begun - 1:
            rest = delivered_from(spans, taken)
        kept = [(n, n + 1) for n in nth(spans, sorted(buffered.pop(number, [])))]
        joined = merged(kept + rest)
        closed = [span for span in joined if span[1] is not None]
        if closed:
            pieces.append((index, closed))
        if len(closed) < len(joined):
            pieces.append((index, joined[-1:]))
    if buffered:
        raise StateMismatchError("a shuffle buffer names shards this consumer never read")
    return pieces


def gathered(states: Sequence[Any], check: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """An elastic restore's resume: every old consumer's state (each checked by ``check``),
    the epoch they are in and its seed. States of consumers that had not started their epoch
    (no seed) stand for consumers at its start."""
    checked = [check(state) for state in states]
    if not checked:
        raise StateMismatchError("an elastic restore needs the states of the old consumers")
    started = [state for state in checked if state.get("seed") is not None]
    epochs = {int(state["epoch"]) for state in started or checked}
    seeds = {int(state["seed"]) for state in started}
    if len(epochs) != 1 or len(seeds) > 1:
        raise StateMismatchError(
            f"the states are from different epochs or seeds ({sorted(epochs)}, {sorted(seeds)})"
        )
    epoch = epochs.pop()
    kept = [state for state in checked if state.get("seed") is not None or state["epoch"] == epoch]
    # A consumer whose share of the epoch ran out saved the next epoch's start, marked with
    # the epoch it ended: it has nothing left (not its whole share again).
    kept += [
        {"consumer": state["consumer"], "epoch": epoch, "ended": epoch, "stages": {}}
        for state in checked
        if state.get("seed") is None and state["epoch"] != epoch and state.get("ended") == epoch
    ]
    return {
        ELASTIC_KEY: kept,
        "epoch": epoch,
        "seed": seeds.pop() if seeds else None,
    }


def reader_index(steps: Sequence[Any], invoke: Callable[..., Any], context: Any) -> int:
    """The number of the stage that builds the shard reader (tried on copies of the stages
    in a copy of ``context``, and closed unread)."""
    probe = IterationContext(seed=context.seed, epoch=context.epoch, info=context.info)
    with iteration_context(probe):
        source: Any = None
        for number, step in enumerate(snapshot(steps)):
            source = invoke(step, source) if number else invoke(step)
            if is_reader(source):
                source.close()
                return number
    raise StateMismatchError("an elastic restore needs a shard reader in the pipeline")


def planned(steps: Sequence[Any], reader: int, plan: Sequence[Piece]) -> list[Any]:
    """The stages of a restored epoch with a plan: the plan's shard dicts, then the reader and
    what follows it."""
    urls = getattr(steps[0], "urls", [])
    shards = [as_shard(_shard(urls, shard), spans) for shard, spans in plan]
    return [shards, *steps[reader:]]


def restore(pipeline: Any, resume: Mapping[str, Any], context: Any) -> tuple[Any, Any]:
    """(the stages, this consumer's elastic part of its state) of a restored epoch: an elastic
    restore computes them (a plan, :func:`share`; or for a ``with_epoch`` epoch, its number of
    items, :func:`items_share`), a state saved during such an epoch carries them; (None, None)
    for any other restore."""
    if not any(key in resume for key in (ELASTIC_KEY, *KEPT[1:])):
        return None, None
    if "limit" in resume:
        return None, {"limit": int(resume["limit"])}
    steps = pipeline.pipeline
    if any(state.get("count_free") for state in resume.get(ELASTIC_KEY, [])):
        raise StateMismatchError(
            "this epoch ran without sample counts (its ranks ended it together): restore it "
            "on the same number of ranks and workers, or give the shards an index"
        )
    if ELASTIC_KEY in resume and pipeline.nsamples > 0:
        batch = int(resume.get("batch", 1))
        return None, {"limit": items_share(pipeline.nsamples, resume[ELASTIC_KEY], context, batch)}
    if ELASTIC_KEY in resume and callable(getattr(steps[0], "restore_elastic", None)):
        # A mix: it divides what its datasets had left (cloudshards.mixelastic).
        old = _by_consumer(resume[ELASTIC_KEY])
        layout = (int(old[0]["consumer"][1]), int(old[0]["consumer"][3]))
        batch = batch_size(steps[1:], int(resume.get("batch", 1)))
        mixes = [
            s.get("stages", {}).get("mix", {}) if "ended" not in s else {"ended": 1} for s in old
        ]
        steps[0].restore_elastic(mixes, layout, batch)
        return None, {}
    if pipeline.repetitions != 1:
        raise StateMismatchError(
            "an elastic restore needs epochs of one pass over the shards, or of with_epoch(n) "
            "items: repeat() epochs cannot be divided over another number of ranks or workers"
        )
    if not isinstance(getattr(steps[0], "urls", None), list) or hasattr(steps[0], "nshards"):
        raise StateMismatchError(
            "an elastic restore divides the rest of an epoch of one list of shards; this "
            f"pipeline starts with {type(steps[0]).__name__} (a mix of datasets, resampled "
            "shards...): restore it on the same number of ranks and DataLoader workers"
        )
    reader = reader_index(steps, pipeline.invoke, context)
    if ELASTIC_KEY in resume:
        split = next((s for s in steps[:reader] if callable(getattr(s, "counts", None))), None)

        def loop_batch(loader_batch: int) -> int:
            return batch_size(steps[reader:], loader_batch)

        plan = share(steps[: reader + 1], pipeline.invoke, resume, context, split, loop_batch)
    else:
        plan = decode(resume["plan"])
    return planned(steps, reader, plan), {"plan": encode(plan)}


def items_share(
    nsamples: int, states: Sequence[Mapping[str, Any]], context: Any, batch: int
) -> int:
    """This consumer's number of items of a restored ``with_epoch(nsamples)`` epoch: the
    items the old consumers had left, divided so that every rank gets the same number of
    batches (a remainder that cannot go into partial batches is rounded up: the stream has
    more). What they are is this consumer's own stream of that epoch (fresh draws with
    resampled shards)."""
    total = 0
    for state in _unfinished(states):
        epoch_items = nsamples
        if "limit" in state:
            epoch_items = int(state["limit"])
        elif ELASTIC_KEY in state:
            then = _of(state, context)
            epoch_items = items_share(
                nsamples, state[ELASTIC_KEY], then, int(state.get("batch", 1))
            )
        yielded = int(state.get("stages", {}).get("passes", {}).get("yielded", 0))
        total += max(0, epoch_items - yielded)
    info = context.info
    sizes, _ = consumer_counts(total, info.world_size, info.num_workers, batch, "pad")
    return int(sizes[info.global_worker])
