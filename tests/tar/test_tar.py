"""Tests for cloudshards.tar: every header kind, gzip, end-of-archive variants, and properties
(round trip, truncation, corruption) over tars written by the stdlib tarfile module."""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import random
import re
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cloudshards.errors import ConfigError, ShardFormatError
from cloudshards.tar import blocks, decompress, headers, iter_members
from cloudshards.types import Member

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
PROPERTY = settings(
    deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# --- building archives ----------------------------------------------------------------------


def write_tar(
    members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT, *, float_mtime: bool = True
) -> bytes:
    """Write regular files with tarfile; a float mtime makes PAX add an 'x' header to each."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000.5 if float_mtime and fmt == tarfile.PAX_FORMAT else 7
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def header(
    name: bytes = b"x.bin",
    size: int = 0,
    typeflag: bytes = b"0",
    *,
    prefix: bytes = b"",
    magic: bytes = b"ustar\x0000",
    size_field: bytes | None = None,
    signed_checksum: bool = False,
    checksum_field: bytes | None = None,
) -> bytes:
    """Hand-build one 512-byte header (ustar layout) with a correct checksum unless told."""
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\0"
    block[108:116] = block[116:124] = b"0000000\0"
    block[124:136] = size_field if size_field is not None else b"%011o\0" % size
    block[136:148] = b"00000000007\0"
    block[156:157] = typeflag
    block[257:265] = magic
    block[345 : 345 + len(prefix)] = prefix
    block[148:156] = b" " * 8
    if signed_checksum:
        total = 256 + sum(
            b - 256 if b > 127 else b for i, b in enumerate(block) if not 148 <= i < 156
        )
    else:
        total = sum(block)
    block[148:156] = checksum_field if checksum_field is not None else b"%06o\0 " % total
    return bytes(block)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def pax_records(**records: str | int) -> bytes:
    out = b""
    for key, value in records.items():
        body = f" {key}={value}\n".encode()
        length = len(body) + len(str(len(body)))
        length = len(body) + len(str(length))
        out += str(length).encode() + body
    return out


def member(name: bytes, data: bytes, typeflag: bytes = b"0", **kw: Any) -> bytes:
    return header(name, len(data), typeflag, **kw) + pad(data)


END = bytes(1024)


# --- reading --------------------------------------------------------------------------------


class NonSeekable:
    """read() only: no seek, no readinto (like a gzip or socket stream)."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def read(self, size: int) -> bytes:
        return self._inner.read(size)


class ReadIntoOnly(NonSeekable):
    """read() and readinto(), not seekable (like a pipe)."""

    def readinto(self, view: memoryview) -> int:
        return self._inner.readinto(view)


class ShortReads(ReadIntoOnly):
    """Returns at most a few bytes per call, as sockets and HTTP bodies may."""

    def __init__(self, data: bytes, seed: int = 0) -> None:
        super().__init__(data)
        self._rng = random.Random(seed)

    def read(self, size: int) -> bytes:
        return self._inner.read(min(size, self._rng.randint(1, 700)))

    def readinto(self, view: memoryview) -> int:
        return self._inner.readinto(view[: self._rng.randint(1, 700)])


STREAMS = {
    "bytesio": io.BytesIO,
    "nonseekable": NonSeekable,
    "readinto": ReadIntoOnly,
    "short": ShortReads,
}


def read(data: bytes, stream: str = "bytesio", **kw: Any) -> list[tuple[str, bytes]]:
    return [(m.name, m.data) for m in iter_members(STREAMS[stream](data), **kw)]


def read_until_error(data: bytes, **kw: Any) -> tuple[list[Member], ShardFormatError | None]:
    got: list[Member] = []
    try:
        for item in iter_members(io.BytesIO(data), **kw):
            got.append(item)
    except ShardFormatError as exc:
        return got, exc
    return got, None


SAMPLE_MEMBERS = [
    ("a/b/x.seg.png", b"png" * 100),
    ("empty.txt", b""),
    ("block.bin", bytes(range(256)) * 2),
    ("two-blocks.bin", b"\x01" * 1024),
    ("odd.bin", b"\x02" * 1537),
    ("unicodé/名前.json", b'{"a": 1}'),
]


# --- formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("block_bytes", [512, 1000, 4 << 20])
@pytest.mark.parametrize("stream", STREAMS)
def test_round_trip_each_format(fmt: int, block_bytes: int, stream: str) -> None:
    long_name = "deep/" * 30 + "long.name.txt"  # 163 chars: ustar prefix, GNU 'L', PAX path
    members = [*SAMPLE_MEMBERS, (long_name, b"long")]
    assert read(write_tar(members, fmt), stream, block_bytes=block_bytes) == members


def test_ustar_prefix_joins_name() -> None:
    data = member(b"name.txt", b"hi", prefix=b"some/dir") + END
    assert read(data) == [("some/dir/name.txt", b"hi")]


def test_prefix_ignored_without_posix_magic() -> None:
    # Old GNU headers keep atime/ctime where ustar has the prefix.
    data = member(b"name.txt", b"hi", prefix=b"12345670123", magic=b"ustar  \0") + END
    assert read(data) == [("name.txt", b"hi")]


def test_v7_header_without_magic() -> None:
    data = member(b"old.txt", b"v7", b"\0", magic=bytes(8)) + END
    assert read(data) == [("old.txt", b"v7")]


def test_gnu_long_name_and_long_link() -> None:
    long_name = "n" * 300 + ".txt"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        link = tarfile.TarInfo("link")
        link.type = tarfile.SYMTYPE
        link.linkname = "t" * 300  # written as a 'K' record, then skipped with the symlink
        tar.addfile(link)
        info = tarfile.TarInfo(long_name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    raw = buffer.getvalue()
    assert b"././@LongLink" in raw
    assert read(raw) == [(long_name, b"abc")]


def test_gnu_long_name_hand_built() -> None:
    name = b"x" * 200 + b".bin"
    data = member(b"././@LongLink", name + b"\0", b"L") + member(b"short", b"data") + END
    assert read(data) == [(name.decode(), b"data")]


def test_pax_path_and_size_override_header_fields() -> None:
    payload = bytes(range(256)) * 4
    records = pax_records(path="pax/named.bin", size=len(payload), mtime="1.5")
    data = (
        member(b"././@PaxHeader", records, b"x")
        + header(b"truncated-name", 0)  # size field says 0: the PAX size wins
        + pad(payload)
        + member(b"plain.txt", b"after")  # overrides apply to one member only
        + END
    )
    assert read(data) == [("pax/named.bin", payload), ("plain.txt", b"after")]


def test_a_pax_header_of_a_million_records_is_refused_at_once() -> None:
    """A hostile header of tiny records (1 MiB of "6 a=b\n") took seconds of Python to parse,
    and a compressed shard can hold thousands; past MAX_PAX_RECORDS it is a ShardFormatError
    naming the header, and what a writer sets (a dozen records) reads as before."""
    many = b"6 a=b\n" * (headers.MAX_PAX_RECORDS + 1)
    data = member(b"././@PaxHeader", many, b"x") + member(b"k.txt", b"v") + END
    got, error = read_until_error(data)
    assert got == []
    assert error is not None
    assert f"over {headers.MAX_PAX_RECORDS} records" in str(error)
    fine = b"6 a=b\n" * headers.MAX_PAX_RECORDS
    assert read(member(b"././@PaxHeader", fine, b"x") + member(b"k.txt", b"v") + END) == [
        ("k.txt", b"v")
    ]


def test_pax_wins_over_gnu_long_name() -> None:
    data = (
        member(b"././@PaxHeader", pax_records(path="from-pax.txt"), b"x")
        + member(b"././@LongLink", b"from-gnu.txt\0", b"L")
        + member(b"short", b"1")
        + END
    )
    assert read(data) == [("from-pax.txt", b"1")]


def test_pax_header_before_every_member_as_webdataset_writes() -> None:
    raw = write_tar(SAMPLE_MEMBERS, tarfile.PAX_FORMAT, float_mtime=True)
    assert raw.count(b"././@PaxHeader") == len(SAMPLE_MEMBERS)
    assert read(raw) == SAMPLE_MEMBERS


class Views(ReadIntoOnly):
    """Hands on memoryviews of parts (read_view), as PartStream does."""

    def read_view(self, size: int) -> memoryview:
        return memoryview(self._inner.read(size))


# Three PAX records of the same length (28 bytes): their 'x' headers are byte-identical.
TIME_28 = b"28 mtime=1795818260.2016122\n"
PATH_28 = b"28 path=renamed/by-pax1.bin\n"
assert len(TIME_28) == len(PATH_28) == 28


@pytest.mark.parametrize("block_bytes", [512, 1536, 4 << 20])
@pytest.mark.parametrize("stream", [*STREAMS, "views"])
def test_identical_pax_headers_with_different_records(block_bytes: int, stream: str) -> None:
    # The reader skips the records of a PAX header identical to the last one only when they
    # hold nothing but a time: a path (or anything else) behind the same header still counts.
    data = (
        member(b"pax", TIME_28, b"x")
        + member(b"a.txt", b"a")
        + member(b"pax", TIME_28.replace(b"2016122", b"3016122"), b"x")
        + member(b"b.txt", b"b")
        + member(b"pax", PATH_28, b"x")
        + member(b"c.txt", b"c")
        + member(b"pax", TIME_28, b"x")
        + member(b"d.txt", b"d")
        + END
    )
    streams = {**STREAMS, "views": Views}
    got = [(m.name, m.data) for m in iter_members(streams[stream](data), block_bytes=block_bytes)]
    assert got == [("a.txt", b"a"), ("b.txt", b"b"), ("renamed/by-pax1.bin", b"c"), ("d.txt", b"d")]


@pytest.mark.parametrize(
    "records",
    [
        b"29 mtime=1795818260.2016122\n",  # 28 bytes that say 29
        b"28 mtime=1795818260.2016122\0",  # no newline
        b"28 mtime:1795818260.2016122\n",  # no '='
    ],
    ids=["bad-length", "no-newline", "no-equals"],
)
def test_corrupt_records_behind_an_identical_pax_header_raise(records: bytes) -> None:
    assert len(records) == 28
    data = (
        member(b"pax", TIME_28, b"x")
        + member(b"a.txt", b"a")
        + member(b"pax", records, b"x")
        + member(b"b.txt", b"b")
        + END
    )
    got, error = read_until_error(data)
    assert [m.name for m in got] == ["a.txt"]
    assert error is not None
    assert "PAX" in str(error)


def test_pax_global_header_parsed_and_ignored() -> None:
    buffer = io.BytesIO()
    with tarfile.open(
        fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "hi"}
    ) as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"a"))
    assert read(buffer.getvalue()) == [("a.txt", b"a")]
    # A global path or size must not rename or resize every later member.
    data = member(b"global", pax_records(path="g.txt", size=5), b"g") + member(b"a.txt", b"a")
    assert read(data + END) == [("a.txt", b"a")]


