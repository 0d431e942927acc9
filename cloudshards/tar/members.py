"""Streaming tar reader: yields the regular files of a (possibly compressed) tar stream as Members.

Parses 512-byte headers by hand out of large buffered reads; no grouping, no decoding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableSequence
from typing import Protocol

from cloudshards.config import DEFAULT_BLOCK_BYTES, DEFAULT_MAX_MEMBER_BYTES
from cloudshards.errors import ConfigError, ShardFormatError
from cloudshards.tar.blocks import MAX_OFFSET, BlockReader, describe_size
from cloudshards.tar.decompress import GZIP_MAGIC
from cloudshards.tar.headers import (
    BLOCK,
    REGULAR_TYPES,
    ZERO_BLOCK,
    checksum_ok,
    cut_nul,
    decode_name,
    member_name,
    parse_number,
    parse_pax,
    pax_times_only,
)
from cloudshards.types import Member, NameFilter, Oversized

__all__ = ["GZIP_MAGIC", "MemberRecord", "ReadableStream", "iter_members"]

logger = logging.getLogger(__name__)

# Type flags (byte values of header[156]); regular files are REGULAR_TYPES.
_NO_DATA = frozenset(b"123456")  # links, devices, directories, fifos: POSIX stores no data
_PAX, _PAX_SOLARIS, _PAX_GLOBAL = 0x78, 0x58, 0x67  # x, X, g
_LONG_NAME, _LONG_LINK, _SPARSE = 0x4C, 0x4B, 0x53  # L, K, S (GNU)
_META = frozenset((_PAX, _PAX_SOLARIS, _PAX_GLOBAL, _LONG_NAME, _LONG_LINK))

# NamedTuple's own __new__ is a Python function: tuple.__new__ halves the cost per member.
_new_member = tuple.__new__

#: Largest PAX / GNU long-name record accepted; real ones are a few hundred bytes.
_MAX_META_BYTES = 1 << 20

#: Stand-in for a PAX size that is not a number (refused when the member's header is read).
_PAX_SIZE_JUNK = -1
#: PAX sizes with more digits than int() converts (4300) stand in as 10**4000: too large too.
_PAX_SIZE_DIGITS = 4000


class ReadableStream(Protocol):
    """What :func:`iter_members` reads: any binary stream with ``read(n)``.

    When ``seekable()`` says True, ``seek(offset, 1)`` is also used: to skip large unwanted
    members and to read each large member with a single ``read``.
    """

    def read(self, size: int, /) -> bytes: ...


class MemberRecord(Protocol):
    """Where :func:`iter_members` records each regular member it reads, as columns (the node
    cache's :class:`~cloudshards.cache.membertable.MemberTable` is one)."""

    @property
    def names(self) -> MutableSequence[str]: ...

    @property
    def offsets(self) -> MutableSequence[int]: ...

    @property
    def sizes(self) -> MutableSequence[int]: ...

    #: Set once the archive has ended properly.
    complete: bool


def iter_members(
    stream: ReadableStream,
    *,
    url: str | None = None,
    name_filter: NameFilter | None = None,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    record: MemberRecord | None = None,
    skip_oversized: bool = False,
) -> Iterator[Member]:
    """Yield the regular files of a tar stream, in order, without reading it all into memory.

    Handles ustar, v7, GNU (long names, base-256 sizes) and PAX (``x`` per member, ``g``
    parsed and ignored) headers, and gzip, bzip2 and xz (detected by their magic bytes,
    concatenated streams allowed, each stream's own check made at its end). Directories,
    links, devices, fifos and unknown types are skipped. The archive ends at two zero blocks,
    one zero block and EOF, or (as GNU tar accepts) EOF on a header boundary. The ``tarfile``
    module is not used: it is ~7-10x slower per member here.

    Args:
        stream: Binary stream positioned at the start of the tar (or compressed tar) data.
        url: Shard URL, used (redacted) in error messages only.
        name_filter: Maps each member name to the name to yield, or to None to skip the
            member without copying its data.
        max_member_bytes: Largest member to read into memory; a larger one raises (see
            ``skip_oversized``) before anything is allocated. Members skipped by
            ``name_filter`` are not read, so not limited.
        block_bytes: Read size; large blocks amortise the per-read overhead.
        record: When given, receives the name, data offset and size of every regular member
            (before ``name_filter``) and is marked ``complete`` once the archive has ended
            properly, so that an uncompressed shard can later be read by offset (compressed
            shards record nothing).
        skip_oversized: Go on past a member larger than ``max_member_bytes`` instead of
            raising: ``Member("", Oversized(name, error), offset)`` comes in its place, and
            its data is skipped without being read (or held, once inflated) when the
            iteration goes on. :func:`~cloudshards.grouping.group_members` turns it into
            its ``on_oversize`` handler's question.

    Returns:
        An iterator of ``Member(name, data, offset)``; ``offset`` is where the data starts in
        the uncompressed stream.

    Raises:
        ConfigError: ``block_bytes`` is not positive or ``max_member_bytes`` is negative.
        ShardFormatError: While iterating: truncated or corrupt tar, gzip, bzip2 or xz data, a bad
            header checksum, a size that is not a number or would end past byte 2**63, or a
            member larger than ``max_member_bytes`` (unless ``skip_oversized``). Its
            ``member`` names the regular file being read when that is known, by its name in
            the archive (before ``name_filter``): every member before it was read intact.
            Other entries (extended headers, directories, unknown types) are described in the
            message only.
    """
    if block_bytes < 1:
        raise ConfigError(f"block_bytes must be positive, got {block_bytes}")
    if max_member_bytes < 0:
        raise ConfigError(f"max_member_bytes must not be negative, got {max_member_bytes}")
    return _iter_members(
        stream, url, name_filter, max_member_bytes, block_bytes, record, skip_oversized
    )


def _iter_members(
    stream: ReadableStream,
    url: str | None,
    name_filter: NameFilter | None,
    max_member_bytes: int,
    block_bytes: int,
    record: MemberRecord | None = None,
    skip_oversized: bool = False,
) -> Iterator[Member]:
    rd = BlockReader(stream, url, block_bytes)
    if rd.compressed is not None:
        record = None  # offsets in the uncompressed stream are no use for reading the file
    if record is not None:
        add_name, add_offset, add_size = (
            record.names.append,
            record.offsets.append,
            record.sizes.append,
        )
    buf, pos = rd.buf, rd.pos
    # buf may be a part the stream handed on as a view (PartStream.read_view): then headers
    # and members are copied out of it as bytes. Checked at each refill, not per member.
    view = type(buf) is not bytes
    long_name: str | None = None  # from a GNU 'L' header, for the next member
    pax_path: str | None = None  # from a PAX 'x' header, for the next member
    pax_size: int | None = None
    ext_offset = -1  # offset of the pending extended header, -1 when none
    last_pax, last_pax_size, last_pax_padded = b"", 0, 0  # the last PAX 'x' header read
    # The loop keeps buf/pos in locals (attribute access costs ~10% on small members) and syncs
    # them with rd around every rd call.
    while True:
        if len(buf) - pos < BLOCK:
            rd.pos = pos
            if not rd.fill(BLOCK):
                rd.finish_at_eof(ext_offset)
                return
            buf, pos = rd.buf, rd.pos
            view = type(buf) is not bytes
        offset = rd.base + pos
        header = buf[pos : pos + BLOCK]
        if view:
            header = bytes(header)
        pos += BLOCK
        if header == last_pax and pos + last_pax_padded <= len(buf):
            # webdataset's writer (tarfile) puts a PAX header holding only a fractional mtime
            # before every member: the same 512 bytes each time (checked once), the data
            # differing. Such data changes nothing; a dict of it costs ~40% of a sample.
            data = buf[pos : pos + last_pax_size]
            if pax_times_only(bytes(data) if view else data):
                pos += last_pax_padded
                ext_offset = offset
                continue
        if not checksum_ok(header):
            if header == ZERO_BLOCK:
                rd.pos = pos
                rd.finish_at_zero_block(offset, ext_offset)
                if record is not None:
                    record.complete = True
                return
            raise ShardFormatError(
                "bad tar header checksum (corrupt shard)", url=url, offset=offset
            )
        typeflag = header[156]
        size = parse_number(header[124:136])
        if size is None or size < 0:
            raise _bad_size("bad size field in tar header", rd, header, offset, pax_path, long_name)
        if pax_size is not None and typeflag not in _META:
            size = pax_size
            if size < 0:
                raise _bad_size(
                    "bad size in PAX header (not a decimal number)",
                    rd,
                    header,
                    ext_offset,
                    pax_path,
                    long_name,
                )
        padded = size + (-size & 511)

        if typeflag in REGULAR_TYPES and not (typeflag == 0 and cut_nul(header[:100])[-1:] == b"/"):
            if pax_path is not None:
                name = pax_path
            elif long_name is not None:
                name = long_name
            else:
                name = member_name(header)
            long_name = pax_path = pax_size = None
            ext_offset = -1
            data_offset = rd.base + pos
            if record is not None:
                if data_offset + padded > MAX_OFFSET:  # the table's array('q') cannot hold it
                    raise rd.too_large(size, data_offset, name)
                add_name(name)
                add_offset(data_offset)
                add_size(size)
            # Errors name the member as in the archive; it is yielded as the filter says.
            new_name: str | None = name
            if name_filter is not None:
                new_name = name_filter(name)
            if new_name is None or size > max_member_bytes:
                # Not read: filtered out (of any size), or too large.
                if new_name is not None:
                    error = ShardFormatError(
                        f"member of {describe_size(size)} bytes exceeds "
                        f"max_member_bytes={max_member_bytes}",
                        url=url,
                        offset=offset,
                        member=name,
                    )
                    if not skip_oversized:
                        raise error
                    # Its error in its place; its data is skipped only if asked for more.
                    yield _new_member(Member, ("", Oversized(new_name, error), data_offset))
                if pos + padded <= len(buf):
                    pos += padded
                else:
                    rd.pos = pos
                    rd.skip_or_raise(size, padded, name)
                    buf, pos = rd.buf, rd.pos
                    view = type(buf) is not bytes
                continue
            end = pos + padded
            if end <= len(buf):
                data = buf[pos : pos + size]
                if view:
                    data = bytes(data)  # the sample's own bytes, not a view of a whole part
                pos = end
            else:
                rd.pos = pos
                data = rd.take_or_raise(size, padded, name)
                buf, pos = rd.buf, rd.pos
                view = type(buf) is not bytes
            yield _new_member(Member, (new_name, data, data_offset))
            continue

        if typeflag in _META:
            if size > _MAX_META_BYTES:
                raise ShardFormatError(
                    f"extended header of {describe_size(size)} bytes is implausibly large",
                    url=url,
                    offset=offset,
                )
            if pos + padded <= len(buf):
                data = buf[pos : pos + size]
                if view:
                    data = bytes(data)
                pos += padded
            else:
                rd.pos = pos
                data = rd.take_or_raise(size, padded, None, "an extended header")
                buf, pos = rd.buf, rd.pos
                view = type(buf) is not bytes
            if typeflag == _LONG_NAME:
                long_name = decode_name(cut_nul(data))
            elif typeflag != _LONG_LINK:
                records = _parse_pax_or_raise(data, url, offset)
                if typeflag == _PAX_GLOBAL:
                    # A global path or size would apply to every later member: meaningless
                    # for sample shards, and tarfile itself applies it inconsistently.
                    logger.debug("ignoring global PAX header with keys %s", sorted(records))
                    continue
                pax_path, pax_size = _apply_pax(records, pax_path, pax_size, url, offset)
                if typeflag == _PAX:
                    last_pax, last_pax_size, last_pax_padded = header, size, padded
            ext_offset = offset
            continue

        if typeflag == _SPARSE:
            raise ShardFormatError("GNU sparse members are not supported", url=url, offset=offset)
        # Directory, link, device, fifo, or an unknown type (whose data, if any, is skipped).
        long_name = pax_path = pax_size = None
        ext_offset = -1
        if typeflag in _NO_DATA or typeflag == 0:
            continue
        if pos + padded <= len(buf):
            pos += padded
        else:
            rd.pos = pos
            rd.skip_or_raise(size, padded, None, _entry(member_name(header), typeflag))
            buf, pos = rd.buf, rd.pos
            view = type(buf) is not bytes


def _entry(name: str, typeflag: int) -> str:
    """Describe an entry that is not a regular file, for messages."""
    return f"entry {name!r} of type {chr(typeflag)!r}, not a file"


def _is_file(header: bytes) -> bool:
    # The test the reader's loop makes inline (a call there costs ~3% on small members).
    typeflag = header[156]
    return typeflag in REGULAR_TYPES and not (typeflag == 0 and cut_nul(header[:100])[-1:] == b"/")


def _bad_size(
    message: str,
    rd: BlockReader,
    header: bytes,
    offset: int,
    pax_path: str | None,
    long_name: str | None,
) -> ShardFormatError:
    """The error for a header whose size is not a number, naming the entry it belongs to."""
    typeflag = header[156]
    if typeflag in _META:
        return rd.error(message, offset, None, "an extended header")
    name = pax_path if pax_path is not None else long_name
    if name is None:
        name = member_name(header)
    if _is_file(header):
        return rd.error(message, offset, name)
    return rd.error(message, offset, None, _entry(name, typeflag))


def _parse_pax_or_raise(data: bytes, url: str | None, offset: int) -> dict[str, bytes]:
    try:
        return parse_pax(data)
    except ValueError as exc:
        raise ShardFormatError(f"corrupt PAX header: {exc}", url=url, offset=offset) from None


def _apply_pax(
    records: dict[str, bytes],
    path: str | None,
    size: int | None,
    url: str | None,
    offset: int,
) -> tuple[str | None, int | None]:
    """Return the (path, size) overrides of a PAX 'x' header; an empty value means no override."""
    if "GNU.sparse.major" in records or "GNU.sparse.size" in records or "GNU.sparse.map" in records:
        raise ShardFormatError("GNU sparse members are not supported", url=url, offset=offset)
    raw_path = records.get("path")
    if raw_path:
        path = decode_name(raw_path).rstrip("/")  # as tarfile does
    raw_size = records.get("size")
    if raw_size:
        # Checked when the member's own header is read, so the error can name the member.
        # Digits only: int() would also take "+1", " 1", "1_0" (and raises past 4300 digits).
        digits = raw_size.lstrip(b"0")
        if not raw_size.isdigit():
            size = _PAX_SIZE_JUNK
        elif len(digits) > _PAX_SIZE_DIGITS:
            size = 10**_PAX_SIZE_DIGITS  # refused (past 2**63) before anything is read
        else:
            size = int(digits or b"0")
    return path, size
