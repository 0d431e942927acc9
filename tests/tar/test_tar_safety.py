"""Robustness of the tar reader against hostile or damaged shards.

Sizes that cannot be real (base-256 or PAX sizes of 2**63 and more, junk PAX numbers) must be a
``ShardFormatError`` naming the shard, the offset and the member on every read path, never an
``OverflowError`` or ``ValueError`` from the seek or ``int()`` underneath. A shard cut short
must still deliver every complete sample before the damage (and never a partial one) when the
error handler lets the pipeline continue.
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakes
import pytest

import cloudshards as wds
from cloudshards.cache.membertable import MemberTable
from cloudshards.errors import ShardFormatError, ShardOpenError
from cloudshards.grouping import group_members
from cloudshards.indexed import IndexedDataset, build_index
from cloudshards.tar import iter_members
from cloudshards.types import Member

URL = "s3://bucket/shard.tar"


@pytest.fixture(autouse=True)
def slowfile(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)


# --- building archives by hand ---------------------------------------------------------------


def header(
    name: bytes,
    size: int = 0,
    typeflag: bytes = b"0",
    *,
    size_field: bytes | None = None,
) -> bytes:
    """One ustar header block with a correct checksum."""
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\0"
    block[108:116] = block[116:124] = b"0000000\0"
    block[124:136] = size_field if size_field is not None else b"%011o\0" % size
    block[136:148] = b"00000000007\0"
    block[156:157] = typeflag
    block[257:265] = b"ustar\x0000"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def member(name: bytes, data: bytes, typeflag: bytes = b"0") -> bytes:
    return header(name, len(data), typeflag) + pad(data)


def pax(**records: str) -> bytes:
    """A PAX 'x' header (and its data) with the given records, values verbatim."""
    out = b""
    for key, value in records.items():
        body = f" {key}={value}\n".encode()
        length = len(body) + len(str(len(body)))
        length = len(body) + len(str(length))
        out += str(length).encode() + body
    return member(b"PaxHeader", out, b"x")


def base256(value: int) -> bytes:
    return b"\x80" + value.to_bytes(11, "big")


END = bytes(1024)
GOOD = member(b"a.txt", b"a")  # one good member before the bad one, so offsets are not 0


class NonSeekable:
    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)

    def read(self, size: int) -> bytes:
        return self._inner.read(size)


def opener(kind: str, tmp_path: Path) -> Callable[[bytes], Any]:
    def open_bytes(data: bytes) -> Any:
        if kind == "bytesio":
            return io.BytesIO(data)
        if kind == "nonseekable":
            return NonSeekable(data)
        path = tmp_path / "shard.tar"
        path.write_bytes(data)
        return open(path, "rb")

    return open_bytes


def read_error(stream: Any, **kw: Any) -> tuple[list[Member], ShardFormatError]:
    got: list[Member] = []
    try:
        for item in iter_members(stream, url=URL, **kw):
            got.append(item)
    except ShardFormatError as exc:
        return got, exc
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    raise AssertionError(f"no ShardFormatError after {[m.name for m in got]}")


def assert_names(exc: ShardFormatError, member: str | None, *, offset: int | None = None) -> None:
    assert exc.url == URL
    assert exc.offset is not None
    if offset is not None:
        assert exc.offset == offset
    assert member is not None
    assert repr(member) in str(exc)


# --- sizes that do not fit ------------------------------------------------------------------

STREAM_KINDS = ["bytesio", "file", "nonseekable"]
HUGE_SIZES = [1 << 63, (1 << 63) - 600, 1 << 64, (1 << 88) - 1]


def drop_member(name: str) -> str | None:
    return None if name.startswith("x") else name


@pytest.mark.parametrize("kind", STREAM_KINDS)
@pytest.mark.parametrize("size", HUGE_SIZES, ids=lambda s: f"{s:#x}")
def test_huge_base256_size_of_a_skipped_member(kind: str, size: int, tmp_path: Path) -> None:
    data = GOOD + header(b"x.dat", size_field=base256(size)) + END
    got, exc = read_error(opener(kind, tmp_path)(data), name_filter=drop_member)
    assert [m.name for m in got] == ["a.txt"]
    assert exc.member == "x.dat"
    assert_names(exc, "x.dat")


@pytest.mark.parametrize("kind", STREAM_KINDS)
@pytest.mark.parametrize("size", HUGE_SIZES, ids=lambda s: f"{s:#x}")
def test_huge_base256_size_of_a_wanted_member_beyond_any_limit(
    kind: str, size: int, tmp_path: Path
) -> None:
    # A limit set absurdly high must not turn a corrupt size into an OverflowError.
    data = GOOD + header(b"x.dat", size_field=base256(size)) + END
    got, exc = read_error(opener(kind, tmp_path)(data), max_member_bytes=1 << 100)
    assert [m.name for m in got] == ["a.txt"]
    assert exc.member == "x.dat"
    assert_names(exc, "x.dat")


@pytest.mark.parametrize("kind", STREAM_KINDS)
@pytest.mark.parametrize("size", HUGE_SIZES, ids=lambda s: f"{s:#x}")
def test_huge_base256_size_of_an_entry_that_is_not_a_file(
    kind: str, size: int, tmp_path: Path
) -> None:
    # Unknown type 'Z': its data is skipped. It is named in the message (not in .member, which
    # names regular files only: sample grouping relies on that).
    data = GOOD + header(b"x.dat", typeflag=b"Z", size_field=base256(size)) + END
    got, exc = read_error(opener(kind, tmp_path)(data))
    assert [m.name for m in got] == ["a.txt"]
    assert exc.member is None
    assert_names(exc, "x.dat")


@pytest.mark.parametrize("kind", STREAM_KINDS)
@pytest.mark.parametrize("size", HUGE_SIZES, ids=lambda s: f"{s:#x}")
def test_huge_size_while_recording_a_member_table(kind: str, size: int, tmp_path: Path) -> None:
    # The table keeps sizes in array('q'): 2**63 does not fit.
    data = GOOD + header(b"x.dat", size_field=base256(size)) + END
    table = MemberTable()
    got, exc = read_error(opener(kind, tmp_path)(data), record=table)
    assert [m.name for m in got] == ["a.txt"]
    assert exc.member == "x.dat"
    assert_names(exc, "x.dat")
    assert not table.complete


@pytest.mark.parametrize("kind", STREAM_KINDS)
@pytest.mark.parametrize(
    "size", [str(1 << 63), "9" * 19, "9" * 30, "0" * 5000 + "7", "9" * 5000], ids=len
)
def test_huge_pax_size(kind: str, size: str, tmp_path: Path) -> None:
    data = GOOD + pax(size=size) + header(b"x.dat") + pad(b"x") + END
    expected = [("a.txt", b"a")]
    if size == "0" * 5000 + "7":  # leading zeros: just 7
        expected.append(("x.dat", b"x" + bytes(6)))
        stream = opener(kind, tmp_path)(data)
        try:
            assert [(m.name, m.data) for m in iter_members(stream, url=URL)] == expected
        finally:
            getattr(stream, "close", lambda: None)()
        return
    for name_filter in (None, drop_member):
        got, exc = read_error(opener(kind, tmp_path)(data), name_filter=name_filter)
        assert [m.name for m in got] == ["a.txt"]
        assert exc.member == "x.dat"
        assert_names(exc, "x.dat")


@pytest.mark.parametrize(
    "size", ["-5", "+1", " 1", "1 ", "0x1", "1e0", "1_0", "\uff11", "1.0", "junk"]
)
def test_junk_pax_size_is_a_format_error_naming_the_member(size: str) -> None:
    # tarfile reads a junk PAX number as 0 (and int() accepts "+1", " 1", "1_0"); a size is the
    # one number that decides where the next header is, so anything but digits is corrupt.
    data = GOOD + pax(size=size) + header(b"x.dat", 1) + pad(b"x") + END
    got, exc = read_error(io.BytesIO(data))
    assert [m.name for m in got] == ["a.txt"]
    assert "PAX" in str(exc)
    assert exc.member == "x.dat"
    assert_names(exc, "x.dat", offset=1024)


def test_junk_pax_size_before_an_entry_that_is_not_a_file() -> None:
    data = GOOD + pax(size="-1") + header(b"dir/", 0, b"5") + END
    got, exc = read_error(io.BytesIO(data))
    assert [m.name for m in got] == ["a.txt"]
    assert exc.member is None
    assert "'dir/'" in str(exc)


@pytest.mark.parametrize(
    "records",
    [
        {"mtime": "junk"},
        {"mtime": "-1e999"},
        {"mtime": "9" * 5000},
        {"atime": "nan", "ctime": "x"},
        {"uid": "-1", "gid": "abc"},
        {"uid": "9" * 5000},
        {"size": ""},  # an empty value deletes the keyword (POSIX): the header's size stands
    ],
)
def test_pax_numbers_that_are_not_used_may_be_junk(records: dict[str, str]) -> None:
    data = GOOD + pax(**records) + member(b"b.txt", b"bb") + END
    got = [(m.name, m.data) for m in iter_members(io.BytesIO(data), url=URL)]
    assert got == [("a.txt", b"a"), ("b.txt", b"bb")]


@pytest.mark.parametrize("size_field", [b"\xff" * 12, b"-0000000001\0", b"\xff" + bytes(11)])
@pytest.mark.parametrize("skip", [False, True])
def test_negative_sizes_name_the_member(size_field: bytes, skip: bool) -> None:
    data = GOOD + header(b"x.dat", size_field=size_field) + END
    got, exc = read_error(io.BytesIO(data), name_filter=drop_member if skip else None)
    assert [m.name for m in got] == ["a.txt"]
    assert exc.member == "x.dat"
    assert_names(exc, "x.dat", offset=1024)


@pytest.mark.parametrize("kind", STREAM_KINDS)
def test_size_pointing_past_the_end(kind: str, tmp_path: Path) -> None:
    data = GOOD + header(b"x.dat", size_field=base256(1 << 40)) + END
    for name_filter in (None, drop_member):
        got, exc = read_error(
            opener(kind, tmp_path)(data), name_filter=name_filter, max_member_bytes=1 << 41
        )
        assert [m.name for m in got] == ["a.txt"]
        assert exc.member == "x.dat"
        assert_names(exc, "x.dat")


@pytest.mark.parametrize("source", ["local", "remote", "cached"])
def test_huge_size_through_the_pipeline_is_a_format_error(source: str, tmp_path: Path) -> None:
    # A metadata member is skipped by the name filter (so read by seeking), and on its first
    # read through the node cache recorded in a member table (array('q')): neither may turn
    # the size into an OverflowError. (k1 may go on after the damaged member: not delivered.)
    path = tmp_path / "huge.tar"
    path.write_bytes(
        member(b"k0.txt", b"0")
        + member(b"k1.txt", b"1")
        + header(b"__meta__", size_field=base256(1 << 64))
        + END
    )
    url = str(path) if source == "local" else fakes.url_of(path)
    options: dict[str, Any] = {"cache_dir": str(tmp_path / "cache")} if source == "cached" else {}
    with pytest.raises(ShardFormatError, match="__meta__"):
        list(wds.WebDataset(url, shardshuffle=False, **options))
    got = wds.WebDataset(url, shardshuffle=False, handler=wds.ignore_and_continue, **options)
    assert [s["__key__"] for s in got] == ["k0"]


def test_indexed_dataset_huge_size_in_a_changed_shard(tmp_path: Path) -> None:
    # The index was built on a good shard; the shard then changed under it. Reading the sample
    # parses its bytes (a BytesIO): a 2**64 size there must be a ShardFormatError.
    path = tmp_path / "shard.tar"
    path.write_bytes(member(b"k.cls", b"1") + member(b"k.txt", b"x") + END)
    index = build_index([str(path)])
    path.write_bytes(
        member(b"k.cls", b"1") + header(b"__m__", size_field=base256(1 << 64)) + pad(b"x") + END
    )
    with IndexedDataset(index) as dataset, pytest.raises(ShardFormatError) as info:
        dataset[0]
    assert info.value.member == "k.cls"


def test_indexing_a_shard_with_a_huge_size(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(
        member(b"k.cls", b"1") + header(b"__meta__", size_field=base256(1 << 64)) + END
    )
    with pytest.raises(ShardFormatError, match="__meta__"):
        build_index([str(path)])


# --- a damaged shard keeps every complete sample before the damage --------------------------


def members(*names: str) -> list[Member]:
    return [Member(name, name.encode(), 512 * i) for i, name in enumerate(names)]


def failing(items: list[Member], exc: ShardFormatError) -> Iterator[Member]:
    yield from items
    raise exc


def group_until_error(
    items: list[Member], exc: ShardFormatError, **kw: Any
) -> list[tuple[str, list[str]]]:
    got: list[tuple[str, list[str]]] = []
    samples = group_members(failing(items, exc), url=URL, **kw)
    with pytest.raises(ShardFormatError) as info:
        got.extend((s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in samples)
    assert info.value is exc
    return got


@pytest.mark.parametrize(
    ("damaged", "expected_keys"),
    [
        ("b.jpg", ["a"]),  # the damage is in the first member of the next sample: a is complete
        ("a.txt", []),  # a member of a itself is damaged: a is partial
        ("A.txt", ["a"]),
        ("noext", []),  # a member grouping would skip: a may go on after it
        (None, []),  # damage in a header: the next member is unknown, a may go on
    ],
)
def test_group_members_delivers_the_sample_the_damage_proves_complete(
    damaged: str | None, expected_keys: list[str]
) -> None:
    exc = ShardFormatError("truncated", url=URL, offset=9, member=damaged)
    got = group_until_error(members("z.jpg", "a.jpg", "a.cls"), exc)
    assert got[:1] == [("z", ["jpg"])]
    assert [key for key, _ in got[1:]] == expected_keys
    if expected_keys:
        assert got[1] == ("a", ["cls", "jpg"])


def test_group_members_maps_the_damaged_name_through_the_name_filter() -> None:
    # Error names are the names in the archive; the filter says what grouping would have seen.
    def rename(name: str) -> str | None:
        if name.startswith("skip/"):
            return None
        return name.removeprefix("raw/")

    items = members("a.jpg", "a.cls")
    for damaged, expected in [("raw/b.jpg", ["a"]), ("raw/a.txt", []), ("skip/b.jpg", [])]:
        exc = ShardFormatError("truncated", url=URL, offset=9, member=damaged)
        got = group_until_error(items, exc, name_filter=rename)
        assert [key for key, _ in got] == expected, damaged


def test_group_members_duplicate_field_never_delivers_the_sample() -> None:
    got: list[str] = []
    samples = group_members(
        iter(members("a.jpg", "b.jpg", "b.JPG", "c.jpg")),
        url=URL,
        name_filter=lambda name: name.lower(),
    )
    with pytest.raises(ShardFormatError, match="duplicate"):
        got.extend(sample["__key__"] for sample in samples)
    assert got == ["a"]


def test_tar_errors_name_members_as_in_the_archive() -> None:
    # A renamed member that is cut short is reported under its name in the archive, which is
    # what the name filter maps (and what `tar tf` shows).
    data = member(b"raw/a.txt", b"a" * 3000)[:1500]
    _, exc = read_error(io.BytesIO(data), name_filter=lambda n: n.removeprefix("raw/"))
    assert exc.member == "raw/a.txt"
    big = member(b"raw/a.txt", b"a" * 3000) + END
    _, exc = read_error(
        io.BytesIO(big), name_filter=lambda n: n.removeprefix("raw/"), max_member_bytes=100
    )
    assert exc.member == "raw/a.txt"


@pytest.mark.parametrize("kind", ["bytesio", "nonseekable"])
def test_gzip_cut_inside_member_data_names_the_member(kind: str, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 400  # compresses, but not to nothing
    raw = member(b"a.txt", b"a") + member(b"b.bin", payload) + END
    packed = gzip.compress(raw, 1)
    _, exc = read_error(opener(kind, tmp_path)(packed[: len(packed) // 2]), block_bytes=4096)
    assert exc.member == "b.bin"
    assert "gzip" in str(exc)


# A shard of four samples (two members each) whose member offsets are known, cut everywhere
# that matters; what must come out is computed from the offsets alone.

BIN_SIZES = [1300, 700, 2500, 100]


def fields(index: int) -> dict[str, bytes]:
    # Random bytes: a gzipped shard must not compress them to nothing.
    return {"bin": random.Random(index).randbytes(BIN_SIZES[index]), "cls": str(index).encode()}


def build_shard(fmt: int) -> tuple[bytes, list[tuple[str, int, int, int]], int]:
    """The shard, (name, first header offset, data offset, size) per member, end offset."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for index in range(len(BIN_SIZES)):
            for field, value in fields(index).items():
                info = tarfile.TarInfo(f"k{index}.{field}")
                info.size = len(value)
                info.mtime = 1_700_000_000.5  # PAX: an 'x' header before every member
                tar.addfile(info, io.BytesIO(value))
    data = buffer.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        layout = [(m.name, m.offset, m.offset_data, m.size) for m in tar.getmembers()]
        end = tar.offset
    return data, layout, end