@pytest.mark.parametrize(
    "records",
    [b"5 a=1\n", b"abc\n", b"9 nokeyx\n", b"99 path=x\n", b"8 path=x"],
    ids=["short", "no-length", "no-equals", "too-long", "no-newline"],
)
def test_corrupt_pax_records_raise(records: bytes) -> None:
    data = member(b"pax", records, b"x") + member(b"a.txt", b"a") + END
    with pytest.raises(ShardFormatError, match="PAX"):
        read(data)


def test_pax_nul_padding_after_records_accepted() -> None:
    records = pax_records(path="p.txt") + bytes(20)
    assert read(member(b"pax", records, b"x") + member(b"a.txt", b"a") + END) == [("p.txt", b"a")]


def test_pax_sparse_raises() -> None:
    records = pax_records(**{"GNU.sparse.major": 1, "GNU.sparse.minor": 0})
    with pytest.raises(ShardFormatError, match="sparse"):
        read(member(b"pax", records, b"x") + member(b"a.txt", b"a") + END)


def test_huge_extended_header_raises() -> None:
    data = header(b"pax", 2 << 20, b"x") + END
    with pytest.raises(ShardFormatError, match="extended header"):
        read(data)


def test_pax_bad_size_raises() -> None:
    data = member(b"pax", pax_records(size="12a"), b"x") + member(b"a.txt", b"a") + END
    with pytest.raises(ShardFormatError, match="size"):
        read(data)


def test_base256_size() -> None:
    payload = b"z" * 1000
    field = b"\x80" + (1000).to_bytes(11, "big")
    data = header(b"big.bin", size_field=field) + pad(payload) + END
    assert read(data) == [("big.bin", payload)]


def test_base256_written_by_tarfile_gnu() -> None:
    # tarfile writes base-256 for values beyond octal range; uid is the cheap one to overflow.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("u.txt")
        info.uid = 8**8
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    assert read(buffer.getvalue()) == [("u.txt", b"ok")]


def test_negative_base256_size_raises() -> None:
    data = header(b"neg.bin", size_field=b"\xff" * 12) + END
    with pytest.raises(ShardFormatError, match="size"):
        read(data)


def test_non_octal_size_raises() -> None:
    data = header(b"bad.bin", size_field=b"0000000009z\0") + END
    with pytest.raises(ShardFormatError, match="size"):
        read(data)


# --- checksums ------------------------------------------------------------------------------


def test_bad_checksum_raises_with_url_and_offset() -> None:
    first = member(b"a.txt", b"a")
    bad = bytearray(member(b"b.txt", b"b"))
    bad[0] = ord("c")  # name changed, checksum not updated
    data = first + bytes(bad) + END
    url = "s3://user:secret@bucket/shard.tar?X-Amz-Signature=abc"
    got, exc = read_until_error(data, url=url)
    assert [m.name for m in got] == ["a.txt"]
    assert exc is not None
    assert exc.offset == len(first)
    assert "checksum" in str(exc)
    assert exc.url is not None
    assert "secret" not in exc.url
    assert "abc" not in exc.url
    assert "bucket/shard.tar" in str(exc)


