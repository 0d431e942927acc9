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
import os
from collections.abc import Iterator
from typing import Any

from cloudshards.errors import ShardFormatError
from cloudshards.types import Member, NameFilter

__all__ = ["MemberTable", "iter_table", "load_table", "write_table"]

#: ``(name, data offset, size)`` of each regular member, in archive order.
MemberTable = list[tuple[str, int, int]]

_VERSION = 1
_new_member = tuple.__new__


def write_table(path: str, table: MemberTable, file_size: int) -> None:
    """Save ``table`` for a file of ``file_size`` bytes (atomically; errors are ignored:
    without a table the shard is simply parsed)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            # dumps, not dump: dump runs the pure-Python encoder chunk by chunk (~10x slower).
            f.write(json.dumps({"version": _VERSION, "size": file_size, "members": table}))
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
    members = value.get("members")
    if not isinstance(members, list):
        return None
    table: MemberTable = []
    for row in members:
        if (
            not isinstance(row, list)
            or len(row) != 3
            or not isinstance(row[0], str)
            or not isinstance(row[1], int)
            or not isinstance(row[2], int)
            or row[1] < 0
            or row[2] < 0
            or row[1] + row[2] > file_size
        ):
            return None
        table.append((row[0], row[1], row[2]))
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
        for name, offset, length in table:
            if name_filter is not None:
                renamed = name_filter(name)
                if renamed is None:
                    continue
                name = renamed
            if length > max_member_bytes:
                raise ShardFormatError(
                    f"member of {length} bytes exceeds max_member_bytes={max_member_bytes}",
                    url=url,
                    offset=offset,
                    member=name,
                )
            yield _new_member(Member, (name, view[offset : offset + length], offset))
