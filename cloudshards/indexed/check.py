"""The byte layout an index may describe: what a tar could have (samples in order inside their
shard, each member's data after its header and inside its sample).

Part of :mod:`cloudshards.indexed`; used by its other modules only.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["IndexLayoutError", "check_layout"]

logger = logging.getLogger(__name__)

_BLOCK = 512  # tar headers and member data start on 512-byte blocks


class IndexLayoutError(ValueError):
    """A shard entry describes bytes no tar could have; ``member`` names the member, if one."""

    def __init__(self, message: str, member: str | None = None) -> None:
        super().__init__(message)
        self.member = member


def check_layout(
    shard_size: int,
    keys: Sequence[str],
    fields: Sequence[str],
    starts: array[int],
    ends: array[int],
    bounds: array[int],
    member_fields: array[int],
    offsets: array[int],
    sizes: array[int],
) -> None:
    """Check that a shard entry's columns describe a tar: block-aligned samples in order inside
    the shard, each with at least one member and no field twice (fields compare lower-cased,
    as in sample dicts), each member's data after its header and inside its sample's range,
    members in order without overlap.

    Whole columns are checked at once (numpy views of the arrays, no copies), so loading an
    index of millions of members stays dominated by parsing its JSON; only a failure walks
    the samples one by one, to name the first that is wrong.

    Raises:
        IndexLayoutError: The first thing that cannot be, naming the member where one is.
    """
    if not all(fields) or len(set(fields)) != len(fields):
        raise IndexLayoutError("fields must be distinct, non-empty strings")
    if not all(keys):
        raise IndexLayoutError(f"sample {list(keys).index('')} has an empty key")
    field = np.frombuffer(member_fields, dtype=np.int64)
    if len(field) and (field.min() < 0 or field.max() >= len(fields)):
        raise IndexLayoutError("member_fields points outside fields")
    groups: dict[str, int] = {}
    lowered = np.array([groups.setdefault(f.lower(), len(groups)) for f in fields], np.int64)
    columns = (starts, ends, bounds, offsets, sizes)
    start, end, bound, offset, size = (np.frombuffer(c, dtype=np.int64) for c in columns)
    if keys and not _plausible(shard_size, start, end, bound, offset, size, lowered[field]):
        names = [f"{keys[j]}.{fields[member_fields[m]]}" for j, m in _positions(bounds)]
        _find_fault(shard_size, keys, starts, ends, bounds, names, offsets, sizes)


def _positions(bounds: array[int]) -> list[tuple[int, int]]:
    return [(j, m) for j in range(len(bounds) - 1) for m in range(bounds[j], bounds[j + 1])]


def _plausible(
    shard_size: int,
    start: np.ndarray[Any, Any],
    end: np.ndarray[Any, Any],
    bound: np.ndarray[Any, Any],
    offset: np.ndarray[Any, Any],
    size: np.ndarray[Any, Any],
    group: np.ndarray[Any, Any],
) -> bool:
    if (np.diff(bound) < 1).any() or (size < 0).any():
        return False
    if any((column % _BLOCK).any() for column in (start, end, offset)):
        return False
    if start[0] < 0 or end[-1] > shard_size or (end <= start).any() or (start[1:] < end[:-1]).any():
        return False
    # Offsets are block-aligned, so "the next header follows this member's padded data" is
    # "the next offset is at least this offset + size + one header block".
    if (offset[1:] - offset[:-1] - size[:-1] < _BLOCK).any():
        return False
    first, last = bound[:-1], bound[1:] - 1
    if (offset[first] - start < _BLOCK).any() or (offset[last] + size[last] > end).any():
        return False
    return _distinct(group, first)


def _distinct(group: np.ndarray[Any, Any], first: np.ndarray[Any, Any]) -> bool:
    """No sample holds a field group twice (``first``: each sample's first member)."""
    if group.max() < 62:
        # One bit per group: a sample's bits add up to their OR only when no bit repeats.
        bits = np.left_shift(np.int64(1), group)
        return bool((np.add.reduceat(bits, first) == np.bitwise_or.reduceat(bits, first)).all())
    sample = np.repeat(np.arange(len(first), dtype=np.int64), np.diff([*first, len(group)]))
    pairs = sample * (int(group.max()) + 1) + group
    return len(np.unique(pairs)) == len(pairs)


def _find_fault(
    shard_size: int,
    keys: Sequence[str],
    starts: array[int],
    ends: array[int],
    bounds: array[int],
    names: Sequence[str],
    offsets: array[int],
    sizes: array[int],
) -> None:
    previous_end = 0
    for j, key in enumerate(keys):
        start, end = starts[j], ends[j]
        if start % _BLOCK or end % _BLOCK or not previous_end <= start < end <= shard_size:
            raise IndexLayoutError(
                f"sample {key!r} has the byte range [{start}, {end}): not a block-aligned range "
                f"after the previous sample's end ({previous_end}) and inside the shard's "
                f"{shard_size} bytes"
            )
        lo, hi = bounds[j], bounds[j + 1]
        if hi <= lo:
            raise IndexLayoutError(f"sample {key!r} has no members")
        cursor = start  # where the next member's headers may begin
        seen: set[str] = set()
        for m in range(lo, hi):
            offset, size, field = offsets[m], sizes[m], names[m][len(key) + 1 :].lower()
            if size < 0 or offset % _BLOCK or offset - _BLOCK < cursor or offset + size > end:
                raise IndexLayoutError(
                    f"member data [{offset}, {offset + size}) is not a block-aligned range after "
                    f"its header (from byte {cursor}) and inside its sample's bytes "
                    f"[{start}, {end})",
                    member=names[m],
                )
            if field in seen:
                raise IndexLayoutError(f"field {field!r} twice in one sample", member=names[m])
            seen.add(field)
            cursor = offset + size + (-size % _BLOCK)
        previous_end = end
    raise IndexLayoutError("byte ranges overlap or run out of order")  # not reached