def test_signed_checksum_accepted() -> None:
    name = "é-signed.txt".encode()  # bytes >= 128 make signed and unsigned sums differ
    data = header(name, 2, signed_checksum=True) + pad(b"ok") + END
    assert read(data) == [("é-signed.txt", b"ok")]


def test_checksum_field_variants() -> None:
    block = header(b"a.txt", 1)
    value = int(block[148:154], 8)
    for field in (b"%07o\0" % value, b"%06o \0" % value, b" %06o\0" % value):
        variant = block[:148] + field.ljust(8, b"\0") + block[156:]
        assert read(variant + pad(b"a") + END) == [("a.txt", b"a")]


def test_non_numeric_checksum_raises() -> None:
    data = header(b"a.txt", 1, checksum_field=b"xyz\0\0\0\0\0") + pad(b"a") + END
    with pytest.raises(ShardFormatError, match="checksum"):
        read(data)


# --- member types ---------------------------------------------------------------------------


def test_non_files_skipped_with_their_data() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, kind in [
            ("dir", tarfile.DIRTYPE),
            ("sym", tarfile.SYMTYPE),
            ("hard", tarfile.LNKTYPE),
            ("fifo", tarfile.FIFOTYPE),
            ("chr", tarfile.CHRTYPE),
            ("blk", tarfile.BLKTYPE),
        ]:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = "target" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            tar.addfile(info)
            info = tarfile.TarInfo(name + ".after")
            info.size = 700
            tar.addfile(info, io.BytesIO(b"d" * 700))
    names = [name for name, _ in read(buffer.getvalue(), block_bytes=512)]
    assert names == ["dir.after", "sym.after", "hard.after", "fifo.after", "chr.after", "blk.after"]


def test_directory_with_nonzero_size_has_no_data() -> None:
    # POSIX: no data blocks follow types 1-6 whatever the size field says (tarfile agrees).
    data = header(b"dir/", 4096, b"5") + member(b"a.txt", b"a") + END
    assert read(data) == [("a.txt", b"a")]


def test_v7_directory_is_old_regular_type_with_slash() -> None:
    data = header(b"olddir/", 0, b"\0", magic=bytes(8)) + member(b"a.txt", b"a") + END
    assert read(data) == [("a.txt", b"a")]


@pytest.mark.parametrize("block_bytes", [512, 1 << 20])
def test_unknown_type_data_skipped(block_bytes: int) -> None:
    data = member(b"dumpdir", b"D" * 1500, b"D") + member(b"a.txt", b"a") + END
    assert read(data, block_bytes=block_bytes) == [("a.txt", b"a")]


def test_contiguous_type_is_a_file() -> None:
    data = member(b"c.bin", b"contig", b"7") + END
    assert read(data) == [("c.bin", b"contig")]


def test_gnu_sparse_raises() -> None:
    data = member(b"sparse", b"s", b"S") + END
    with pytest.raises(ShardFormatError, match="sparse"):
        read(data)


# --- end of archive and truncation ----------------------------------------------------------


def test_end_of_archive_variants(caplog: pytest.LogCaptureFixture) -> None:
    body = member(b"a.txt", b"a") + member(b"b.txt", b"b")
    expected = [("a.txt", b"a"), ("b.txt", b"b")]
    assert read(body + END) == expected
    assert read(body + END + b"trailing garbage after the end is never read") == expected
    assert read(body + bytes(512)) == expected  # one zero block, then EOF
    assert read(body + bytes(600)) == expected  # second zero block cut short
    assert read(END) == []
    assert not caplog.records


@pytest.mark.parametrize(
    ("data", "names"),
    [(b"", []), (member(b"a.txt", b"a") + member(b"b.txt", b"b"), ["a.txt", "b.txt"])],
)
def test_eof_without_end_marker_is_truncation(data: bytes, names: list[str]) -> None:
    # GNU tar accepts this; we do not: a shard cut on a member boundary would silently lose
    # the rest of its samples. Every member before the cut is still delivered.
    got, exc = read_until_error(data, url="s3://b/s.tar?sig=secret")
    assert [m.name for m in got] == names
    assert isinstance(exc, ShardFormatError)
    assert "end-of-archive marker" in str(exc)
    assert exc.offset == len(data)
    assert "s3://b/s.tar" in str(exc)
    assert "secret" not in str(exc)


@pytest.mark.parametrize(
    ("cut", "message"),
    [(100, "inside a header"), (512 + 1, "member data"), (1024 - 1, "member data")],
)
def test_truncation_raises(cut: int, message: str) -> None:
    data = member(b"a.txt", b"a" * 600)
    with pytest.raises(ShardFormatError, match=message) as info:
        read(data[:cut])
    assert info.value.offset is not None


def test_truncated_member_is_never_yielded_partially() -> None:
    data = member(b"a.txt", b"a") + member(b"big.bin", b"x" * 5000)
    got, exc = read_until_error(data[:-1000], block_bytes=512)
    assert [m.name for m in got] == ["a.txt"]
    assert exc is not None
    assert exc.member == "big.bin"


def test_eof_after_extended_header_raises() -> None:
    data = member(b"a.txt", b"a") + member(b"pax", pax_records(path="p.txt"), b"x")
    with pytest.raises(ShardFormatError, match="extended header"):
        read(data)
    with pytest.raises(ShardFormatError, match="extended header"):
        read(data + END)


def test_zero_block_followed_by_data_raises() -> None:
    data = member(b"a.txt", b"a") + bytes(512) + member(b"b.txt", b"b") + END
    got, exc = read_until_error(data)
    assert [m.name for m in got] == ["a.txt"]
    assert exc is not None
    assert exc.offset == 1024


@pytest.mark.parametrize("stream", STREAMS)
def test_skip_detects_truncation(stream: str) -> None:
    # A filtered-out member is skipped by seeking when possible; seeking past EOF succeeds
    # silently, so the reader must still notice the stream ends inside it.
    data = member(b"a.txt", b"a") + member(b"big.bin", b"x" * 100_000) + END
    with pytest.raises(ShardFormatError, match="member data") as info:
        read(
            data[:50_000],
            stream,
            name_filter=lambda n: None if n == "big.bin" else n,
            block_bytes=512,
        )
    assert info.value.member == "big.bin"


class SeekFails(io.BytesIO):
    def seek(self, offset: int, whence: int = 0) -> int:
        raise io.UnsupportedOperation("no seeking on this stream")


class SeekableFails(NonSeekable):
    def seekable(self) -> bool:
        raise OSError("closed")


@pytest.mark.parametrize("stream_class", [SeekFails, SeekableFails])
def test_seek_failures_fall_back_to_reading(stream_class: type[Any]) -> None:
    members = [("a.txt", b"a"), ("big.bin", b"x" * 100_000), ("big2.bin", b"y" * 70_000)]
    raw = write_tar(members)
    got = iter_members(stream_class(raw), block_bytes=512)
    assert [(m.name, m.data) for m in got] == members
    skipping = iter_members(
        stream_class(raw), block_bytes=512, name_filter=lambda n: None if "big" in n else n
    )
    assert [(m.name, m.data) for m in skipping] == members[:1]


