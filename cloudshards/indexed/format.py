"""The tar index of indexed mode: its in-memory form and its JSON layout.

Part of :mod:`cloudshards.indexed`, which re-exports the public names. Shard URLs next to
the index are stored relative to it (:mod:`cloudshards.indexed.location`). The layout is
documented in ``docs/indexed.md``.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cloudshards import config
from cloudshards.errors import ConfigError, DecodeError, ShardFormatError
from cloudshards.indexed.check import IndexLayoutError, check_layout
from cloudshards.indexed.location import (
    check_entry,
    parent_url,
    relative_entry,
    resolve_entry,
    strip_query,
)
from cloudshards.inflate import gunzip
from cloudshards.redact import redact_url
from cloudshards.tar import GZIP_MAGIC
from cloudshards.urls import PIPE_PREFIX

__all__ = [
    "FORMAT",
    "VERSION",
    "DatasetIndex",
    "IndexedMember",
    "IndexedSample",
    "ShardIndex",
    "parent_url",
    "read_index",
    "shard_sample_counts",
    "strip_query",
]

logger = logging.getLogger(__name__)

#: The ``format`` field of every index file.
FORMAT = "cloudshards-index"
#: The layout version this code reads and writes; any other is refused.
VERSION = 1

_COLUMNS = ("starts", "ends", "member_counts")
_MEMBER_COLUMNS = ("member_fields", "member_offsets", "member_sizes")


class IndexedMember(NamedTuple):
    """One tar member of a sample: its name, data offset in the shard, and size in bytes."""

    name: str
    offset: int
    size: int


class IndexedSample(NamedTuple):
    """One sample of a shard.

    Attributes:
        key: The sample's ``__key__``.
        start: Offset of the first header of its first member (PAX headers included).
        end: End of its last member's data, padding included: ``[start, end)`` is the one
            ranged GET that fetches the sample.
        members: Its members, in archive order.
    """

    key: str
    start: int
    end: int
    members: tuple[IndexedMember, ...]


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """The index of one shard, stored in compact columns (``array('q')``), not objects.

    Attributes:
        url: Absolute shard URL.
        size: Shard size in bytes when indexed.
        etag: The store's ETag (or md5) when indexed, if it gave one.
        mtime: The store's modification time when indexed, as text, if it gave one.
        keys: Sample keys in order.
        fields: Distinct member name suffixes (``"jpg"``, ``"seg.PNG"``), case kept.
    """

    url: str
    size: int
    keys: list[str]
    starts: array[int]
    ends: array[int]
    fields: tuple[str, ...]
    member_bounds: array[int]  # members of sample j: member_bounds[j] .. member_bounds[j + 1]
    member_fields: array[int]
    member_offsets: array[int]
    member_sizes: array[int]
    etag: str | None = None
    mtime: str | None = None

    @property
    def num_samples(self) -> int:
        """Number of samples in the shard."""
        return len(self.keys)

    def sample(self, position: int) -> IndexedSample:
        """The sample at ``position`` (0-based) within this shard."""
        key = self.keys[position]
        fields = self.fields
        lo, hi = self.member_bounds[position], self.member_bounds[position + 1]
        members = tuple(
            IndexedMember(f"{key}.{fields[self.member_fields[m]]}", self.member_offsets[m], size)
            for m, size in zip(range(lo, hi), self.member_sizes[lo:hi], strict=True)
        )
        return IndexedSample(key, self.starts[position], self.ends[position], members)

    def samples(self) -> Iterator[IndexedSample]:
        """Every sample, in order."""
        return (self.sample(j) for j in range(len(self.keys)))

    @classmethod
    def from_samples(
        cls,
        url: str,
        size: int,
        samples: Iterable[IndexedSample],
        *,
        etag: str | None = None,
        mtime: str | None = None,
    ) -> ShardIndex:
        """Build the columns from samples (each member name must be ``key + "." + field``)."""
        keys: list[str] = []
        starts, ends, bounds = array("q"), array("q"), array("q", [0])
        fields: dict[str, int] = {}
        member_fields, offsets, sizes = array("q"), array("q"), array("q")
        for sample in samples:
            keys.append(sample.key)
            starts.append(sample.start)
            ends.append(sample.end)
            for member in sample.members:
                suffix = member.name[len(sample.key) + 1 :]
                assert member.name == f"{sample.key}.{suffix}", member.name
                member_fields.append(fields.setdefault(suffix, len(fields)))
                offsets.append(member.offset)
                sizes.append(member.size)
            bounds.append(len(offsets))
        return cls(
            url, size, keys, starts, ends, tuple(fields), bounds, member_fields, offsets, sizes,
            etag=etag, mtime=mtime,
        )  # fmt: skip

    def to_json(self, stored_url: str) -> dict[str, Any]:
        """The shard's JSON object, with ``stored_url`` as its URL."""
        counts = [b - a for a, b in itertools.pairwise(self.member_bounds)]
        return {
            "url": stored_url,
            "size": self.size,
            "etag": self.etag,
            "mtime": self.mtime,
            "num_samples": self.num_samples,
            "fields": list(self.fields),
            "keys": self.keys,
            "starts": self.starts.tolist(),
            "ends": self.ends.tolist(),
            "member_counts": counts,
            "member_fields": self.member_fields.tolist(),
            "member_offsets": self.member_offsets.tolist(),
            "member_sizes": self.member_sizes.tolist(),
        }

    @classmethod
    def from_json(cls, value: Any, url: str) -> ShardIndex:
        """Parse and check one shard object; ``url`` is its resolved URL.

        Raises:
            ValueError: The object is malformed or inconsistent (the caller names the file);
                an :class:`IndexLayoutError` names the member where one is at fault.
        """
        if not isinstance(value, dict):
            raise ValueError("a shard entry is not an object")
        size, keys, fields = value.get("size"), value.get("keys"), value.get("fields")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"bad size {size!r}")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("keys must be a list of strings")
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise ValueError("fields must be a list of strings")
        columns = {name: _int_column(value, name) for name in (*_COLUMNS, *_MEMBER_COLUMNS)}
        n = len(keys)
        if value.get("num_samples", n) != n or any(len(columns[c]) != n for c in _COLUMNS):
            raise ValueError("sample columns differ in length")
        bounds = array("q", [0, *itertools.accumulate(columns["member_counts"])])
        if any(len(columns[c]) != bounds[-1] for c in _MEMBER_COLUMNS):
            raise ValueError("member columns do not match member_counts")
        starts, ends = columns["starts"], columns["ends"]
        check_layout(
            size, keys, fields, starts, ends, bounds, columns["member_fields"],
            columns["member_offsets"], columns["member_sizes"],
        )  # fmt: skip
        return cls(
            url, size, keys, starts, ends, tuple(fields), bounds, columns["member_fields"],
            columns["member_offsets"], columns["member_sizes"],
            etag=_optional_str(value.get("etag")), mtime=_optional_str(value.get("mtime")),
        )  # fmt: skip


