"""Member tables: where each member of a complete, uncompressed shard lies, for the warm path.

The first time a shard is parsed into the node cache, the tar reader records every regular
member's ``(name, data offset, size)``. Later epochs read the cached file through ``mmap`` and
slice the members out by offset instead of parsing ~6 tar headers per sample again: the cache
entry is immutable and was verified (size, MD5 where the store gives one) when it was written,
and the table is checked against the file's size before it is used.

Hand-written because no tar library keeps such a table; it is a few lines over the parser.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import operator
import os
from array import array
from collections.abc import Iterator
from typing import Any

from cloudshards.errors import ShardFormatError
from cloudshards.grouping import (
    duplicate_field,
    group_members,
    is_meta_name,
    skip_meta,
    split_key,
)
from cloudshards.types import Member, NameFilter, Sample

__all__ = ["MemberTable", "iter_table", "load_table", "table_samples", "write_table"]


class MemberTable:
    """Name, data offset and size of each regular member, in archive order, as columns (a
    list of names and two int arrays: nothing per member for the garbage collector to track).

    Attributes:
        complete: The archive was read to its proper end (only then is the table usable).
    """

    __slots__ = ("complete", "names", "offsets", "sizes")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.offsets = array("q")
        self.sizes = array("q")
        self.complete = False

    def __len__(self) -> int:
        return len(self.names)

    def rows(self) -> Iterator[tuple[str, int, int]]:
        """``(name, offset, size)`` per member."""
        return zip(self.names, self.offsets, self.sizes, strict=True)


_VERSION = 1
_new_member = tuple.__new__


def write_table(path: str, table: MemberTable, file_size: int) -> None:
    """Save ``table`` for a file of ``file_size`` bytes (atomically; errors are ignored:
    without a table the shard is simply parsed)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    value = {
        "version": _VERSION,
        "size": file_size,
        "names": table.names,
        "offsets": table.offsets.tolist(),
        "sizes": table.sizes.tolist(),
    }
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            # dumps, not dump: dump runs the pure-Python encoder chunk by chunk (~10x slower).
            f.write(json.dumps(value))
        os.replace(tmp, path)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def load_table(path: str, file_size: int) -> MemberTable | None:
    """The table saved for a file of ``file_size`` bytes, or None (missing, stale, corrupt)."""
    try:
        with open(path) as f:
            value: Any = json.load(f)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(value, dict)
        or value.get("version") != _VERSION
        or value.get("size") != file_size
    ):
        return None
    names, offsets, sizes = value.get("names"), value.get("offsets"), value.get("sizes")
    if not (isinstance(names, list) and isinstance(offsets, list) and isinstance(sizes, list)):
        return None
    if not len(names) == len(offsets) == len(sizes):
        return None
    table = MemberTable()
    try:
        table.offsets.fromlist(offsets)
        table.sizes.fromlist(sizes)
    except (TypeError, OverflowError):
        return None
    # Checked in C (map, min, max): this runs for every cached shard of every warm epoch.
    if not set(map(type, names)) <= {str}:  # JSON strings load as str, nothing else does
        return None
    if names and (
        min(table.offsets) < 0
        or min(table.sizes) < 0
        or max(map(operator.add, table.offsets, table.sizes)) > file_size
    ):
        return None
    table.names = names
    table.complete = True
    return table


def iter_table(
    fd: int,
    table: MemberTable,
    *,
    url: str,
    name_filter: NameFilter | None,
    max_member_bytes: int,
) -> Iterator[Member]:
    """Yield the members of the file open at ``fd`` by the offsets in ``table``, as
    :func:`cloudshards.tar.iter_members` would."""
    size = os.fstat(fd).st_size
    if size == 0:
        return
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
        for name, offset, length in table.rows():
            renamed: str | None = name
            if name_filter is not None:
                renamed = name_filter(name)
                if renamed is None:
                    continue
            if length > max_member_bytes:
                # Named as in the archive, as the tar reader names members in its errors.
                raise ShardFormatError(
                    f"member of {length} bytes exceeds max_member_bytes={max_member_bytes}",
                    url=url,
                    offset=offset,
                    member=name,
                )
            yield _new_member(Member, (renamed, view[offset : offset + length], offset))


def table_samples(
    fd: int,
    table: MemberTable,
    *,
    url: str,
    name_filter: NameFilter | None,
    max_member_bytes: int,
    shard_index: int | None = None,
) -> Iterator[Sample]:
    """The samples of the file open at ``fd``, sliced by ``table``: what
    :func:`~cloudshards.grouping.group_members` makes of :func:`iter_table`'s members, in one
    loop (the warm epoch's hot path: no member tuple, no generator between the two)."""
    if table.sizes and max(table.sizes) > max_member_bytes:
        # The member reader's error, and the sample it proves complete, as group_members has it.
        yield from group_members(
            iter_table(
                fd, table, url=url, name_filter=name_filter, max_member_bytes=max_member_bytes
            ),
            url=url,
            shard_index=shard_index,
            name_filter=name_filter,
        )
        return
    if os.fstat(fd).st_size == 0:
        return
    sample: Sample | None = None
    key = ""
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
        meta_only = name_filter is skip_meta  # the usual filter: inline, not called
        for name, offset, length in table.rows():
            if meta_only:
                if name.startswith("__") and is_meta_name(name):
                    continue
            elif name_filter is not None:
                renamed = name_filter(name)
                if renamed is None:
                    continue
                name = renamed
            # split_key's fast path, inline; split_key itself for the names it leaves.
            start = name.rfind("/") + 1
            dot = name.find(".", start)
            if dot > start and "\n" not in name:
                member_key, field = name[:dot], name[dot + 1 :].lower()
            else:
                parts = split_key(name)
                if parts is None:
                    continue
                member_key, field = parts[0], parts[1].lower()
            if sample is None or member_key != key:
                if sample is not None:
                    yield sample
                key = member_key
                sample = {"__key__": key, "__url__": url}
            if field in sample:
                raise duplicate_field(field, key, url, shard_index, offset, name)
            sample[field] = view[offset : offset + length]
    if sample is not None:
        yield sample
