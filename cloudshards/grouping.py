"""WebDataset's grouping rules: member name -> (key, field), consecutive members -> samples.

Matches webdataset 1.0.2 (``base_plus_ext``, meta-name skipping, ``group_by_keys``) exactly.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator

from cloudshards.errors import ShardFormatError, ShardOpenError, shown_name
from cloudshards.types import Member, NameFilter, Oversized, Sample

__all__ = [
    "duplicate_field",
    "group_members",
    "is_meta_name",
    "make_name_filter",
    "skip_duplicate",
    "skip_meta",
    "split_key",
]

logger = logging.getLogger(__name__)

# webdataset 1.0.2's regexes, verbatim: the fast paths below must agree with them exactly.
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META_RE = re.compile(r"__[^/]*__($|/)")

# What a sample's limit counts for each field beyond its name and data: roughly the memory of
# the field's string, bytes object and dict slot. Without it, a .tar.gz of many empty members
# (a 512-byte header each, which compresses ~100x) could still hold millions of fields at no cost.
_FIELD_OVERHEAD_BYTES = 128


def split_key(name: str) -> tuple[str, str] | None:
    """Split a member name into (key, field) by webdataset's ``base_plus_ext`` rule.

    The key is the path up to the first dot of the basename, the field is the rest:
    ``"a/b/x.seg.png"`` -> ``("a/b/x", "seg.png")``, ``"dir.v2/x.jpg"`` -> ``("dir.v2/x", "jpg")``.

    Args:
        name: Member name.

    Returns:
        ``(key, field)``, or None when the basename has no dot (webdataset skips the member).
        Odd names follow webdataset's regex, e.g. ``"a/.hidden"`` -> ``("a/", "hidden")``
        but ``".hidden"`` -> None.
    """
    start = name.rfind("/") + 1
    dot = name.find(".", start)
    if dot > start and "\n" not in name:
        # The regex's answer whenever the basename has a dot after its first character, and
        # no newline stops its ".*" early; ~3x faster than matching.
        return name[:dot], name[dot + 1 :]
    match = _KEY_RE.match(name)
    return None if match is None else (match.group(1), match.group(2))


def is_meta_name(name: str) -> bool:
    """Tell whether webdataset skips this member as metadata.

    True for top-level ``__something__`` names and for names starting with a
    ``__something__`` path component (webdataset's ``skip_meta`` regex, matched at the start).
    """
    if not name.startswith("__"):
        return False
    if "/" not in name and name.endswith("__"):
        return True
    return _META_RE.match(name) is not None


def skip_meta(name: str) -> str | None:
    """The name filter without hooks: None for metadata names (:func:`is_meta_name`)."""
    return None if name.startswith("__") and is_meta_name(name) else name


def make_name_filter(
    select_files: Callable[[str], bool] | None,
    rename_files: Callable[[str], str] | None,
) -> NameFilter:
    """Build the :data:`~cloudshards.types.NameFilter` for webdataset's member hooks.

    As in webdataset 1.0.2: metadata names (:func:`is_meta_name`, checked on the original
    name) are skipped, then ``rename_files`` renames, then ``select_files`` selects on the
    renamed name.

    Args:
        select_files: Keeps a member when it returns True for its (renamed) name.
        rename_files: Maps a member name to the name to group by.

    Returns:
        A filter for :func:`cloudshards.tar.iter_members`; never None, because metadata names
        must be skipped even without hooks.
    """

    if select_files is None and rename_files is None:
        return skip_meta

    def name_filter(name: str) -> str | None:
        if name.startswith("__") and is_meta_name(name):
            return None
        if rename_files is not None:
            name = rename_files(name)
        if select_files is not None and not select_files(name):
            return None
        return name

    return name_filter


def group_members(
    members: Iterable[Member],
    *,
    url: str,
    lowercase_fields: bool = True,
    shard_index: int | None = None,
    name_filter: NameFilter | None = None,
    on_duplicate: Callable[[Exception], bool] | None = None,
    max_sample_bytes: int | None = None,
    local_path: str | None = None,
    on_oversize: Callable[[Exception], bool] | None = None,
) -> Iterator[Sample]:
    """Group consecutive members with the same key into samples.

    When ``members`` fails with a :class:`ShardFormatError` (a damaged shard) or a
    :class:`ShardOpenError` (the store failed mid-shard), the sample being built is yielded
    first only if the error proves it complete: the error names the member
    being read (``exc.member``, as :func:`cloudshards.tar.iter_members` does) and that member
    would have started another sample. Otherwise (the damaged member belongs to the sample, or
    the damage is in a header, so the next member is unknown) the sample may be partial and is
    dropped. Either way the error is then raised.

    Args:
        members: Members of one shard, in archive order.
        url: Shard URL, stored as each sample's ``__url__``.
        lowercase_fields: Lower-case field names (``"x.JPG"`` -> ``"jpg"``), as webdataset does.
        shard_index: Position of the shard, for error reports.
        name_filter: The filter ``members`` were read with: errors name members as in the
            archive, and this maps such a name to the one grouping would have seen (None:
            the member would have been skipped, so it proves nothing).
        on_duplicate: The pipeline's error handler, asked about a field that appears twice
            (see :func:`skip_duplicate`); None raises.
        max_sample_bytes: Most bytes one sample may hold (None: no limit): its key, and for
            each field its name, its data and 128 bytes for the objects that hold them. Each
            member is bounded by its reader, but a compressed shard could otherwise inflate
            many fields of one sample (16 fields of 1 GiB from 16 MB), or many empty members
            with long names (1,500 names of 1 MiB from a 1.5 MB .tar.gz).
        local_path: A local shard's path, stored as each sample's ``__local_path__`` where
            webdataset 1.0.2 puts it: after the sample's first field.
        on_oversize: The pipeline's error handler, asked about each member that ``members``
            gave as too large to read (:class:`~cloudshards.types.Oversized`: see
            :func:`cloudshards.tar.iter_members`' ``skip_oversized``), as it is asked about a
            duplicate; None raises its error as the reader would have. When it returns True,
            the whole sample that member belongs to is dropped (never given with a field
            missing), and an empty dict is yielded in its place, so that a caller numbering
            samples keeps the archive's numbering; the samples around it are unaffected.

    Yields:
        ``{"__key__": key, "__url__": url, field: bytes, ...}`` samples, in member order
        (``{}`` for a sample dropped by ``on_oversize``). Members whose name has no key
        (:func:`split_key` returns None) are skipped.

    Raises:
        ShardFormatError: A field appears twice in one sample (this also catches fields
            named ``__key__`` or ``__url__``, as webdataset does), a member was too large
            (and ``on_oversize`` did not go on), or ``members`` raised it.
    """
    sample: Sample | None = None
    key = ""
    held = 0  # bytes of the sample being built: its key, and its fields' names and data
    try:
        for name, data, offset in members:
            parts = split_key(name)
            if parts is None:
                given: object = data  # for a member too large to read, an Oversized
                if not isinstance(given, Oversized):
                    continue
                skipped, error = given  # the reader gave it in the member's place (name "")
                if error.shard_index is None:
                    error.shard_index = shard_index
                if on_oversize is None:
                    raise error  # as the reader's own error (below): the sample it proves complete
                parts = split_key(skipped)  # None: grouping skips it, its sample goes on
                dropping = parts is not None and (sample is not None or parts[0] != key)
                if parts is not None:
                    if sample is not None and parts[0] != key:
                        yield sample  # complete: the oversized member begins another sample
                    sample, key = None, parts[0]  # the members of its sample are skipped
                if not skip_duplicate(error, on_oversize):
                    failure = error
                    break
                if dropping:
                    yield {}  # in the dropped sample's place, for callers that number them
                continue
            member_key, field = parts
            if lowercase_fields:
                field = field.lower()
            if sample is None or member_key != key:
                if sample is not None:
                    yield sample
                elif member_key == key:  # a member of a sample dropped as oversized
                    continue
                key = member_key
                sample = {"__key__": key, "__url__": url}
                held = len(key)
            if field in sample:
                error = duplicate_field(field, key, url, shard_index, offset, name)
                if skip_duplicate(error, on_duplicate):
                    continue
                failure = error  # raised below, outside the handler for errors of ``members``
                break
            if max_sample_bytes is not None:
                # The name is held too: empty members with long names are not free.
                held += len(data) + len(field) + _FIELD_OVERHEAD_BYTES
                if held > max_sample_bytes:
                    failure = ShardFormatError(
                        f"sample {shown_name(key)} holds more than {max_sample_bytes} bytes in its "
                        "fields' names and data (a sample may hold twice max_member_bytes)",
                        url=url,
                        shard_index=shard_index,
                        offset=offset,
                        member=name,
                    )
                    break
            sample[field] = data
            if local_path is not None and len(sample) == 3:
                sample["__local_path__"] = local_path
        else:
            if sample is not None:
                yield sample
            return
    except (ShardFormatError, ShardOpenError) as exc:
        if sample is not None and _starts_another_sample(exc.member, key, name_filter):
            yield sample
        raise
    raise failure


def duplicate_field(
    field: str, key: str, url: str, shard_index: int | None, offset: int, member: str
) -> ShardFormatError:
    """The error for a field that appears twice in one sample."""
    return ShardFormatError(
        f"duplicate field {shown_name(field)} in sample {shown_name(key)}",
        url=url,
        shard_index=shard_index,
        offset=offset,
        member=member,
    )


def skip_duplicate(error: ShardFormatError, handler: Callable[[Exception], bool] | None) -> bool:
    """Whether to go on past a duplicated member, keeping the field's first value, as
    webdataset's ``group_by_keys`` does when its handler returns True (or past an oversized
    one, dropping its sample). A handler that returns False has answered: the error is marked
    (``handled``) so the reader stops without asking it again."""
    if handler is None:
        return False
    if handler(error):
        return True
    error.handled = True
    return False


def _starts_another_sample(damaged: str | None, key: str, name_filter: NameFilter | None) -> bool:
    """Whether the damaged member (its name in the archive) would have begun a sample other
    than ``key``: only then is the sample with ``key`` known to be complete."""
    moved_on = getattr(name_filter, "moved_on", None)
    if moved_on is not None and moved_on():  # it skipped a later sample's members: complete
        return True
    if damaged is None:
        return False
    if name_filter is not None:
        damaged = name_filter(damaged)
        if damaged is None:
            return False
    parts = split_key(damaged)
    return parts is not None and parts[0] != key
