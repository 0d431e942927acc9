"""Reading indexed samples: parse and check a sample's bytes, and per-process open files.

Part of :mod:`cloudshards.indexed`; used by its other modules only.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import io
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from cloudshards.errors import ShardFormatError
from cloudshards.grouping import group_members, make_name_filter, split_key
from cloudshards.indexed.format import IndexedMember, IndexedSample, ShardIndex
from cloudshards.logs import warn_once
from cloudshards.source import local_path
from cloudshards.tar import iter_members
from cloudshards.tar.headers import (
    BLOCK,
    REGULAR_TYPES,
    ZERO_BLOCK,
    checksum_ok,
    member_name,
    parse_number,
)
from cloudshards.types import Member, Sample

__all__ = [
    "STALE_HINT",
    "OpenFile",
    "ProcessState",
    "ShardChangedError",
    "check_length",
    "checked",
    "parse_sample",
]

logger = logging.getLogger(__name__)

_END_OF_ARCHIVE = ZERO_BLOCK * 2
_NAME_FILTER = make_name_filter(None, None)
#: Shard files (cache entries, local shards) kept open per process.
MAX_OPEN_FILES = 128


STALE_HINT = "the shard changed since it was indexed? rebuild the index with `cloudshards index`"


class ShardChangedError(ShardFormatError):
    """The shard is not the one indexed (another size, or shorter than a sample's bytes):
    its later samples cannot be read as indexed either, so a substitute comes from the next
    shard and this one is passed over a while, as after a :class:`ShardOpenError`."""


def checked(handle: OpenFile, shard: ShardIndex, position: int) -> OpenFile:
    size = os.fstat(handle.fd).st_size
    if size != shard.size:
        handle.close()
        raise ShardChangedError(
            f"shard is {size} bytes, the index says {shard.size} ({STALE_HINT})",
            url=shard.url,
            shard_index=position,
        )
    return handle


def check_length(data: bytes, length: int, shard: ShardIndex, position: int) -> bytes:
    if len(data) != length:
        raise ShardChangedError(
            f"got {len(data)} of the sample's {length} bytes: the shard is shorter than "
            f"indexed ({STALE_HINT})",
            url=shard.url,
            shard_index=position,
        )
    return data


def parse_sample(
    data: bytes, shard: ShardIndex, entry: IndexedSample, position: int, max_member_bytes: int
) -> Sample:
    """Turn a sample's bytes into the streaming reader's sample dict, checked against the index.

    Fast path: each member's own header (the block before its data) must have a good checksum
    and the indexed name and size; then the fields are sliced out by offset. Anything else
    (names in PAX or GNU long-name headers, or a shard that changed) goes through the tar
    reader, which parses every header in the range and compares it with the index.
    """
    for name, offset, size in entry.members:
        # Checked when an index file is loaded, but not in an index built in memory: never
        # slice a field short.
        if offset - entry.start < BLOCK or offset + size > entry.end:
            raise ShardFormatError(
                f"the index puts this member's data [{offset}, {offset + size}) outside its "
                f"sample's bytes [{entry.start}, {entry.end}) with its header: the index is "
                "inconsistent; rebuild it with `cloudshards index`",
                url=shard.url,
                shard_index=position,
                offset=offset,
                member=name,
            )
    sample = _sliced(data, entry) or _parsed(data, shard, entry, position, max_member_bytes)
    sample["__url__"] = shard.url
    path = local_path(shard.url)
    if path is not None:
        # As the streaming reader (and webdataset 1.0.2) tell where a local shard lives.
        sample["__local_path__"] = path
    return sample


def _sliced(data: bytes, entry: IndexedSample) -> Sample | None:
    start, key = entry.start, entry.key
    sample: Sample = {"__key__": key, "__url__": None}
    for name, offset, size in entry.members:
        at = offset - start
        header = data[at - BLOCK : at]
        if (
            at < BLOCK
            or header[156] not in REGULAR_TYPES
            or parse_number(header[124:136]) != size
            or member_name(header) != name
            or not checksum_ok(header)
        ):
            return None
        # As group_members: the field is the name after the key, lower-cased.
        field = name[len(key) + 1 :].lower()
        if field in sample:  # twice in one sample: the tar reader names the duplicate
            return None
        sample[field] = data[at : at + size]
    return sample


def _parsed(
    data: bytes, shard: ShardIndex, entry: IndexedSample, position: int, max_member_bytes: int
) -> Sample:
    start = entry.start
    try:
        members = [
            member
            for member in iter_members(
                io.BytesIO(data + _END_OF_ARCHIVE),
                url=shard.url,
                name_filter=_NAME_FILTER,
                max_member_bytes=max_member_bytes,
            )
            if split_key(member.name) is not None
        ]
    except ShardFormatError as exc:
        raise ShardFormatError(
            f"{exc.reason} ({STALE_HINT})",
            url=shard.url,
            shard_index=position,
            offset=None if exc.offset is None else start + exc.offset,
            member=entry.members[0].name,
        ) from exc
    found = [IndexedMember(m.name, start + m.offset, len(m.data)) for m in members]
    if found != list(entry.members):
        raise ShardFormatError(
            f"the shard's members here are {[m.name for m in found][:4]}, the index says "
            f"{[m.name for m in entry.members][:4]} ({STALE_HINT})",
            url=shard.url,
            shard_index=position,
            offset=start,
            member=entry.members[0].name,
        )
    relocated = (Member(m.name, m.data, start + m.offset) for m in members)
    return next(group_members(relocated, url=shard.url, shard_index=position))


@dataclass(eq=False)
class OpenFile:
    fd: int
    closer: Callable[[], None]
    refs: int = 0
    retired: bool = False

    def close(self) -> None:
        self.closer()


@dataclass(eq=False)
class ProcessState:
    """What one process owns: open shard files (LRU), downloads in flight, a thread pool
    (a dataset keeps one per process in a :class:`~cloudshards.process.PerProcess`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    files: collections.OrderedDict[int, OpenFile] = field(default_factory=collections.OrderedDict)
    opening: dict[int, threading.Event] = field(default_factory=dict)
    no_file: set[int] = field(default_factory=set)
    counters: collections.Counter[str] = field(default_factory=collections.Counter)
    warned: set[str] = field(default_factory=set)
    #: Shards that could not be read: position -> (passed over until, why).
    bad_shards: dict[int, tuple[float, str]] = field(default_factory=dict)
    executors: dict[int, cf.ThreadPoolExecutor] = field(default_factory=dict)

    def count(self, name: str) -> None:
        with self.lock:
            self.counters[name] += 1

    def warn_once(self, message: str) -> None:
        warn_once(logger, self.warned, "%s", message, key=message)

    def acquire(self, key: int, opener: Callable[[], OpenFile | None]) -> OpenFile | None:
        """The open file for shard ``key`` (one opener per shard at a time); None: no file."""
        while True:
            with self.lock:
                handle = self.files.get(key)
                if handle is not None:
                    self.files.move_to_end(key)
                    handle.refs += 1
                    return handle
                if key in self.no_file:
                    return None
                event = self.opening.get(key)
                mine = event is None
                if mine:
                    event = self.opening[key] = threading.Event()
            assert event is not None
            if not mine:
                event.wait()
                continue
            opened = False
            handle = None
            try:
                handle = opener()
                opened = True
            finally:
                with self.lock:
                    del self.opening[key]
                    if handle is not None:
                        handle.refs += 1
                        self.files[key] = handle
                        self._retire_extra()
                    elif opened:
                        self.no_file.add(key)
                event.set()
            return handle

    def _retire_extra(self) -> None:
        while len(self.files) > MAX_OPEN_FILES:
            _, old = self.files.popitem(last=False)
            old.retired = True
            if old.refs == 0:
                old.close()

    def release(self, handle: OpenFile) -> None:
        with self.lock:
            handle.refs -= 1
            close = handle.retired and handle.refs == 0
        if close:
            handle.close()

    def pool(self, workers: int) -> cf.ThreadPoolExecutor:
        with self.lock:
            executor = self.executors.get(workers)
            if executor is None:
                executor = self.executors[workers] = cf.ThreadPoolExecutor(
                    workers, "cloudshards-indexed"
                )
            return executor

    def close(self) -> None:
        with self.lock:
            executors = list(self.executors.values())
            self.executors.clear()
            files = list(self.files.values())
            self.files.clear()
        for executor in executors:
            executor.shutdown(wait=True)
        for handle in files:
            handle.retired = True
            if handle.refs == 0:
                with contextlib.suppress(OSError):
                    handle.close()