def expected_keys(layout: list[tuple[str, int, int, int]], end: int, cut: int) -> list[str]:
    """Every sample all of whose members lie before ``cut``, except the last such sample when
    the damage does not prove it complete: the first incomplete member's own header must be
    there (so its name is known) and that name must have another key."""
    complete = [name for name, _, data, size in layout if data + size + (-size % 512) <= cut]
    keys = list(dict.fromkeys(name.split(".")[0] for name in complete))
    if len(complete) < len(layout):
        damaged, _, data, _ = layout[len(complete)]
        proven = cut >= data and damaged.split(".")[0] != keys[-1] if keys else False
    else:
        proven = cut >= end + 512  # one zero block and EOF is a proper end
    return keys if proven else keys[:-1]


def interesting_cuts(layout: list[tuple[str, int, int, int]], end: int) -> list[int]:
    cuts = set()
    for _, first, data, size in layout:
        padded = data + size + (-size % 512)
        for cut in (first, first + 100, data - 1, data, data + size // 2, data + size, padded - 1):
            cuts.add(cut)
    cuts.update((end, end + 1, end + 511, end + 512, end + 1000))
    return sorted(cut for cut in cuts if cut > 0)


def collect(dataset: Any) -> tuple[list[tuple[str, dict[str, bytes]]], int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [
            (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in dataset
        ]
    return got, len(caught)


def expected_samples(keys: list[str]) -> list[tuple[str, dict[str, bytes]]]:
    return [(key, fields(int(key[1:]))) for key in keys]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT], ids=["ustar", "pax"])
def test_truncated_local_shard_keeps_every_complete_sample(fmt: int, tmp_path: Path) -> None:
    # The seekable path (local file) and the streaming path (a remote store, slowfile://) with
    # webdataset's handler, at every interesting cut.
    data, layout, end = build_shard(fmt)
    failures = []
    for cut in interesting_cuts(layout, end):
        path = tmp_path / f"cut-{cut}.tar"
        path.write_bytes(data[:cut])
        want = expected_samples(expected_keys(layout, end, cut))
        for url in (str(path), fakes.url_of(path)):
            got, warned = collect(
                wds.WebDataset(
                    url, shardshuffle=False, handler=wds.warn_and_continue, empty_check=False
                )
            )
            if got != want or warned != (cut < end + 512):
                failures.append((cut, url[:9], [k for k, _ in got], [k for k, _ in want]))
    assert not failures


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT], ids=["ustar", "pax"])
def test_truncated_gzip_shard_keeps_every_complete_sample(fmt: int, tmp_path: Path) -> None:
    # A tar cut short and then gzipped: the gzip stream is fine, the tar inside is not.
    data, layout, end = build_shard(fmt)
    failures = []
    for cut in interesting_cuts(layout, end):
        path = tmp_path / f"cut-{cut}.tar.gz"
        path.write_bytes(gzip.compress(data[:cut], 1))
        want = expected_samples(expected_keys(layout, end, cut))
        got, _ = collect(
            wds.WebDataset(
                str(path), shardshuffle=False, handler=wds.warn_and_continue, empty_check=False
            )
        )
        if got != want:
            failures.append((cut, [k for k, _ in got], [k for k, _ in want]))
    assert not failures


