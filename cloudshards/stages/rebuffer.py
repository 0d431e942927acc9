"""Restoring a shuffle buffer exactly: which shard reader feeds it (through stages that give
one item per sample), and reading its samples again by position in a second chain.

See :class:`~cloudshards.stages.shuffle.ShuffleIterator`: its state names each buffered sample
by (shard number, sample number) in the pass, as the shard reader numbers them; a restore
rebuilds the stages before the shuffle with the reader told to deliver only those samples
(:meth:`~cloudshards.stages.read.ShardReader.select`), and hands the items back by position.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from cloudshards.stages.base import current_context, one_item_per_sample
from cloudshards.stages.shuffle import ShuffleIterator
from cloudshards.stages.state import describe_stage

__all__ = ["connect", "is_reader", "read_again", "snapshot"]


def is_reader(source: Any) -> bool:
    """A shard reader: it numbers the samples it delivers and can deliver chosen ones."""
    return hasattr(source, "position") and callable(getattr(source, "select", None))


def snapshot(steps: Sequence[Any]) -> list[Any]:
    """Shallow copies of ``steps`` as they are before this pass invokes them (a stage counting
    its calls, detshuffle, sees this pass's count in both chains), each with its own copy of
    an ``rng`` it holds; a stage that cannot be copied is used as it is."""
    copies = []
    for step in steps:
        try:
            twin = copy.copy(step)
        except Exception:  # an object that refuses copying: the pass's own is used
            copies.append(step)
            continue
        rng = getattr(step, "rng", None)
        if isinstance(rng, random.Random) and twin is not step:
            # A user's generator (shuffle(rng=...)): the copy draws from its state as the pass
            # found it, not after the pass's own draws.
            twin.rng = copy.deepcopy(rng)
        copies.append(twin)
    return copies


def connect(
    steps: Sequence[Any], shuffle: ShuffleIterator, number: int, reader: tuple[int, Any] | None
) -> None:
    """Hand the shuffle buffer built by ``steps[number]`` the shard reader before it (``reader``:
    its step number and the reader), when every stage in between gives at most one item per
    sample; otherwise its buffer stays out of the state, and it says why."""
    if reader is None:
        shuffle.inexact("no shard reader feeds it")
        return
    for step in steps[reader[0] + 1 : number]:
        if not one_item_per_sample(step):
            name = getattr(getattr(step, "f", None), "__name__", "") or describe_stage(step)[0]
            shuffle.inexact(
                f"{name.lstrip('_')} before it is not known to give one item per sample"
            )
            return
    shuffle.reader = reader[1]


def read_again(
    invoke: Callable[..., Any],
    steps: Sequence[Any],
    stop: int,
    places: list[tuple[int, int]],
    draws: int = 0,
) -> tuple[dict[tuple[int, int], Any], dict[int, str]]:
    """The items that ``steps[0..stop-1]`` give for the samples at ``places`` (shard number,
    sample number in this pass), by place, and the URLs of the shards reached, by number: a
    second chain (built with ``invoke``, in the running epoch's context) whose shard reader
    delivers only those samples. ``draws``: the seeds the pass had drawn before its chain, so
    that its random stages draw here what they drew there (a URL shuffle: the same shards).
    """
    context = current_context()
    with context.drawing_from(draws) if context is not None else nullcontext():
        return _read_again(invoke, steps, stop, places)


def _read_again(
    invoke: Callable[..., Any], steps: Sequence[Any], stop: int, places: list[tuple[int, int]]
) -> tuple[dict[tuple[int, int], Any], dict[int, str]]:
    wanted = sorted(set(places))
    reader: Any = None
    source = invoke(steps[0])
    for step in [*steps[1:stop], None]:
        if reader is None and is_reader(source):
            reader = source
            reader.select(wanted)
        if step is not None:
            source = invoke(step, source)
    found: dict[tuple[int, int], Any] = {}
    if reader is None:
        return found, {}
    position = reader.position
    iterator = iter(source)
    try:
        for item in iterator:
            found[(position[0] - 1, position[1] - 1)] = item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
    return found, reader.selected_urls
