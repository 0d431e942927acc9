"""Member tables: where each member of a complete, uncompressed shard lies, for the warm path.

The first time a shard is parsed into the node cache, the tar reader records every regular
member's ``(name, data offset, size)``. Later epochs read the cached file through ``mmap`` and
slice the members out by offset instead of parsing ~6 tar headers per sample again: the cache
entry is immutable and was verified (size, and the checksum the store guarantees, if any)
when it was written, and the table is checked against the file's size before it is used.

Saved as a binary file: a JSON header line, the offsets and sizes as raw arrays, and the
names, keys and (lower-case) fields as NUL-separated UTF-8, so that a warm epoch neither parses
JSON for thousands of names nor splits a name per member (webdataset's key rule is applied
once, when the table is saved). Tables saved as JSON by earlier versions still load.

Hand-written because no tar library keeps such a table; it is a few lines over the parser.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import operator
import os
import re
import sys
import zlib
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from cloudshards.cache.files import open_file, replace_with
from cloudshards.errors import ShardFormatError
from cloudshards.grouping import (
    duplicate_field,
    group_members,
    is_meta_name,
    skip_duplicate,
    skip_meta,
    split_key,
)
from cloudshards.types import Member, NameFilter, Oversized, Sample

__all__ = [
    "MemberTable",
    "iter_table",
    "load_table",
    "table_samples",
    "write_table",
]


class MemberTable:
    """Name, data offset and size of each regular member, in archive order, as columns (a
    list of names and two int arrays: nothing per member for the garbage collector to track).

    Attributes:
        complete: The archive was read to its proper end (only then is the table usable).
    """

    __slots__ = ("complete", "fields", "keys", "names", "offsets", "sizes")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.offsets = array("q")
        self.sizes = array("q")
        self.complete = False
        #: Each member's key and lower-case field, where every name has both (a loaded
        #: table saved with them); None: the names are split as they are read.
        self.keys: list[str] | None = None
        self.fields: list[str] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def rows(self) -> Iterator[tuple[str, int, int]]:
        """``(name, offset, size)`` per member."""
        return zip(self.names, self.offsets, self.sizes, strict=True)


_new_member = tuple.__new__
#: The saved table's first line; a JSON header line follows, then the columns.
_MAGIC = b"cloudshards member table\n"
_TEXT = ("utf-8", "surrogatepass")  # names as the tar reader made them, lone surrogates too


def write_table(path: str, table: MemberTable, file_size: int) -> None:
    """Save ``table`` for a file of ``file_size`` bytes (atomically; errors are ignored:
    without a table the shard is simply parsed). Names with a NUL (which separates them in
    the file; no tar writer makes one) leave the shard without a table."""
    names = table.names
    if any("\0" in name for name in names):
        return
    joined = "\0".join(names)
    split = _split_names(joined, names)
    blobs = [text.encode(*_TEXT) for text in (joined, *(split or ()))]
    columns = b"".join([table.offsets.tobytes(), table.sizes.tobytes(), *blobs])
    header = {
        "version": 2,
        "size": file_size,
        "rows": len(names),
        "byteorder": sys.byteorder,
        "split": split is not None,
        "lengths": [len(blob) for blob in blobs],
        "crc32": zlib.crc32(columns),  # a table damaged on disk is not used
    }
    with contextlib.suppress(OSError):
        replace_with(path, _MAGIC + json.dumps(header).encode() + b"\n" + columns)


#: From the first dot of a name's basename to the end of the name, in NUL-joined names.
_FROM_DOT_RE = re.compile(r"\.([^\0/]*)(?=\0|$)")


def _split_names(joined: str, names: list[str]) -> tuple[str, str] | None:
    """Every name's key and lower-case field (webdataset's rule, as the readers apply it),
    NUL-joined as ``joined`` (the names) is; None if a name has none (such a member is
    skipped: the names are then split as they are read).

    Where no basename starts with a dot and no name has a newline (every shard, in practice),
    two regex passes over ``joined`` split them all: a cold epoch through the cache saves
    every shard's table, and splitting name by name in Python took most of that time."""
    plain = not joined.startswith(".") and "\0." not in joined and "/." not in joined
    if plain and "\n" not in joined:
        fields = _FROM_DOT_RE.findall(joined)
        if len(fields) == len(names):  # each name has one: its basename has a dot
            return _FROM_DOT_RE.sub("", joined), "\0".join(fields).lower()
    keys, fields = [], []
    for name in names:
        parts = _key_field(name)
        if parts is None:
            return None
        keys.append(parts[0])
        fields.append(parts[1])
    return "\0".join(keys), "\0".join(fields)