# --- gzip -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_bytes", [512, 4 << 20])
def test_gzip(block_bytes: int) -> None:
    raw = write_tar(SAMPLE_MEMBERS)
    assert read(gzip.compress(raw), block_bytes=block_bytes) == SAMPLE_MEMBERS
    # Multi-member gzip (cat a.gz b.gz), with zero padding after it as some tools leave.
    parts = gzip.compress(raw[:3000]) + gzip.compress(raw[3000:]) + bytes(2000)
    assert read(parts, "nonseekable", block_bytes=block_bytes) == SAMPLE_MEMBERS


def test_gzip_offsets_are_uncompressed() -> None:
    raw = write_tar(SAMPLE_MEMBERS)
    for item in iter_members(io.BytesIO(gzip.compress(raw)), block_bytes=512):
        assert raw[item.offset : item.offset + len(item.data)] == item.data


def test_gzip_corrupt_raises() -> None:
    compressed = bytearray(gzip.compress(write_tar(SAMPLE_MEMBERS), 1))
    compressed[40] ^= 0xFF
    compressed[41] ^= 0xFF
    with pytest.raises(ShardFormatError) as info:
        read(bytes(compressed))
    assert info.value.offset is not None


@pytest.mark.parametrize("cut", [5, 30, -4, -20])
def test_gzip_truncated_raises(cut: int) -> None:
    compressed = gzip.compress(write_tar(SAMPLE_MEMBERS))
    with pytest.raises(ShardFormatError, match="gzip"):
        read(compressed[:cut])


def test_gzip_bad_crc_raises() -> None:
    compressed = bytearray(gzip.compress(write_tar(SAMPLE_MEMBERS)))
    compressed[-6] ^= 0x01  # CRC32 in the trailer: checked after the tar's end marker
    with pytest.raises(ShardFormatError, match="gzip"):
        read(bytes(compressed))


def test_gzip_trailing_garbage_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """After the archive's verified gzip stream, bytes that start no stream are ignored, as
    gzip(1) does; every member is read (the last sample used to be lost with an error)."""
    compressed = gzip.compress(write_tar(SAMPLE_MEMBERS)) + b"garbage"
    with caplog.at_level("WARNING", logger="cloudshards"):
        assert read(compressed) == SAMPLE_MEMBERS
    assert "is not gzip data: ignored" in caplog.text


