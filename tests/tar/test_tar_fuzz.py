"""Fuzzing the tar reader against Python's ``tarfile`` as the oracle.

Archives are written by ``tarfile`` (ustar, GNU long names and links, PAX with per-member and
global headers, optionally gzipped, whole or in several gzip members), then damaged: truncated
anywhere, a header byte flipped, a header field rewritten (with a fixed checksum), or odd PAX
values written. cloudshards reads them from seekable and non-seekable streams with several
block sizes. What it yields must be exactly what ``tarfile`` reads, or a prefix of it followed
by a ``ShardFormatError``: never another exception, a hang or wrong data.

Where cloudshards differs from ``tarfile`` on purpose, the oracle encodes the difference (each
is marked DIFFERENCE below, with the reason). Runs are deterministic (``derandomize``, no
example database) and take a few seconds; raise ``max_examples`` locally to fuzz longer.
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from cloudshards.cache.membertable import MemberTable
from cloudshards.errors import ShardFormatError
from cloudshards.tar import iter_members

FUZZ = settings(
    derandomize=True,  # the same examples on every run and machine: CI never flakes
    database=None,
    deadline=None,
    max_examples=500,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}

Files = list[tuple[str, bytes]]


# --- streams ---------------------------------------------------------------------------------


class NonSeekable:
    """read() only, like a pipe or an HTTP body."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def read(self, size: int) -> bytes:
        return self._inner.read(size)