class FailingSource:
    """A shard's bytes up to ``cut`` (in reads of at most 700 bytes), then the store's
    failure (a connection cut for good)."""

    def __init__(self, data: bytes, cut: int) -> None:
        self._data, self._cut, self._pos = data, cut, 0

    def read(self, size: int = -1) -> bytes:
        if self._pos >= self._cut:
            raise ShardOpenError("GET failed: connection cut", url=URL, offset=self._cut)
        end = min(self._cut, self._pos + (700 if size < 0 else min(size, 700)))
        data, self._pos = self._data[self._pos : end], end
        return data


def test_a_store_failing_mid_shard_keeps_every_complete_sample() -> None:
    # A read that fails (the store gave up) is not a truncation, but the rule is the same: the
    # sample being built is handed on when the error names a member of another sample.
    data, layout, end = build_shard(tarfile.USTAR_FORMAT)
    failures = []
    for cut in (cut for cut in interesting_cuts(layout, end) if cut < end):
        got: list[str] = []
        member: str | None = "(no error)"
        try:
            members = iter_members(FailingSource(data, cut), url=URL)
            got.extend(sample["__key__"] for sample in group_members(members, url=URL))
        except ShardOpenError as exc:
            member = exc.member
        inside = [name for name, _, at, size in layout if at <= cut < at + size + (-size % 512)]
        if got != expected_keys(layout, end, cut) or member != next(iter(inside), None):
            failures.append((cut, got, member))
    assert not failures


