"""Which samples a shard reader delivers, and their numbers: the shards of a pass numbered in
order, resuming after a position, and choosing samples by number (to read a restored shuffle
buffer's samples again); name filters that drop the members of samples not delivered, so that
their data is never read."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cloudshards.grouping import split_key
from cloudshards.stages.spans import advanced, nth, spans_of
from cloudshards.types import NameFilter

__all__ = ["number_of", "positioned", "selected", "selecting", "skipping"]


def positioned(
    src: Iterable[dict[str, Any]],
    resume: tuple[int, int] | None,
    numbered: deque[tuple[dict[str, Any], int, int]],
) -> Iterator[dict[str, Any]]:
    """Number the shards (for ``state_dict``: each shard yielded goes to ``numbered`` with its
    number and the samples skipped in it); on resume skip the shards already read (without
    opening them) and the samples already delivered from the next one."""
    skip_shards, skip_samples = resume or (0, 0)
    for number, shard in enumerate(src):
        if number < skip_shards:
            continue
        shard = dict(shard)  # a dict of our own: the reader finds it again by identity
        resumed = 0
        if number == skip_shards and skip_samples:
            shard = advanced(shard, skip_samples)
            resumed = skip_samples
        numbered.append((shard, number, resumed))
        yield shard


def selected(
    src: Iterable[dict[str, Any]], select: dict[int, frozenset[int]], urls: dict[int, str]
) -> Iterator[dict[str, Any]]:
    """The shards that hold selected samples, each told which of its samples (``select``:
    counted from the shard's first, see :mod:`~cloudshards.stages.spans`) to deliver; none
    after the last of them. Their URLs go to ``urls`` by number (for errors)."""
    last = max(select, default=-1)
    for number, shard in enumerate(src):
        if number > last:
            return
        wanted = select.get(number)
        if wanted:
            urls[number] = shard["url"]
            yield {
                **shard,
                "select": frozenset(nth(spans_of(shard), sorted(wanted))),
                "select_places": (number, sorted(wanted)),
            }


def number_of(
    numbered: deque[tuple[dict[str, Any], int, int]],
    shard: dict[str, Any],
    dropped: list[tuple[dict[str, Any], int, int]] | None = None,
) -> tuple[int, int] | None:
    """(number, samples skipped) of an opened shard; the shards yielded before it that never
    opened (skipped after an open error) are dropped, into ``dropped`` if given. By identity,
    else by URL."""
    for same in (lambda entry: entry[0] is shard, lambda entry: entry[0]["url"] == shard["url"]):
        for i, entry in enumerate(numbered):
            if same(entry):
                for _ in range(i):
                    lost = numbered.popleft()
                    if dropped is not None:
                        dropped.append(lost)
                numbered.popleft()
                return entry[1], entry[2]
    return None


def skipping(name_filter: NameFilter | None, skip: int) -> NameFilter:
    """A name filter that also drops the members of the first ``skip`` samples (without
    reading their data), keyed exactly as :func:`group_members` keys them."""
    return _by_number(name_filter, lambda number: number >= skip, all_from=skip)


def selecting(name_filter: NameFilter | None, wanted: frozenset[int]) -> NameFilter:
    """A name filter that keeps only the members of the samples numbered in ``wanted`` (from
    0, keyed exactly as :func:`group_members` keys them): the others' data is not read."""
    return _by_number(name_filter, wanted.__contains__, all_from=None)


def _by_number(
    name_filter: NameFilter | None, keep: Callable[[int], bool], *, all_from: int | None
) -> NameFilter:
    """``name_filter``, also dropping the members of the samples whose number (from 0, in
    archive order) ``keep`` refuses; from sample ``all_from`` on every sample is kept, without
    looking at the names any more."""
    seen = 0  # samples begun
    kept = -1  # the number of the last sample kept
    last: str | None = None

    def by_number(name: str) -> str | None:
        nonlocal seen, last, kept
        mapped = name_filter(name) if name_filter is not None else name
        if mapped is None or (all_from is not None and seen > all_from):
            return mapped
        parts = split_key(mapped)
        if parts is None:
            return None
        if parts[0] != last:
            last = parts[0]
            seen += 1
        if not keep(seen - 1):
            return None
        kept = seen - 1
        return mapped

    def moved_on() -> bool:
        """A sample after the last one kept has begun (its members skipped): the kept one is
        complete, which group_members cannot see when the archive fails after them."""
        return seen - 1 > kept

    by_number.moved_on = moved_on  # type: ignore[attr-defined]
    return by_number