class ShortReads(NonSeekable):
    """At most a few hundred bytes per read, as sockets may return."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._rng = random.Random(len(data))

    def read(self, size: int) -> bytes:
        return self._inner.read(min(size, self._rng.randint(1, 700)))


STREAMS: dict[str, Callable[[bytes], Any]] = {
    "seekable": io.BytesIO,
    "nonseekable": NonSeekable,
    "short": ShortReads,
}


# --- archives ----------------------------------------------------------------------------------


@dataclass
class Entry:
    kind: str  # "file", "dir", "symlink"
    name: str
    size: int = 0
    zeros: bool = False  # all-zero data: looks like end-of-archive blocks if misaligned
    pax: dict[str, str] = field(default_factory=dict)
    link: str = ""

    def data(self, index: int) -> bytes:
        return bytes(self.size) if self.zeros else random.Random(index).randbytes(self.size)


def write(entries: list[Entry], fmt: str, *, global_pax: bool = False) -> bytes:
    buffer = io.BytesIO()
    pax_headers = {"comment": "global header"} if global_pax else None
    with tarfile.open(
        fileobj=buffer, mode="w", format=FORMATS[fmt], pax_headers=pax_headers
    ) as tar:
        for index, entry in enumerate(entries):
            info = tarfile.TarInfo(entry.name)
            info.mtime = 1_700_000_000.5 if fmt == "pax" else 1_700_000_000
            info.pax_headers = dict(entry.pax)
            if entry.kind == "file":
                info.size = entry.size
                tar.addfile(info, io.BytesIO(entry.data(index)))
            else:
                info.type = tarfile.DIRTYPE if entry.kind == "dir" else tarfile.SYMTYPE
                info.linkname = entry.link
                tar.addfile(info)
    return buffer.getvalue()


@dataclass
class Oracle:
    """What tarfile read: regular files (name, data, own header offset), how it ended."""

    files: list[tuple[str, bytes, int]]
    clean: bool  # reached the end-of-archive marker without an error
    end: int  # offset of the end-of-archive marker (when clean)
    members: list[tarfile.TarInfo]


def read_with_tarfile(raw: bytes, max_members: int = 64) -> Oracle:
    """Regular files as tarfile reads them. Stops (not clean) at its first error, and after
    ``max_members`` entries: a negative size can send tarfile back to an earlier header
    forever."""
    files: list[tuple[str, bytes, int]] = []
    members: list[tarfile.TarInfo] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for _ in range(max_members):
                info = tar.next()
                if info is None:
                    return Oracle(files, True, tar.offset, members)
                members.append(info)
                # DIFFERENCE: only regular files (isreg) are members; cloudshards skips
                # directories, links, devices and unknown types, as webdataset does.
                if info.isreg():
                    handle = tar.extractfile(info)
                    assert handle is not None
                    files.append((info.name, handle.read(), info.offset_data - 512))
    except Exception:  # any tarfile failure ends what the oracle knows
        pass
    return Oracle(files, False, -1, members)


@dataclass
class Expect:
    """What cloudshards must do with an archive (``files``: every regular file, in order)."""

    files: Files
    must_succeed: bool = False
    must_raise: bool = False
    exact_count: int | None = None  # files complete before the error, when it must raise


@dataclass
class Reader:
    """How cloudshards reads: stream kind, block size, a name filter, a member table."""

    stream: str = "seekable"
    block_bytes: int = 1 << 20
    skip_some: bool = False  # a name filter skips (never reads) some members
    record: bool = False  # record a member table, as the node cache does

    def keep(self, name: str) -> bool:
        return not self.skip_some or len(name) % 3 != 0


def check(data: bytes, expect: Expect, reader: Reader) -> None:
    got: Files = []
    table = MemberTable() if reader.record else None
    exc: ShardFormatError | None = None
    members = iter_members(
        STREAMS[reader.stream](data),
        url="fuzz.tar",
        block_bytes=reader.block_bytes,
        name_filter=(lambda name: name if reader.keep(name) else None)
        if reader.skip_some
        else None,
        record=table,
    )
    try:
        # Anything but a ShardFormatError propagates and fails the test; a hang times out.
        for member in members:
            got.append((member.name, member.data))
    except ShardFormatError as error:
        exc = error
    kept = [(name, value) for name, value in expect.files if reader.keep(name)]
    if currently_in_test_context():  # shown by --hypothesis-show-statistics
        event("cloudshards: ok" if exc is None else "cloudshards: ShardFormatError")
    if exc is None:
        assert not expect.must_raise, f"no error, yielded {[n for n, _ in got]}"
        assert got == kept
        if table is not None and data[:2] != b"\x1f\x8b":
            # Every regular member, skipped or not, where its data lies.
            assert table.complete
            assert list(zip(table.names, table.sizes, strict=True)) == [
                (name, len(value)) for name, value in expect.files
            ]
            assert all(
                data[o : o + n] == v
                for o, n, (_, v) in zip(table.offsets, table.sizes, expect.files, strict=True)
            )
        return
    assert not expect.must_succeed, f"unexpected {exc!r}"
    assert got == kept[: len(got)], exc
    if expect.exact_count is not None:
        assert len(got) == sum(reader.keep(n) for n, _ in expect.files[: expect.exact_count]), exc
    assert exc.url == "fuzz.tar"
    assert exc.offset is not None
    if table is not None:
        assert not table.complete


# --- strategies ------------------------------------------------------------------------------

_chars = st.characters(
    blacklist_categories=["Cs"], blacklist_characters="\0/", min_codepoint=1, max_codepoint=0x2FF
)
_component = st.text(_chars, min_size=1, max_size=30)
_long_path = st.lists(_component, min_size=2, max_size=9).map("/".join)
_sizes = st.one_of(st.sampled_from([0, 1, 511, 512, 513, 1024, 1500]), st.integers(0, 4000))


@st.composite
def entries(draw: st.DrawFn, fmt: str, *, min_files: int = 0) -> list[Entry]:
    count = draw(st.integers(0, 6))
    out: list[Entry] = []
    for index in range(count):
        kind = draw(st.sampled_from(["file"] * 6 + ["dir", "symlink"]))
        if fmt == "ustar":
            # ustar cannot hold long names: a short name, or prefix/name within 155/100 bytes.
            name = draw(
                st.one_of(
                    st.just(f"k{index}.bin"),
                    st.builds(lambda d, n: f"{d}/{n}", _component, _component),
                ).filter(lambda n: len(n.encode()) <= 100)
            )
        else:
            name = draw(st.one_of(st.just(f"k{index}.bin"), _component, _long_path))
        link = ""
        if kind == "symlink":
            link = "target" if fmt == "ustar" else draw(st.one_of(st.just("t"), _long_path))
        size = draw(_sizes) if kind == "file" else 0
        out.append(Entry(kind, name, size, zeros=draw(st.booleans()) and size > 0, link=link))
    while sum(entry.kind == "file" for entry in out) < min_files:
        out.append(Entry("file", f"f{len(out)}.bin", draw(_sizes)))
    return out


def compress(raw: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(raw, 1, mtime=0)
    if how == "gzip-multi":
        third = len(raw) // 3
        return gzip.compress(raw[:third], 1, mtime=0) + gzip.compress(raw[third:], 1, mtime=0)
    return raw


def size_field(raw: bytes, at: int) -> int:
    """The size of the header at ``at`` of an archive tarfile wrote (octal: sizes < 8 GiB)."""
    return int(raw[at + 124 : at + 136].split(b"\0", 1)[0].strip() or b"0", 8)


def header_offsets(raw: bytes) -> list[int]:
    """Every header of a well-formed, uncompressed archive (extended ones included)."""
    offsets, pos = [], 0
    while pos + 512 <= len(raw) and raw[pos : pos + 512] != bytes(512):
        offsets.append(pos)
        size = size_field(raw, pos)
        pos += 512 + size + (-size % 512)
    return offsets


def files_of(oracle: Oracle) -> Files:
    return [(name, data) for name, data, _ in oracle.files]


def set_checksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)


_reader_options = {
    "stream": st.sampled_from(sorted(STREAMS)),
    "block_bytes": st.sampled_from([512, 1000, 4096, 1 << 20]),
    "skip_some": st.booleans(),
    "record": st.booleans(),
}


# --- the fuzz tests --------------------------------------------------------------------------


@FUZZ
@given(
    fmt_entries=st.sampled_from(sorted(FORMATS)).flatmap(
        lambda fmt: st.tuples(st.just(fmt), entries(fmt))
    ),
    global_pax=st.booleans(),
    how=st.sampled_from(["none", "gzip", "gzip-multi"]),
    data=st.data(),
    reader=st.builds(Reader, **_reader_options),
)
def test_fuzz_whole_and_truncated(
    fmt_entries: tuple[str, list[Entry]],
    global_pax: bool,
    how: str,
    data: st.DataObject,
    reader: Reader,
) -> None:
    fmt, items = fmt_entries
    raw = write(items, fmt, global_pax=global_pax and fmt == "pax")
    oracle = read_with_tarfile(raw)
    if global_pax and fmt == "pax" and not items:
        # DIFFERENCE: tarfile fails on an archive that is only a global header (it reads the
        # next header as the one the global header belongs to); a global header belongs to
        # no entry, and cloudshards ignores it.
        oracle = Oracle([], True, 1024, [])
    assert oracle.clean  # tarfile wrote it: it must read it back
    files = files_of(oracle)
    kind = data.draw(st.sampled_from(["whole", "cut", "cut-block", "cut-compressed"]))
    event(f"archive: {kind}")
    if kind == "whole":
        check(compress(raw, how), Expect(files, must_succeed=True), reader)
        return
    if kind == "cut-compressed" and how != "none":
        packed = compress(raw, how)
        cut = data.draw(st.integers(0, len(packed) - 1), label="cut")
        # A gzip stream cut anywhere lacks its trailer: always an error.
        check(packed[:cut], Expect(files, must_raise=True), reader)
        return
    if kind == "cut-block":
        cut = 512 * data.draw(st.integers(0, len(raw) // 512 - 1), label="block")
    else:
        cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    # DIFFERENCE: tarfile accepts an archive that ends without its end-of-archive marker;
    # cloudshards requires one zero block at least (a shard cut on a member boundary would
    # silently lose its other samples). Every member whose data and padding lie before the
    # cut is yielded, then the error.
    complete = sum(1 for _, d, h in oracle.files if h + 512 + len(d) + (-len(d) % 512) <= cut)
    proper_end = cut >= oracle.end + 512
    expect = Expect(files, must_succeed=proper_end, must_raise=not proper_end)
    if not proper_end:
        expect.exact_count = complete
    check(compress(raw[:cut], how), expect, reader)


# Header fields cloudshards never reads: it ignores them entirely (their junk included).
IGNORED_FIELDS = {
    "mode": (100, 108),
    "uid": (108, 116),
    "gid": (116, 124),
    "mtime": (136, 148),
    "linkname": (157, 257),
    "version": (263, 265),
    "uname": (265, 297),
    "gname": (297, 329),
    "devmajor": (329, 337),
    "devminor": (337, 345),
}
READ_FIELDS = {"name": (0, 100), "size": (124, 136), "typeflag": (156, 157)}

_field_junk = st.one_of(
    st.binary(min_size=1, max_size=12),
    st.sampled_from([b"", b"\0", b" ", b"-1", b"+7", b"9", b"\xff" * 8, b"\x80\0\0\0\x01"]),
)
_size_values = st.one_of(
    st.integers(0, 20_000).map(lambda n: b"%011o\0" % n),
    st.integers(0, 40).map(lambda n: b"%011o\0" % (512 * n)),
    st.integers(0, 2**88 - 1).map(lambda n: b"\x80" + n.to_bytes(11, "big")),
    st.sampled_from(
        [
            b"\x80" + (1 << 63).to_bytes(11, "big"),
            b"\x80" + (1 << 64).to_bytes(11, "big"),
            b"\xff" * 12,
            b"\xff" + bytes(11),
            b"-0000000001\0",
            b"+0000000001\0",
            b"  12\0      ",
            b"0000_000012\0",
            b"0000000001a\0",
            b"12 34\0\0\0\0\0\0\0",
            bytes(12),
            b" " * 12,
        ]
    ),
    st.binary(min_size=12, max_size=12),
)
# Types that are not extended headers: an extended header made out of a member's header
# creates two consecutive extended headers, where tar implementations disagree (tarfile uses
# the first, GNU tar and cloudshards the last); tests/tar/test_tar.py pins cloudshards' choice.
_typeflags = st.sampled_from([b"0", b"\0", b"7", b"1", b"2", b"3", b"4", b"5", b"6", b"S", b"V"])


def _header_name(block: bytes | bytearray, *, any_magic: bool) -> str:
    """The name a header gives its member (tarfile's rule when ``any_magic``)."""
    name = block[:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0]
    if prefix and (any_magic or block[257:263] == b"ustar\0"):
        name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


@FUZZ
@given(
    fmt_entries=st.sampled_from(sorted(FORMATS)).flatmap(
        lambda fmt: st.tuples(st.just(fmt), entries(fmt, min_files=1))
    ),
    how=st.sampled_from(["none", "gzip"]),
    data=st.data(),
    reader=st.builds(Reader, **_reader_options),
)
def test_fuzz_mutated_headers(
    fmt_entries: tuple[str, list[Entry]],
    how: str,
    data: st.DataObject,
    reader: Reader,
) -> None:
    fmt, items = fmt_entries
    raw = write(items, fmt)
    original = read_with_tarfile(raw)
    assert original.clean
    headers = header_offsets(raw)
    at = data.draw(st.sampled_from(headers), label="header")
    block = bytearray(raw[at : at + 512])
    own = [h for h, alone in zip(headers, _own_flags(headers, original), strict=True) if alone]
    extended = [h for h in headers if raw[h + 156] in b"xgLK" and size_field(raw, h)]
    kinds = ["flip", "ignored", "read"] + (["magic"] if own else [])
    kinds += ["extended-data"] if extended else []
    kind = data.draw(st.sampled_from(kinds), label="kind")
    event(f"mutation: {kind}")
    yielded_before = sum(1 for _, _, h in original.files if h < at)

    if kind == "flip":
        index = data.draw(st.integers(0, 511), label="byte")
        block[index] ^= data.draw(st.integers(1, 255), label="xor")
        mutated = raw[:at] + bytes(block) + raw[at + 512 :]
        if 148 <= index < 156:
            # The checksum field itself: it may still read as the same number.
            expect = Expect(files_of(original))
        else:
            # Any other byte changes the sum (unsigned and signed alike): a bad checksum.
            expect = Expect(files_of(original), must_raise=True, exact_count=yielded_before)
        check(compress(mutated, how), expect, reader)
        return

    if kind == "extended-data":
        # A byte of a PAX record or GNU long name flipped: cloudshards parses PAX records
        # strictly (length, "=", newline) where tarfile skips what it cannot parse, so it may
        # refuse more; what both accept must agree.
        at = data.draw(st.sampled_from(extended), label="extended header")
        size = size_field(raw, at)
        index = at + 512 + data.draw(st.integers(0, size - 1), label="byte")
        damaged = bytearray(raw)
        damaged[index] ^= data.draw(st.integers(1, 255), label="xor")
        result = read_with_tarfile(bytes(damaged))
        check(compress(bytes(damaged), how), Expect(files_of(result)), reader)
        return

    if kind == "ignored":
        # DIFFERENCE: cloudshards reads only a header's name, size, type, magic, prefix and
        # checksum. tarfile also parses mode, uid, gid, mtime, devmajor and devminor, and ends
        # the archive (silently) at a header where one of them is not a number.
        name = data.draw(st.sampled_from(sorted(IGNORED_FIELDS)), label="field")
        start, end = IGNORED_FIELDS[name]
        value = data.draw(_field_junk, label="value")[: end - start]
        block[start : start + len(value)] = value
        set_checksum(block)
        mutated = raw[:at] + bytes(block) + raw[at + 512 :]
        check(
            compress(mutated, how),
            Expect(files_of(original), must_succeed=True),
            reader,
        )
        return

    if kind == "magic":
        # DIFFERENCE: the ustar prefix is joined to the name only under the POSIX magic
        # "ustar\0" (old GNU headers keep atime/ctime in those bytes); tarfile joins any
        # non-empty prefix. Only headers whose member has no extended header are mutated, so
        # the name comes from this header alone.
        at = data.draw(st.sampled_from(own), label="own header")
        block = bytearray(raw[at : at + 512])
        block[257:265] = data.draw(
            st.sampled_from([b"ustar\x0000", b"ustar  \0", b"ustar\0xx", bytes(8), b"GNUtar \0"])
        )
        prefix = data.draw(st.sampled_from([b"", b"pre", b"a/b"]), label="prefix")
        if prefix or data.draw(st.booleans()):
            block[345:500] = prefix.ljust(155, b"\0")
        set_checksum(block)
        mutated = raw[:at] + bytes(block) + raw[at + 512 :]
        result = read_with_tarfile(mutated)
        tar_name, ours = _header_name(block, any_magic=True), _header_name(block, any_magic=False)
        files = [(ours if h == at and n == tar_name else n, d) for n, d, h in result.files]
        check(compress(mutated, how), Expect(files, must_succeed=result.clean), reader)
        return

    # A field cloudshards reads, rewritten with a good checksum: compare with tarfile on the
    # same bytes. (cloudshards may refuse what tarfile takes, e.g. a negative size.)
    name = data.draw(st.sampled_from(sorted(READ_FIELDS)), label="field")
    start, end = READ_FIELDS[name]
    if name == "size":
        value = data.draw(_size_values, label="value")
    elif name == "typeflag":
        value = data.draw(_typeflags, label="value")
    else:
        value = data.draw(st.binary(max_size=100), label="value").ljust(100, b"\0")
    block[start:end] = value
    set_checksum(block)
    mutated = raw[:at] + bytes(block) + raw[at + 512 :]
    result = read_with_tarfile(mutated)
    check(compress(mutated, how), Expect(files_of(result)), reader)


def _own_flags(headers: list[int], oracle: Oracle) -> Iterator[bool]:
    """For each header: is it the only header of its member (no extended header before)?"""
    alone = {info.offset for info in oracle.members if info.offset == info.offset_data - 512}
    for offset in headers:
        yield offset in alone


_pax_values = {
    # "{n}" stands for the member's real size.
    "size": st.sampled_from(
        ["{n}", "000{n}", "", "junk", "-5", "+{n}", " {n}", "{n} ", "1_0", "9" * 25, "0x10"]
    ),
    "path": st.sampled_from(["", "renamed.bin", "dir/", "a" * 150, "x\udcff.bin"]),
    "mtime": st.sampled_from(["", "junk", "-1e999", "nan", "9" * 5000]),
    "uid": st.sampled_from(["", "-1", "abc", "9" * 5000]),
}


@FUZZ
@given(
    items=entries("pax", min_files=1),
    key=st.sampled_from(sorted(_pax_values)),
    data=st.data(),
    reader=st.builds(Reader, **_reader_options),
)
def test_fuzz_pax_values(items: list[Entry], key: str, data: st.DataObject, reader: Reader) -> None:
    index = data.draw(st.sampled_from([i for i, e in enumerate(items) if e.kind == "file"]))
    value = data.draw(_pax_values[key], label="value").replace("{n}", str(items[index].size))
    items[index].pax = {key: value}
    raw = write(items, "pax")
    before = sum(1 for e in items[:index] if e.kind == "file")
    oracle = read_with_tarfile(raw)
    if key == "size" and value != "":
        if value.isdigit() and int(value) == items[index].size:
            expect = Expect(files_of(oracle), must_succeed=True)
        else:
            # DIFFERENCE: a PAX size must be decimal digits (and fit in 63 bits). tarfile reads
            # junk as 0 (and takes "+5", " 5", "1_0" through int()); the size decides where
            # the next header is, so cloudshards refuses it, at the member it belongs to.
            expect = Expect(files_of(oracle)[:before], must_raise=True, exact_count=before)
    elif value == "" and key in ("size", "path"):
        # DIFFERENCE: an empty PAX value deletes the keyword (POSIX), so the header's own
        # size or name stands; tarfile sets the size to 0 or the name to "".
        expect = Expect(_without_empty_record(raw, items, index, key), must_succeed=True)
    else:
        # Numbers cloudshards does not use (mtime, uid) may be junk; paths as tarfile reads
        # them (a trailing "/" stripped from a file's PAX path, as tarfile does).
        assert oracle.clean
        expect = Expect(files_of(oracle), must_succeed=True)
    check(raw, expect, reader)


def _without_empty_record(raw: bytes, items: list[Entry], index: int, key: str) -> Files:
    """The files as written without the empty record; an empty path leaves file ``index``
    named by its ustar header in ``raw`` (which then holds the name tarfile could fit)."""
    record = items[index].pax
    items[index].pax = {}
    files = files_of(read_with_tarfile(write(items, "pax")))
    items[index].pax = record
    if key == "path":
        position = sum(1 for e in items[:index] if e.kind == "file")
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            info = [m for m in tar.getmembers() if m.isreg()][position]
        block = raw[info.offset_data - 512 : info.offset_data]
        files[position] = (_header_name(block, any_magic=False), files[position][1])
    return files


# --- every cut of a few fixed archives ---------------------------------------------------------


def _fixed_archive(fmt: str) -> bytes:
    members = [
        Entry("file", "a.txt", 5),
        Entry("dir", "d"),
        Entry("file", "deep/" * 25 + "long.bin", 700),
        Entry("symlink", "l", link="t"),
        Entry("file", "empty.txt", 0),
        Entry("file", "b.bin", 1024, zeros=True),
    ]
    if fmt == "ustar":
        members = [entry for entry in members if len(entry.name) < 100]
    return write(members, fmt, global_pax=fmt == "pax")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_cut_of_a_small_archive(fmt: str) -> None:
    raw = _fixed_archive(fmt)
    oracle = read_with_tarfile(raw)
    assert oracle.clean
    files = files_of(oracle)
    # Every byte up to past the end marker, then the zero padding tarfile adds, in steps.
    for cut in [*range(oracle.end + 1100), *range(oracle.end + 1100, len(raw) + 1, 509)]:
        complete = sum(1 for _, d, h in oracle.files if h + 512 + len(d) + (-len(d) % 512) <= cut)
        proper = cut >= oracle.end + 512
        expect = Expect(
            files,
            must_succeed=proper,
            must_raise=not proper,
            exact_count=None if proper else complete,
        )
        for stream in ("seekable", "nonseekable"):
            check(raw[:cut], expect, Reader(stream, 512 if cut % 2 else 1 << 20, cut % 3 == 0))
    # The gzipped archive cut anywhere: no gzip trailer, always an error.
    packed = gzip.compress(raw, 1, mtime=0)
    for cut in range(len(packed)):
        check(packed[:cut], Expect(files, must_raise=True), Reader("nonseekable", 1000))