def test_cut_gzip_stream_keeps_every_complete_sample(tmp_path: Path) -> None:
    # The gzip stream itself cut short: the tar reader learns of it from the gunzip layer
    # while reading some member's data (named in the error) or a header (not named). Which
    # depends on zlib's buffering, so the rule is checked against the error itself.
    data, _, _ = build_shard(tarfile.USTAR_FORMAT)
    packed = gzip.compress(data, 1)
    keys = [f"k{i}" for i in range(len(BIN_SIZES))]
    named = 0
    for cut in range(40, len(packed), 37):
        path = tmp_path / f"cut-{cut}.tar.gz"
        path.write_bytes(packed[:cut])
        errors: list[BaseException] = []

        def handler(exn: BaseException, errors: list[BaseException] = errors) -> bool:
            errors.append(exn)
            return True

        got, _ = collect(
            wds.WebDataset(str(path), shardshuffle=False, handler=handler, empty_check=False)
        )
        assert len(errors) == 1
        exc = errors[0]
        assert isinstance(exc, ShardFormatError)
        assert "gzip" in str(exc)
        if exc.member is not None:
            # Every sample before the damaged member's, which itself is never delivered.
            named += 1
            assert got == expected_samples(keys[: keys.index(exc.member.split(".")[0])]), cut
        else:
            assert got == expected_samples(keys[: len(got)])
            assert len(got) < len(keys)
    assert named > 5