def test_plain_tar_never_touches_zlib(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("zlib used on an uncompressed tar")

    monkeypatch.setattr(zlib, "decompressobj", boom)
    assert read(write_tar(SAMPLE_MEMBERS)) == SAMPLE_MEMBERS


# --- limits, filters, offsets, arguments ----------------------------------------------------


def test_max_member_bytes() -> None:
    data = member(b"a.txt", b"a") + member(b"big.bin", b"x" * 2000) + END
    got, exc = read_until_error(data, max_member_bytes=1000)
    assert [m.name for m in got] == ["a.txt"]
    assert exc is not None
    assert exc.member == "big.bin"
    assert "max_member_bytes" in str(exc)
    # Skipped members are never read into memory, so the limit does not apply to them.
    keep_small = read(
        data, max_member_bytes=1000, name_filter=lambda n: n if n == "a.txt" else None
    )
    assert keep_small == [("a.txt", b"a")]


def test_max_member_bytes_checked_before_allocating() -> None:
    field = b"\x80" + (1 << 80).to_bytes(11, "big")
    data = header(b"huge.bin", size_field=field) + END
    with pytest.raises(ShardFormatError, match="max_member_bytes"):
        read(data)


def test_name_filter_renames_and_skips() -> None:
    members = [(f"k{i}.{ext}", bytes([i]) * (i * 300)) for i in range(8) for ext in ("jpg", "cls")]
    raw = write_tar(members)

    def only_cls(name: str) -> str | None:
        return "renamed/" + name if name.endswith(".cls") else None

    expected = [("renamed/" + n, d) for n, d in members if n.endswith(".cls")]
    for stream in STREAMS:
        for block_bytes in (512, 1000, 1 << 20):
            assert read(raw, stream, name_filter=only_cls, block_bytes=block_bytes) == expected


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("block_bytes", [512, 1000, 64 << 10])
def test_large_members_every_read_path(stream: str, block_bytes: int) -> None:
    rng = random.Random(1)
    members = [(f"m{i}.bin", rng.randbytes(size)) for i, size in enumerate([300_000, 5, 70_001])]
    assert read(write_tar(members), stream, block_bytes=block_bytes) == members


@pytest.mark.parametrize("opener", ["open", "raw", "fsspec"])
def test_real_files(tmp_path: Path, opener: str) -> None:
    rng = random.Random(2)
    members = [(f"f{i}.bin", rng.randbytes(size)) for i, size in enumerate([10, 200_000, 3000])]
    path = tmp_path / "shard.tar"
    path.write_bytes(write_tar(members))
    for block_bytes in (512, 1 << 20):
        for name_filter in (None, lambda n: None if n == "f1.bin" else n):
            if opener == "fsspec":
                stream = fsspec.open(str(path), "rb").open()
            else:
                stream = open(path, "rb", buffering=0 if opener == "raw" else -1)  # noqa: SIM115
            with stream:
                got = [
                    (m.name, m.data)
                    for m in iter_members(stream, block_bytes=block_bytes, name_filter=name_filter)
                ]
            assert got == [m for m in members if name_filter is None or name_filter(m[0])]


def test_offsets_point_at_member_data() -> None:
    raw = write_tar(SAMPLE_MEMBERS)
    for block_bytes in (512, 1000, 1 << 20):
        for item in iter_members(io.BytesIO(raw), block_bytes=block_bytes):
            assert raw[item.offset : item.offset + len(item.data)] == item.data
            assert item.offset % 512 == 0


def test_stream_not_at_start() -> None:
    raw = write_tar(SAMPLE_MEMBERS)
    stream = io.BytesIO(b"prefix" + raw)
    stream.seek(6)
    assert [(m.name, m.data) for m in iter_members(stream, block_bytes=512)] == SAMPLE_MEMBERS


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        iter_members(io.BytesIO(), block_bytes=0)
    with pytest.raises(ConfigError):
        iter_members(io.BytesIO(), max_member_bytes=-1)


def test_iterating_lazily() -> None:
    class Exploding:
        def read(self, size: int) -> bytes:
            raise AssertionError("read before iteration")

    members = iter_members(Exploding())
    assert isinstance(members, Iterator)


# --- properties -----------------------------------------------------------------------------

_name_chars = st.characters(
    blacklist_categories=["Cs"], blacklist_characters="\0/", min_codepoint=1, max_codepoint=0x2FFF
)
_component = st.text(_name_chars, min_size=1, max_size=40)
_long_names = st.lists(_component, min_size=1, max_size=8).map("/".join)
_sizes = st.one_of(st.sampled_from([0, 1, 511, 512, 513, 1024, 4096]), st.integers(0, 6000))


def _members(names: st.SearchStrategy[str]) -> st.SearchStrategy[list[tuple[str, bytes]]]:
    return st.lists(st.tuples(names, _sizes, st.integers(0, 2**32)), max_size=12).map(
        lambda items: [(name, random.Random(seed).randbytes(size)) for name, size, seed in items]
    )


def _ustar_ok(members: list[tuple[str, bytes]]) -> bool:
    return all(len(name.encode()) <= 100 for name, _ in members)


@PROPERTY
@given(
    members=_members(_long_names),
    fmt=st.sampled_from(sorted(FORMATS)),
    compress=st.sampled_from(["none", "gzip", "gzip-multi"]),
    block_bytes=st.sampled_from([512, 1000, 3000, 1 << 20]),
    stream=st.sampled_from(sorted(STREAMS)),
)
def test_property_round_trip(
    members: list[tuple[str, bytes]], fmt: str, compress: str, block_bytes: int, stream: str
) -> None:
    if fmt == "ustar":
        assume(_ustar_ok(members))
    raw = write_tar(members, FORMATS[fmt])
    if compress == "gzip":
        raw = gzip.compress(raw, 1)
    elif compress == "gzip-multi":
        raw = gzip.compress(raw[: len(raw) // 3], 1) + gzip.compress(raw[len(raw) // 3 :], 1)
    assert read(raw, stream, block_bytes=block_bytes) == members


@PROPERTY
@given(
    members=_members(_long_names),
    compress=st.booleans(),
    block_bytes=st.sampled_from([512, 1000, 1 << 20]),
    data=st.data(),
)
def test_property_truncation(
    members: list[tuple[str, bytes]], compress: bool, block_bytes: int, data: st.DataObject
) -> None:
    raw = write_tar(members, tarfile.PAX_FORMAT)
    if compress:
        raw = gzip.compress(raw, 1)
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    got, exc = read_until_error(raw[:cut], block_bytes=block_bytes)
    assert [(m.name, m.data) for m in got] == members[: len(got)]
    if compress and cut > 0:
        assert exc is not None  # the gzip trailer is always checked
    if not compress:
        # Every member whose data and padding end before the cut is delivered, and a cut
        # before the first end-of-archive block is complete is a truncation error.
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            ends = [m.offset_data + m.size + (-m.size & 511) for m in tar.getmembers()]
        assert len(got) >= sum(1 for end in ends if end <= cut)
        end_of_archive = ends[-1] if ends else 0
        if cut < end_of_archive + 512:
            assert isinstance(exc, ShardFormatError)


def _header_offsets(raw: bytes) -> list[int]:
    """Offsets of every header block (and both end-of-archive blocks) of an uncompressed tar."""
    offsets = []
    pos = 0
    while pos < len(raw):
        offsets.append(pos)
        block = raw[pos : pos + 512]
        if block == bytes(512):
            return [*offsets, pos + 512]
        size = int(block[124:136].rstrip(b"\0 ") or b"0", 8)
        pos += 512 + size + (-size % 512)
    return offsets


@PROPERTY
@given(
    members=_members(_long_names),
    fmt=st.sampled_from(["gnu", "pax"]),
    block_bytes=st.sampled_from([512, 1000, 1 << 20]),
    data=st.data(),
)
def test_property_header_corruption(
    members: list[tuple[str, bytes]], fmt: str, block_bytes: int, data: st.DataObject
) -> None:
    raw = bytearray(write_tar(members, FORMATS[fmt]))
    block = data.draw(st.sampled_from(_header_offsets(bytes(raw))), label="header")
    index = block + data.draw(st.integers(0, 511), label="byte")
    raw[index] ^= data.draw(st.integers(1, 255), label="xor")
    got, exc = read_until_error(bytes(raw), block_bytes=block_bytes)
    assert [(m.name, m.data) for m in got] == members[: len(got)]
    if exc is None:
        assert len(got) == len(members)


@settings(deadline=None, max_examples=40)
@given(st.binary(max_size=3000), st.sampled_from([512, 1000]))
def test_property_garbage_never_hangs(garbage: bytes, block_bytes: int) -> None:
    for prefix in (b"", b"\x1f\x8b"):
        with contextlib.suppress(ShardFormatError):
            list(iter_members(io.BytesIO(prefix + garbage), block_bytes=block_bytes))


def test_gzip_bomb_output_is_bounded() -> None:
    # 16 MiB of zeros compresses to ~16 KiB; the reader must not inflate it in one call.
    stream = gzip.compress(bytes(16 << 20), 9)
    assert len(stream) < 100_000
    reader = decompress.DecompressReader(io.BytesIO(stream[2:]), stream[:2], None, 1 << 16)
    assert len(reader.read(1 << 30)) <= 1 << 16


# --- gaps found by the mutation check (integration/mutation.py) ------------------------------


def test_smallest_limits_are_accepted() -> None:
    assert read(write_tar(SAMPLE_MEMBERS), block_bytes=1) == SAMPLE_MEMBERS
    data = member(b"empty.bin", b"") + member(b"one.bin", b"1") + END
    got, exc = read_until_error(data, max_member_bytes=0)
    assert [m.name for m in got] == ["empty.bin"]
    assert exc is not None
    assert exc.member == "one.bin"
    exact = member(b"a.bin", b"a" * 1000) + END
    assert read(exact, max_member_bytes=1000) == [("a.bin", b"a" * 1000)]  # the limit itself


def pax_of_size(total: int, **records: str) -> bytes:
    """PAX records of exactly ``total`` bytes: ``records`` and a comment to fill up."""
    fixed = pax_records(**records)
    filler = total - len(fixed) - len(pax_records(comment=""))
    while len(pax_records(comment="c" * filler)) + len(fixed) > total:
        filler -= 1
    data = fixed + pax_records(comment="c" * filler)
    assert len(data) == total
    return data


def test_extended_header_size_limit_is_one_mib() -> None:
    limit = 1 << 20
    data = member(b"pax", pax_of_size(limit, path="p.bin"), b"x") + member(b"a.bin", b"A") + END
    assert read(data) == [("p.bin", b"A")]
    for block_bytes in (512, 4 << 20):  # whether the header is in the buffer or not
        data = header(b"pax", limit + 1, b"x") + pad(bytes(limit + 1)) + END
        with pytest.raises(ShardFormatError, match="implausibly large"):
            read(data, block_bytes=block_bytes)


def test_extended_header_at_the_start_then_the_end_raises() -> None:
    data = member(b"pax", pax_records(path="p.bin"), b"x") + END
    with pytest.raises(ShardFormatError, match="extended header not followed by a member") as info:
        read(data)
    assert info.value.offset == 0


@pytest.mark.parametrize("name", [b"olddir/", b"d" * 99 + b"/"], ids=["short", "100 bytes"])
def test_v7_directory_with_a_size_has_no_data(name: bytes) -> None:
    # Type "\0" and a trailing slash: a directory (tarfile agrees), so no data follows.
    data = header(name, 1024, b"\0") + member(b"a.txt", b"a") + END
    assert read(data) == [("a.txt", b"a")]


JUNK_SIZE = b"zzzzzzzzzzz\0"


@pytest.mark.parametrize(
    ("entry", "named", "described"),
    [
        (header(b"a.bin", typeflag=b"\0", size_field=JUNK_SIZE), "a.bin", None),
        (header(b"weird/", typeflag=b"0", size_field=JUNK_SIZE), "weird/", None),
        (header(b"d" * 99 + b"/", typeflag=b"\0", size_field=JUNK_SIZE), None, "not a file"),
        (header(b"olddir/", typeflag=b"\0", size_field=JUNK_SIZE), None, "'olddir/'"),
        (header(b"dir", typeflag=b"5", size_field=JUNK_SIZE), None, "of type '5'"),
        (header(b"pax", typeflag=b"x", size_field=JUNK_SIZE), None, "(in an extended header)"),
        (
            member(b"pax", pax_records(path="p.bin"), b"x") + header(size_field=JUNK_SIZE),
            "p.bin",
            None,
        ),
    ],
    ids=["old regular", "regular", "v7 dir 100", "v7 dir", "dir", "pax", "pax path"],
)
def test_bad_size_field_names_the_file_or_describes_the_entry(
    entry: bytes, named: str | None, described: str | None
) -> None:
    got, exc = read_until_error(member(b"first.txt", b"1") + entry + END)
    assert [m.name for m in got] == ["first.txt"]
    assert exc is not None
    assert "bad size field" in str(exc)
    assert exc.member == named
    if described is not None:
        assert described in str(exc)


@pytest.mark.parametrize(
    ("digits", "magnitude"),
    [("1" + "0" * 3999, "at least 2**13284"), ("1" + "0" * 4000, "at least 2**13287")],
    ids=["4000 digits", "4001 digits"],
)
def test_pax_sizes_with_thousands_of_digits_are_refused_with_their_magnitude(
    digits: str, magnitude: str
) -> None:
    data = member(b"pax", pax_records(size=digits), b"x") + header(b"x.dat") + END
    got, exc = read_until_error(data)
    assert got == []
    assert exc is not None
    assert exc.member == "x.dat"
    assert magnitude in str(exc)


def test_parse_number_decodes_every_encoding() -> None:
    from cloudshards.tar.headers import parse_number

    assert parse_number(b"00000001750\0") == 1000
    assert parse_number(b"0000012\0junk") == 10  # octal up to the first NUL, as tarfile reads
    assert parse_number(b"        \0   ") == 0  # blank
    assert parse_number(b"\x80" + (1000).to_bytes(11, "big")) == 1000
    assert parse_number(b"\xff" * 12) == -1  # base-256 two's complement
    assert parse_number(b"\xff" + bytes(11)) == -(1 << 88)
    assert parse_number(b"\xff" * 8) == -1  # an 8-byte field (uid, gid, checksum)
    assert parse_number(b"\xfe" + bytes(11)) is None
    assert parse_number(b"12389\0      ") is None  # not octal


def test_size_field_with_junk_after_its_nul() -> None:
    data = header(b"a.bin", size_field=b"0000012\0abc\0") + pad(b"0123456789") + END
    assert read(data) == [("a.bin", b"0123456789")]


def with_checksum(block: bytearray, fmt: bytes = b"%06o\0 ") -> bytes:
    """``block`` with its checksum field written in ``fmt`` (8 bytes, NUL-padded)."""
    block[148:156] = b" " * 8
    block[148:156] = (fmt % sum(block)).ljust(8, b"\0")
    return bytes(block)


@pytest.mark.parametrize("fmt", [b"%06o\0 ", b"%08o"], ids=["6 digits", "8 digits"])
def test_checksum_sums_every_byte_but_its_own_field(fmt: bytes) -> None:
    block = bytearray(header(b"a.txt", 1, magic=bytes(8)))  # v7: bytes 345-511 are free
    block[147] = ord(" ")  # the mtime field ended by a space, as old GNU tar writes it
    block[157:257] = b"\xfa" * 100  # a link name, ignored for a file (the signed sum differs)
    block[345:512] = b"y" * 167  # old GNU atime/ctime and padding: no name part without ustar
    assert sum(block) > 0o100000  # six significant digits: none of them may be dropped
    data = with_checksum(block, fmt) + pad(b"a") + END
    assert read(data) == [("a.txt", b"a")]


@PROPERTY
@given(
    st.binary(min_size=512, max_size=512),
    st.booleans(),
    st.sampled_from([0, 1, -1, 65521, -65521, 131042]),
)
def test_checksum_check_agrees_with_tarfile(raw: bytes, ascii_only: bool, off_by: int) -> None:
    block = bytearray(bytes(b & 0x7F for b in raw) if ascii_only else raw)
    block[148:156] = b" " * 8
    unsigned, signed = tarfile.calc_chksums(bytes(block))  # type: ignore[attr-defined]
    stored = unsigned + off_by
    assume(stored >= 0)
    block[148:156] = (b"%06o\0 " % stored) if stored < 8**6 else (b"%07o\0" % stored)
    expected = stored in (unsigned, signed)  # what tarfile accepts
    assert headers.checksum_ok(bytes(block)) is expected


def test_names_use_every_byte_of_their_fields() -> None:
    long = b"n" * 96 + b".txt"  # 100 bytes: no NUL ends it
    assert read(member(long, b"1") + END) == [(long.decode(), b"1")]
    assert read(member(b"name.txt", b"2", prefix=b"p") + END) == [("p/name.txt", b"2")]
    block = bytearray(header(b"name.txt", 1, prefix=b"q" * 155))  # a prefix without NUL
    block[500] = ord("X")  # ustar padding after the prefix: not part of the name
    data = with_checksum(block) + pad(b"3") + END
    assert read(data) == [("q" * 155 + "/name.txt", b"3")]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (b"abc\n", "malformed PAX record at byte 0"),
        (b"3 \n", "PAX record at byte 0 has no '='"),
        (b"000000000000000000035 path=abcdefg\n", "malformed PAX record at byte 0"),
    ],
    ids=["no length", "no keyword", "21-digit length"],
)
def test_pax_record_errors(records: bytes, message: str) -> None:
    data = member(b"pax", records, b"x") + member(b"a.txt", b"a") + END
    with pytest.raises(ShardFormatError, match=message):
        read(data)


def test_pax_record_length_may_have_twenty_digits() -> None:
    records = b"00000000000000000034 path=abcdefg\n"
    assert len(records) == 34
    assert read(member(b"pax", records, b"x") + member(b"a.txt", b"a") + END) == [("abcdefg", b"a")]


def test_describe_size_is_exact_below_two_to_the_64() -> None:
    assert blocks.describe_size((1 << 64) - 1) == str((1 << 64) - 1)
    assert blocks.describe_size(1 << 64) == "at least 2**64"


def test_gzip_error_offsets_count_decompressed_bytes() -> None:
    compressed = gzip.compress(write_tar(SAMPLE_MEMBERS))
    with pytest.raises(ShardFormatError, match="near compressed byte 5") as info:
        read(compressed[:5], "nonseekable", block_bytes=512)
    assert info.value.offset == 0  # nothing decompressed yet


def test_gzip_with_matches_far_back_in_its_window() -> None:
    # Repeats 20 000 bytes apart: the decoder needs gzip's whole 32 KiB window.
    chunk = random.Random(5).randbytes(20_000)
    members = [("far.bin", chunk + chunk)]
    assert read(gzip.compress(write_tar(members))) == members


def test_gzip_members_with_zero_padding_between_them() -> None:
    raw = write_tar(SAMPLE_MEMBERS)
    parts = gzip.compress(raw[:3000]) + bytes(100) + gzip.compress(raw[3000:])
    for block_bytes in (512, 4 << 20):
        assert read(parts, block_bytes=block_bytes) == SAMPLE_MEMBERS


def test_gzip_cut_in_its_trailer_is_reported_at_the_end_of_the_data() -> None:
    raw = write_tar(SAMPLE_MEMBERS)
    cut = gzip.compress(raw)[:-4]
    for block_bytes in (512, 4 << 20):  # the compressed bytes read in one go, or in many
        got, exc = read_until_error(cut, block_bytes=block_bytes)
        assert [(m.name, m.data) for m in got] == SAMPLE_MEMBERS
        assert exc is not None
        assert (
            f"truncated gzip stream (ends before the gzip trailer) near compressed byte {len(cut)}"
            in str(exc)
        )
        assert exc.offset == len(raw)


class OneByteReads(NonSeekable):
    """A stream that hands out one byte per read (a slow socket)."""

    def read(self, size: int) -> bytes:
        return self._inner.read(min(size, 1))


def test_gzip_is_detected_whatever_the_first_read_returns() -> None:
    compressed = gzip.compress(write_tar(SAMPLE_MEMBERS))
    got = [(m.name, m.data) for m in iter_members(OneByteReads(compressed), block_bytes=512)]
    assert got == SAMPLE_MEMBERS


def _first_failing_byte(stream: bytes) -> int:
    """The byte of a gzip stream that zlib, fed one byte at a time, fails at."""
    decoder = zlib.decompressobj(31)
    for at in range(len(stream)):
        try:
            decoder.decompress(stream[at : at + 1])
        except zlib.error:
            return at
    raise AssertionError("no failure")


@pytest.mark.parametrize("where", ["first stream", "second stream"])
def test_corrupt_gzip_is_reported_at_the_byte_zlib_fails_at(where: str) -> None:
    # Two gzip streams of text (cat a.gz b.gz); the damage breaks one's Huffman tables, which
    # zlib notices a few bytes on. In the second it lies 28 KB into the data, so the start of
    # a read (byte 0 when it all came in one) would be no help.
    members = [
        (f"{i:02d}.txt", bytes(random.Random(i).choices(b"abcdefgh ", k=6000))) for i in range(20)
    ]
    raw = write_tar(members)
    first, second = gzip.compress(raw[:61440], 1), bytearray(gzip.compress(raw[61440:], 1))
    data = bytearray(first) + second
    damaged = 40 if where == "first stream" else len(first) + 40
    data[damaged : damaged + 8] = b"\xff" * 8
    if where == "first stream":
        expected = _first_failing_byte(bytes(data))
    else:
        second[40:48] = b"\xff" * 8
        expected = len(first) + _first_failing_byte(bytes(second))
    assert damaged < expected < damaged + 64
    for block_bytes in (512, 4 << 20):
        with pytest.raises(ShardFormatError, match=r"near compressed byte (\d+)") as info:
            read(bytes(data), "nonseekable", block_bytes=block_bytes)
        near = re.search(r"near compressed byte (\d+)", str(info.value))
        assert near is not None
        assert int(near.group(1)) == expected


@pytest.mark.parametrize("stream", ["bytesio", "nonseekable"])
def test_truncated_member_error_is_at_its_data(stream: str) -> None:
    data = member(b"a.txt", b"a") + member(b"big.bin", b"x" * 5000)
    with pytest.raises(ShardFormatError, match="member data") as info:
        read(data[:-1000], stream, block_bytes=512)
    assert (info.value.member, info.value.offset) == ("big.bin", 1536)  # after its header


@pytest.mark.parametrize("block_bytes", [512, 4 << 20])
def test_a_bad_gzip_checksum_at_the_end_loses_no_member_before_it(block_bytes: int) -> None:
    """Every member decodes, only the trailer's CRC is wrong: zlib raises for the call that
    reaches the trailer and drops that call's whole output (up to a block of good members,
    once 42 of 300 samples); the members are all handed on before the error."""
    rng = random.Random(5)
    names = [f"s{i:04d}.bin".encode() for i in range(300)]
    raw = b"".join(member(name, rng.randbytes(3000)) for name in names) + END
    compressed = bytearray(gzip.compress(raw, mtime=0))
    compressed[-8] ^= 0xFF  # the CRC-32 of the uncompressed data
    got, exc = read_until_error(bytes(compressed), block_bytes=block_bytes)
    assert [m.name for m in got] == [name.decode() for name in names]
    assert exc is not None
    assert "corrupt gzip stream" in str(exc)


def test_gzip_cut_inside_an_extended_header_says_so() -> None:
    records = pax_records(path="p.bin", comment=random.Random(1).randbytes(30_000).hex())
    raw = member(b"a.txt", b"a") + member(b"pax", records, b"x") + member(b"b.txt", b"b") + END
    compressed = gzip.compress(raw)
    with pytest.raises(ShardFormatError, match=r"\(in an extended header\)") as info:
        read(compressed[: len(compressed) // 2], "nonseekable", block_bytes=512)
    assert info.value.member is None


def test_gzip_cut_inside_a_member_is_reported_where_the_data_stops() -> None:
    payload = random.Random(2).randbytes(200_000)
    compressed = gzip.compress(member(b"a.txt", b"a") + member(b"big.bin", payload) + END)
    cut = compressed[: len(compressed) // 2]
    available = len(zlib.decompressobj(wbits=31).decompress(cut))
    for block_bytes in (512, 4 << 20):
        got, exc = read_until_error(cut, block_bytes=block_bytes)
        assert [m.name for m in got] == ["a.txt"]
        assert exc is not None
        assert exc.member == "big.bin"
        assert exc.offset == available


def names_until_error(stream: Any, **kw: Any) -> tuple[list[str], ShardFormatError | None]:
    got: list[str] = []
    try:
        for item in iter_members(stream, **kw):
            got.append(item.name)
    except ShardFormatError as exc:
        return got, exc
    return got, None


def test_member_cut_on_a_block_boundary_is_never_yielded() -> None:
    data = member(b"a.txt", b"a") + member(b"b.bin", b"b" * 1024)  # no padding to hide the cut
    for stream in ("bytesio", "nonseekable"):
        got, exc = names_until_error(STREAMS[stream](data[:-100]), block_bytes=4096)
        assert got == ["a.txt"]
        assert exc is not None
        assert exc.member == "b.bin"


def test_large_member_with_one_byte_of_it_buffered() -> None:
    payload = random.Random(3).randbytes(2000)
    data = member(b"big.bin", payload) + END
    assert read(data, block_bytes=513) == [("big.bin", payload)]  # 1 byte after the header


class ForwardSeekFails(io.BytesIO):
    """Seeks back, not forward (a stream that only rewinds what it buffered)."""

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1 and offset > 0:
            raise OSError("cannot seek forward")
        return super().seek(offset, whence)


class BackwardSeekFails(io.BytesIO):
    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1 and offset < 0:
            raise OSError("cannot seek back")
        return super().seek(offset, whence)


def test_large_members_read_in_chunks_when_seeking_ahead_fails() -> None:
    payload = random.Random(4).randbytes(1025)  # two blocks and one byte
    data = member(b"big.bin", payload) + member(b"a.txt", b"a") + END
    got = iter_members(ForwardSeekFails(data), block_bytes=512)
    assert [(m.name, m.data) for m in got] == [("big.bin", payload), ("a.txt", b"a")]
    with pytest.raises(ShardFormatError, match="member data") as info:
        list(iter_members(ForwardSeekFails(data[:1000]), block_bytes=512))
    assert info.value.member == "big.bin"


def test_a_stream_that_cannot_seek_back_is_an_error() -> None:
    data = member(b"big.bin", b"x" * 2000) + END
    with pytest.raises(ShardFormatError, match="cannot seek back") as info:
        list(iter_members(BackwardSeekFails(data), block_bytes=512))
    assert info.value.offset == 512  # the member's data


def test_eof_right_after_an_extended_header_at_the_start() -> None:
    with pytest.raises(ShardFormatError, match="ends after an extended header") as info:
        read(member(b"pax", pax_records(path="p.bin"), b"x"))
    assert info.value.offset == 0


def test_data_after_a_zero_block_is_found_beyond_the_buffer() -> None:
    data = member(b"a.txt", b"a") + bytes(512) + member(b"b.txt", b"b") + END
    with pytest.raises(ShardFormatError, match="a zero block followed by more data"):
        read(data, "nonseekable", block_bytes=512)


def test_a_short_second_zero_block_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    body = member(b"a.txt", b"a")
    caplog.set_level(logging.DEBUG, logger="cloudshards.tar.blocks")
    for tail, logged in ((END, False), (bytes(512), False), (bytes(600), True)):
        caplog.clear()
        assert read(body + tail) == [("a.txt", b"a")]
        assert ("ends inside its second zero block" in caplog.text) is logged


def test_gzip_followed_by_a_zlib_stream_reads_the_archive_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    compressed = gzip.compress(write_tar(SAMPLE_MEMBERS)) + zlib.compress(b"not gzip")
    with caplog.at_level("WARNING", logger="cloudshards"):
        assert read(compressed) == SAMPLE_MEMBERS
    assert "is not gzip data: ignored" in caplog.text


class PartsStream:
    """A non-seekable stream that hands out fixed parts, as the remote part stream does: a
    read of a part or more returns the part itself; a smaller read copies a slice of it."""

    def __init__(self, data: bytes, part: int) -> None:
        self.parts = [data[i : i + part] for i in range(0, len(data), part)]
        self.partial_reads = 0

    def read(self, size: int = -1) -> bytes:
        if not self.parts:
            return b""
        head = self.parts[0]
        if size < 0 or size >= len(head):
            return self.parts.pop(0)
        self.partial_reads += 1
        self.parts[0] = head[size:]
        return head[:size]


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("part", [700, 3000, 4096 + 7, 65536])
@pytest.mark.parametrize("block_bytes", [512, 4096, 1 << 20])
def test_parts_that_split_headers_and_members(compress: bool, part: int, block_bytes: int) -> None:
    rng = random.Random(part * 7 + block_bytes)
    files = [(f"s{i:04d}.{ext}", rng.randbytes(rng.randrange(0, 5000)))
             for i in range(60) for ext in ("bin", "json")]  # fmt: skip
    data = write_tar(files, fmt=tarfile.PAX_FORMAT)
    if compress:
        data = gzip.compress(data)
    got = [(m.name, m.data) for m in iter_members(PartsStream(data, part), block_bytes=block_bytes)]
    assert got == files


def test_parts_are_never_split_when_blocks_are_at_least_a_part() -> None:
    """A member or header split across two parts is completed from the next part read whole
    (the rest of it kept for the next block), so no part is ever copied in pieces."""
    files = [(f"s{i:04d}.bin", bytes([i % 251]) * (1000 + 37 * i)) for i in range(80)]
    stream = PartsStream(write_tar(files, fmt=tarfile.PAX_FORMAT), 3000)
    got = [(m.name, m.data) for m in iter_members(stream, block_bytes=4096)]
    assert got == files
    assert stream.partial_reads == 0


class RecordingReads(NonSeekable):
    """Non-seekable; records the size of every read asked for."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.asked: list[int] = []

    def read(self, size: int) -> bytes:
        self.asked.append(size)
        return super().read(size)


@pytest.mark.parametrize("big", [4096 * 3, 4096 * 3 + 100])
def test_a_skipped_member_is_never_read_whole(big: int) -> None:
    """A member the name filter drops is skipped a block at a time on a stream that cannot
    seek: however large it claims to be, it never needs more memory than a block."""
    files = [("a.keep", b"x" * 700), ("a.drop", bytes(big)), ("b.keep", b"y" * 10)]
    stream = RecordingReads(write_tar(files, fmt=tarfile.PAX_FORMAT))

    def keep(name: str) -> str | None:
        return name if name.endswith(".keep") else None

    got = [(m.name, m.data) for m in iter_members(stream, block_bytes=4096, name_filter=keep)]
    assert got == [files[0], files[2]]
    assert max(stream.asked) <= 4096


def test_gzip_back_references_across_the_whole_window() -> None:
    """gzip(1) and Python's gzip use a 32 KiB window: a member repeating one 20 KiB apart is
    compressed as back-references that far, and must inflate (a smaller window cannot)."""
    payload = random.Random(5).randbytes(20 << 10)
    files = [("a.bin", payload), ("b.bin", payload), ("c.bin", payload)]
    assert read(gzip.compress(write_tar(files))) == files


def test_gzip_back_references_across_the_whole_window_in_a_later_member() -> None:
    """``cat a.gz b.gz``: each gzip member inflates with the whole 32 KiB window, the ones
    after the first included (here the second holds two copies 20 KiB apart)."""
    payload = random.Random(6).randbytes(20 << 10)
    files = [("a.bin", payload), ("b.bin", payload), ("c.bin", payload)]
    tar = write_tar(files)
    cut = len(tar) // 4  # inside the first file: b.bin and c.bin are in the second member
    assert read(gzip.compress(tar[:cut]) + gzip.compress(tar[cut:])) == files
