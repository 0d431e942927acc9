"""Which samples of a shard a shard dict delivers, as spans of sample numbers.

A shard dict delivers a run of its shard's samples (``skip``, and ``take`` when balanced) or,
in an elastic restore's plan, chosen samples (``select``: sample numbers counted from the
shard's first). Its own numbering counts the samples it delivers from 0, in archive order;
the shard reader's positions and a shuffle buffer's places use that numbering.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

__all__ = ["Span", "advanced", "as_shard", "delivered_from", "merged", "nth", "spans_of"]

#: ``(start, stop)``: the shard's samples ``start <= n < stop``; ``stop`` None: to its end.
Span = tuple[int, int | None]


def spans_of(shard: dict[str, Any]) -> list[Span]:
    """The spans a shard dict delivers, in order."""
    chosen = shard.get("select")
    if chosen is not None:
        return merged((n, n + 1) for n in chosen)
    skip = int(shard.get("skip", 0))
    take = shard.get("take")
    return [(skip, None if take is None else skip + int(take))]


def merged(spans: Iterable[Span]) -> list[Span]:
    """``spans`` sorted, with touching and overlapping ones joined."""
    result: list[list[Any]] = []
    for start, stop in sorted(spans, key=lambda span: span[0]):
        if result and (result[-1][1] is None or start <= result[-1][1]):
            last = result[-1]
            last[1] = None if stop is None or last[1] is None else max(last[1], stop)
            continue
        result.append([start, stop])
    return [(start, stop) for start, stop in result]


def nth(spans: list[Span], numbers: Iterable[int]) -> list[int]:
    """The shard's sample numbers of the dict's samples ``numbers`` (its own numbering)."""
    starts: list[int] = []  # the own number of each span's first sample
    seen = 0
    for start, stop in spans:
        starts.append(seen)
        seen += (stop - start) if stop is not None else 1 << 62
    result = []
    for number in numbers:
        i = bisect.bisect_right(starts, number) - 1
        result.append(spans[i][0] + number - starts[i])
    return result


def delivered_from(spans: list[Span], first: int) -> list[Span]:
    """``spans`` without their first ``first`` samples (own numbering)."""
    result: list[Span] = []
    for start, stop in spans:
        length = None if stop is None else stop - start
        if length is not None and first >= length:
            first -= length
            continue
        result.append((start + first, stop))
        first = 0
    return result


def advanced(shard: dict[str, Any], first: int) -> dict[str, Any]:
    """``shard`` without its first ``first`` samples (a resumed reader's next shard)."""
    if "select" in shard:
        rest = sorted(shard["select"])[first:]
        return {**shard, "select": frozenset(rest)}
    result = {**shard, "skip": shard.get("skip", 0) + first}
    if "take" in shard:
        result["take"] = max(0, shard["take"] - first)
    return result


def as_shard(base: dict[str, Any], spans: list[Span]) -> dict[str, Any]:
    """A shard dict (``base``'s URL and index) that delivers ``spans``: one span as
    ``skip``/``take``, several as ``select`` (each span's stop must be known then)."""
    if len(spans) == 1:
        start, stop = spans[0]
        result = {**base, "skip": start}
        if stop is not None:
            result["take"] = stop - start
        return result
    chosen: set[int] = set()
    for start, stop in spans:
        assert stop is not None, "only the last span of a shard runs to its end"
        chosen.update(range(start, stop))
    return {**base, "select": frozenset(chosen)}