def test_member_table_path_keeps_the_samples_before_an_oversized_member(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A complete shard read once through the node cache gets a member table; a later reader
    # with a smaller member limit slices by the table and, its handler going on, drops only
    # the samples of the big members (k0 holds 1,300 bytes, k2 2,500).
    data, _, _ = build_shard(tarfile.USTAR_FORMAT)
    path = tmp_path / "shard.tar"
    path.write_bytes(data)
    url = fakes.url_of(path)
    cache_dir = tmp_path / "cache"
    first, _ = collect(wds.WebDataset(url, shardshuffle=False, cache_dir=str(cache_dir)))
    assert [key for key, _ in first] == ["k0", "k1", "k2", "k3"]
    assert list((cache_dir / "meta").glob("*.members.json"))
    import cloudshards.stages.read as read_module

    monkeypatch.setattr(read_module, "iter_members", None)  # the table alone must serve
    for limit, expected in [
        (2000, ["k0", "k1", "k3"]),
        (1000, ["k1", "k3"]),
        (2500, ["k0", "k1", "k2", "k3"]),
    ]:
        got, warned = collect(
            wds.WebDataset(
                url,
                shardshuffle=False,
                cache_dir=str(cache_dir),
                max_member_bytes=limit,
                handler=wds.warn_and_continue,
                empty_check=False,
            )
        )
        assert got == expected_samples(expected), limit
        assert warned == 4 - len(expected)  # one warning for each member too large


def test_a_compressed_sample_of_many_fields_is_bounded_as_a_whole(tmp_path: Path) -> None:
    """Each member is bounded by max_member_bytes, and a sample's fields together by twice
    that: a small .tar.gz cannot inflate many big fields into one sample (16 x 1 GiB from
    16 MB)."""
    path = tmp_path / "bomb.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        fields = [("k0", "a", 10_000), ("k1", "a", 30_000), ("k1", "b", 30_000)]
        fields += [("k2", f"f{n}", 30_000) for n in range(8)] + [("k3", "a", 10)]
        for key, field, size in fields:
            info = tarfile.TarInfo(f"{key}.{field}")
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
    assert path.stat().st_size < 5_000  # zeros compress: 300 KB in a few KB

    def read(**kw: Any) -> list[str]:
        ds = wds.WebDataset(str(path), shardshuffle=False, max_member_bytes=100_000, **kw)
        return [sample["__key__"] for sample in ds]

    with pytest.raises(ShardFormatError, match="sample 'k2' holds more than 200000 bytes") as info:
        read()
    assert info.value.member == "k2.f6"  # the seventh field crosses the limit
    assert path.name in str(info.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The samples before it are delivered, the over-limit one never is.
        assert read(handler=wds.warn_and_continue) == ["k0", "k1"]