def _comparable(url: str) -> str:
    return os.path.abspath(url) if "://" not in url and not url.startswith(PIPE_PREFIX) else url


def _int_column(value: dict[str, Any], name: str) -> array[int]:
    column = value.get(name)
    if not isinstance(column, list):
        raise ValueError(f"{name} must be a list of integers")
    try:
        return array("q", column)
    except (TypeError, OverflowError):
        raise ValueError(f"{name} must be a list of integers") from None


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True, eq=False)
class DatasetIndex:
    """The index of a dataset: its shards in order; sample ``i`` counts across them.

    Attributes:
        shards: One :class:`ShardIndex` per shard; ``shards[i].url`` is absolute.
        url: Where the index was loaded from or last written to (None when built in memory).
    """

    shards: tuple[ShardIndex, ...]
    url: str | None = None
    _ends: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        ends = list(itertools.accumulate(s.num_samples for s in self.shards))
        object.__setattr__(self, "_ends", ends)

    @property
    def num_samples(self) -> int:
        """Total number of samples."""
        return self._ends[-1] if self._ends else 0

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, index: int) -> tuple[int, int]:
        """Map a sample index in ``[0, num_samples)`` to ``(shard position, sample in shard)``."""
        shard = bisect.bisect_right(self._ends, index)
        return shard, index - (self._ends[shard - 1] if shard else 0)

    def shard_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` sample index range of each shard, in order."""
        return list(itertools.pairwise([0, *self._ends]))

    def select(self, urls: Sequence[str]) -> DatasetIndex | None:
        """The index of just these shards in this order, or None if one is not indexed.

        Bare local paths match whether given relative or absolute.
        """
        by_url = {_comparable(shard.url): shard for shard in self.shards}
        try:
            return DatasetIndex(tuple(by_url[_comparable(url)] for url in urls), self.url)
        except KeyError:
            return None

    def to_json(self, url: str | None = None) -> dict[str, Any]:
        """The index as a JSON-able dict; shard URLs below ``url``'s directory become relative."""
        import cloudshards

        return {
            "format": FORMAT,
            "version": VERSION,
            "created_by": f"cloudshards {cloudshards.__version__}",
            "num_shards": len(self.shards),
            "num_samples": self.num_samples,
            "shards": [
                s.to_json(relative_entry(s.url, url) if url else s.url) for s in self.shards
            ],
        }


def shard_sample_counts(index: DatasetIndex) -> dict[str, int]:
    """Map each shard's absolute URL to its number of samples."""
    return {shard.url: shard.num_samples for shard in index.shards}


def read_index(data: bytes, url: str, *, allow_external_shards: bool = False) -> DatasetIndex:
    """Parse index bytes (JSON, gzip-compressed or not) read from ``url``.

    Every shard entry must lie inside the index's own location: the same protocol and host or
    bucket, under the index's directory, with no ``..`` or backslash (percent-encoded or not).
    Only a trusted index should be read with ``allow_external_shards=True``, which lifts this
    rule (``pipe:`` entries are refused even then).

    Raises:
        ConfigError: The file is not a cloudshards index, has another format version, or lists
            a shard outside its location.
        ShardFormatError: The file is corrupt or inconsistent (byte ranges no tar could have,
            totals that do not add up), naming the shard entry and member.
    """
    try:
        if data[:2] == GZIP_MAGIC:
            # Bounded like a decoded field: a gzip bomb posing as an index is an error, not
            # an out-of-memory kill (CLOUDSHARDS_MAX_DECODED_BYTES raises the bound).
            data = gunzip(data, config.max_decoded_bytes())
        document = json.loads(data)
    except DecodeError as exc:
        raise ShardFormatError(f"index {exc.reason}", url=url) from None
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise ShardFormatError(f"index is not valid (gzipped) JSON: {exc}", url=url) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ConfigError(
            f'{redact_url(url)} is not a cloudshards index (no "format": "{FORMAT}" field); '
            "build one with `cloudshards index URL...`"
        )
    version = document.get("version")
    if version != VERSION:
        raise ConfigError(
            f"{redact_url(url)} has index format version {version!r}; this cloudshards reads "
            f"version {VERSION}: rebuild it with `cloudshards index` (or upgrade cloudshards)"
        )
    entries = document.get("shards")
    if not isinstance(entries, list):
        raise ShardFormatError("corrupt index: no list of shards", url=url)
    shards = []
    for position, entry in enumerate(entries):
        stored = entry.get("url") if isinstance(entry, dict) else None
        if isinstance(stored, str) and stored:
            check_entry(stored, url, position, allow_external_shards=allow_external_shards)
        try:
            if not isinstance(stored, str) or not stored:
                raise ValueError("no url")
            shards.append(ShardIndex.from_json(entry, resolve_entry(stored, url)))
        except ValueError as exc:
            name = redact_url(stored) if isinstance(stored, str) else "?"
            raise ShardFormatError(
                f"corrupt index: shard entry {position} ({name}): {exc} (rebuild the index "
                "with `cloudshards index`)",
                url=url,
                shard_index=position,
                member=exc.member if isinstance(exc, IndexLayoutError) else None,
            ) from None
    index = DatasetIndex(tuple(shards), url)
    for name, total in (("num_shards", len(shards)), ("num_samples", index.num_samples)):
        if document.get(name, total) != total:
            raise ShardFormatError(
                f"corrupt index: {name} is {document[name]!r}, its shard entries hold {total}",
                url=url,
            )
    return index
