"""Single tar header fields: numbers, checksums, names, PAX records, decoded from ``bytes``.

Used by the tar reader and by indexed reads (which check each member's header); raises nothing
of ours.
"""

from __future__ import annotations

import logging
import re
import struct
import zlib

__all__ = [
    "BLOCK",
    "REGULAR_TYPES",
    "ZERO_BLOCK",
    "checksum_ok",
    "cut_nul",
    "decode_name",
    "member_name",
    "parse_number",
    "parse_pax",
    "pax_times_only",
]

logger = logging.getLogger(__name__)

#: Size of a tar header and the unit member data is padded to.
BLOCK = 512

#: An end-of-archive block.
ZERO_BLOCK = bytes(BLOCK)

#: Type flags (byte values of ``header[156]``) of regular files: regular, old-style regular
#: (NUL), contiguous. The tar reader and indexed reads accept these, and no others.
REGULAR_TYPES = frozenset(b"0\x007")

_adler32 = zlib.adler32
_SIGNED_BYTES = struct.Struct("148b8x356b")


def cut_nul(field: bytes) -> bytes:
    """Return ``field`` up to its first NUL byte (C string semantics of tar fields)."""
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


def decode_name(raw: bytes) -> str:
    """Decode a member name as tarfile does (UTF-8, undecodable bytes kept as surrogates)."""
    return raw.decode("utf-8", "surrogateescape")


def parse_number(field: bytes) -> int | None:
    """Decode a numeric header field: octal text, or GNU base-256 binary; None when invalid.

    Octal text is read as tarfile reads it: up to the first NUL, blank means 0.

    Args:
        field: The raw field (e.g. the 12 bytes of ``size``).

    Returns:
        The value (negative only for base-256 fields starting with 0xff, or a "-" sign), or
        None when the field is neither octal text nor base-256.
    """
    try:
        # Fast path for the usual "0001234\0" / "001234\0 " fields.
        return int(field.rstrip(b"\0 ") or b"0", 8)
    except ValueError:
        pass
    lead = field[0]
    if lead == 0x80 or lead == 0xFF:
        # GNU/star base-256: big-endian two's complement in the remaining bytes.
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * (len(field) - 1))) if lead == 0xFF else value
    try:
        return int(cut_nul(field).strip() or b"0", 8)
    except ValueError:
        return None


def checksum_ok(header: bytes) -> bool:
    """Check a header's checksum, accepting the unsigned and the signed byte sum as tarfile does.

    Args:
        header: One 512-byte header block.

    Returns:
        True when the stored checksum matches.
    """
    # adler32 keeps 1 + the byte sum (mod 65521) in its low half. An ASCII header sums to at
    # most 512 * 127 < 65521, so one call over it is exact (and a signed sum is the same);
    # otherwise slices of at most 256 bytes cannot wrap. ~6x faster than sum(header).
    if header.isascii():
        unsigned = (_adler32(header) & 0xFFFF) - (_adler32(header[148:156]) & 0xFFFF) + 256
        return parse_number(header[148:156]) == unsigned
    unsigned = (
        (_adler32(header[:148]) & 0xFFFF)
        + (_adler32(header[156:404]) & 0xFFFF)
        + (_adler32(header[404:]) & 0xFFFF)
        + 253  # 8 spaces stand in for the checksum field (256), minus the three adler 1s
    )
    stored = parse_number(header[148:156])
    if stored == unsigned:
        return True
    if stored is None:
        return False
    # Some old tars (Sun, early GNU) summed signed chars.
    signed: int = 256 + sum(_SIGNED_BYTES.unpack_from(header))
    return stored == signed


def member_name(header: bytes) -> str:
    """Return the name of a header: POSIX ustar ``prefix/name``, else just ``name``."""
    name = cut_nul(header[:100])
    # Only POSIX ustar has a prefix; old GNU headers keep atime/ctime in those bytes.
    if header[345] and header[257:263] == b"ustar\0":
        name = cut_nul(header[345:500]) + b"/" + name
    return name.decode("utf-8", "surrogateescape")


#: Records one PAX header may hold: writers set a dozen at most (path, size, times, ids,
#: extended attributes); a megabyte of 6-byte records took seconds to parse, each.
MAX_PAX_RECORDS = 4096


def parse_pax(data: bytes) -> dict[str, bytes]:
    """Parse PAX extended-header records (``"<length> <keyword>=<value>\\n"``).

    Args:
        data: The extended header's data (its declared size, without padding).

    Returns:
        Keyword -> raw value bytes; later records win.

    Raises:
        ValueError: A record is malformed (bad length, missing ``=`` or newline).
    """
    records: dict[str, bytes] = {}
    pos = 0
    end = len(data)
    count = 0
    while pos < end:
        count += 1
        if count > MAX_PAX_RECORDS:  # a writer sets a dozen; a hostile header, a million
            raise ValueError(f"PAX header with over {MAX_PAX_RECORDS} records")
        space = data.find(b" ", pos, pos + 21)
        length_text = data[pos:space] if space > pos else b""
        if not length_text.isdigit():
            if not data[pos:].strip(b"\0"):
                break  # NUL padding after the last record, as some writers leave
            raise ValueError(f"malformed PAX record at byte {pos}")
        stop = pos + int(length_text)
        if stop > end or stop <= space + 1 or data[stop - 1] != 0x0A:
            raise ValueError(f"PAX record at byte {pos} has a bad length")
        keyword, equals, value = data[space + 1 : stop - 1].partition(b"=")
        if not equals:
            raise ValueError(f"PAX record at byte {pos} has no '='")
        records[decode_name(keyword)] = value
        pos = stop
    return records


#: One PAX record of a time (what tarfile writes for a fractional mtime), its length in digits.
_TIME_RECORD = re.compile(rb"([1-9][0-9]{0,18}) [acm]time=[^\n]*\n")


def pax_times_only(data: bytes) -> bool:
    """Tell whether PAX data is one well-formed ``mtime``, ``atime`` or ``ctime`` record:
    :func:`parse_pax` accepts it, and the reader takes nothing from it. False means "parse
    it", not "malformed"."""
    match = _TIME_RECORD.fullmatch(data)
    return match is not None and int(match[1]) == len(data)