def _key_field(name: str) -> tuple[str, str] | None:
    """A member's key and lower-case field, as samples name them (saved and read alike)."""
    parts = split_key(name)
    return None if parts is None else (parts[0], parts[1].lower())


def load_table(path: str, file_size: int) -> MemberTable | None:
    """The table saved for a file of ``file_size`` bytes, or None (missing, stale, corrupt)."""
    try:
        with os.fdopen(open_file(path, os.O_RDONLY), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    loaded = _from_columns(raw) if raw.startswith(_MAGIC) else _from_json(raw)
    if loaded is None:
        return None
    table, saved_for = loaded
    if type(saved_for) is not int or saved_for != file_size:
        return None
    # Checked in C (map, min, max): this runs for every cached shard of every warm epoch.
    if table.names and (
        min(table.offsets) < 0
        or min(table.sizes) < 0
        or max(map(operator.add, table.offsets, table.sizes)) > file_size
    ):
        return None
    table.complete = True
    return table


def _from_columns(raw: bytes) -> tuple[MemberTable, Any] | None:
    """A table saved by :func:`write_table` (its header, then its columns, nothing more),
    and the file size it was saved for."""
    try:
        end = raw.index(b"\n", len(_MAGIC))
        header: Any = json.loads(raw[len(_MAGIC) : end])
    except ValueError:  # no header line, or not JSON
        return None
    if not isinstance(header, dict) or header.get("version") != 2:
        return None
    if header.get("byteorder") != sys.byteorder:  # a cache directory moved between machines
        return None
    rows, split, lengths = header.get("rows"), header.get("split"), header.get("lengths")
    if type(rows) is not int or rows < 0 or type(split) is not bool:
        return None
    if not isinstance(lengths, list) or len(lengths) != (3 if split else 1):
        return None
    if not all(type(length) is int and length >= 0 for length in lengths):
        return None
    position = end + 1
    if len(raw) != position + 16 * rows + sum(lengths):
        return None
    crc = header.get("crc32")  # tables saved before it had one are read as they are
    if crc is not None and crc != zlib.crc32(memoryview(raw)[position:]):
        return None
    table = MemberTable()
    table.offsets.frombytes(raw[position : position + 8 * rows])
    table.sizes.frombytes(raw[position + 8 * rows : position + 16 * rows])
    position += 16 * rows
    columns = []
    for length in lengths:
        strings = _strings(raw[position : position + length], rows)
        if strings is None:
            return None
        columns.append(strings)
        position += length
    table.names = columns[0]
    if split:
        table.keys, table.fields = columns[1], columns[2]
    return table, header.get("size")


def _strings(blob: bytes, rows: int) -> list[str] | None:
    """``rows`` NUL-separated strings, or None."""
    if not rows:
        return None if blob else []
    try:
        strings = blob.decode(*_TEXT).split("\0")
    except UnicodeDecodeError:
        return None
    return strings if len(strings) == rows else None


def _from_json(raw: bytes) -> tuple[MemberTable, Any] | None:
    """A table saved as JSON by earlier versions (version 1), and the file size it was saved
    for."""
    try:
        value: Any = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("version") != 1:
        return None
    names, offsets, sizes = value.get("names"), value.get("offsets"), value.get("sizes")
    if not (isinstance(names, list) and isinstance(offsets, list) and isinstance(sizes, list)):
        return None
    if not len(names) == len(offsets) == len(sizes):
        return None
    if not set(map(type, names)) <= {str}:  # JSON strings load as str, nothing else does
        return None
    table = MemberTable()
    try:
        table.offsets.fromlist(offsets)
        table.sizes.fromlist(sizes)
    except (TypeError, OverflowError):
        return None
    table.names = names
    return table, value.get("size")


def iter_table(
    fd: int,
    table: MemberTable,
    *,
    url: str,
    name_filter: NameFilter | None,
    max_member_bytes: int,
    skip_oversized: bool = False,
) -> Iterator[Member]:
    """Yield the members of the file open at ``fd`` by the offsets in ``table``, as
    :func:`cloudshards.tar.iter_members` would (``skip_oversized`` too)."""
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
                # Named as in the archive and placed at its header (just before its data), as
                # the tar reader's error has it.
                error = ShardFormatError(
                    f"member of {length} bytes exceeds max_member_bytes={max_member_bytes}",
                    url=url,
                    offset=offset - 512,
                    member=name,
                )
                if not skip_oversized:
                    raise error
                kept = name if renamed is None else renamed  # (not None: filtered out above)
                yield _new_member(Member, ("", Oversized(kept, error), offset))
                continue
            yield _new_member(Member, (renamed, view[offset : offset + length], offset))


def table_samples(
    fd: int,
    table: MemberTable,
    *,
    url: str,
    name_filter: NameFilter | None,
    max_member_bytes: int,
    max_sample_bytes: int | None = None,
    shard_index: int | None = None,
    on_duplicate: Callable[[Exception], bool] | None = None,
    on_oversize: Callable[[Exception], bool] | None = None,
) -> Iterator[Sample]:
    """The samples of the file open at ``fd``, sliced by ``table``: what
    :func:`~cloudshards.grouping.group_members` makes of :func:`iter_table`'s members (given
    with ``skip_oversized`` where ``on_oversize`` is), in one loop (the warm epoch's hot
    path: no member tuple, no generator between the two)."""
    size = os.fstat(fd).st_size
    # What a sample holds (its key, and per field its name, data and 128 bytes) is less than
    # the bytes its members take in the tar (a 512-byte header each, long names in blocks of
    # their own), so only a file larger than the sample limit can hold a sample over it.
    if (table.sizes and max(table.sizes) > max_member_bytes) or (
        max_sample_bytes is not None and size > max_sample_bytes
    ):
        # The limits' errors, and the sample they prove complete, as a cold read has them.
        yield from group_members(
            iter_table(
                fd,
                table,
                url=url,
                name_filter=name_filter,
                max_member_bytes=max_member_bytes,
                skip_oversized=on_oversize is not None,
            ),
            url=url,
            shard_index=shard_index,
            name_filter=name_filter,
            on_duplicate=on_duplicate,
            max_sample_bytes=max_sample_bytes,
            on_oversize=on_oversize,
        )
        return
    if size == 0:
        return
    sample: Sample | None = None
    key = ""
    meta_only = name_filter is skip_meta  # the usual filter: inline, not called
    rows: Iterator[tuple[str, str, str, int, int]]
    if table.keys is not None and table.fields is not None and (meta_only or name_filter is None):
        # Split when the table was saved: nothing per member but the slice.
        rows = zip(table.names, table.keys, table.fields, table.offsets, table.sizes, strict=True)
    else:
        rows = _split_rows(table, None if meta_only else name_filter)
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
        for name, member_key, field, offset, length in rows:
            if meta_only and name.startswith("__") and is_meta_name(name):
                continue
            if sample is None or member_key != key:
                if sample is not None:
                    yield sample
                key = member_key
                sample = {"__key__": key, "__url__": url}
            if field in sample:
                error = duplicate_field(field, key, url, shard_index, offset, name)
                if skip_duplicate(error, on_duplicate):
                    continue
                raise error
            sample[field] = view[offset : offset + length]
    if sample is not None:
        yield sample


def _split_rows(
    table: MemberTable, name_filter: NameFilter | None
) -> Iterator[tuple[str, str, str, int, int]]:
    """``(name, key, lower-case field, offset, size)`` of the members ``name_filter`` keeps
    (renamed) that have a key, for a table saved without its keys."""
    for name, offset, length in table.rows():
        if name_filter is not None:
            renamed = name_filter(name)
            if renamed is None:
                continue
            name = renamed
        parts = _key_field(name)
        if parts is not None:
            yield name, parts[0], parts[1], offset, length
