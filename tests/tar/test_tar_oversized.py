"""A member over ``max_member_bytes`` in an intact archive, read with ``skip_oversized``: its
error comes in its place, its data is skipped without being read into memory (plain or
compressed), and every member after it is read as usual."""

from __future__ import annotations

import gzip
import io
import tarfile
import tracemalloc
from typing import Any

import pytest
from test_tar import STREAMS, write_tar

from cloudshards.errors import ShardFormatError
from cloudshards.tar import iter_members
from cloudshards.types import Member, Oversized

URL = "s3://bucket/shard-000007.tar"
BIG = ("s003.a", bytes(range(250)) * 20)  # 5,000 bytes, over a limit of 4096
MEMBERS = [
    BIG if (i, f) == (3, "a") else (f"s{i:03d}.{f}", f"{f}{i}".encode() * (i + 1))
    for i in range(10)
    for f in ("a", "b")
]
FORMATS = {"ustar": tarfile.USTAR_FORMAT, "pax": tarfile.PAX_FORMAT}


def layout(data: bytes) -> dict[str, tuple[int, int]]:
    """(its own header's offset, its data's offset) of each member, as tarfile finds them."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: (m.offset_data - 512, m.offset_data) for m in tar.getmembers()}


def opened(data: bytes, stream: str, compressed: bool) -> Any:
    return STREAMS[stream](gzip.compress(data, 1) if compressed else data)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("compressed", [False, True], ids=["tar", "tar.gz"])
@pytest.mark.parametrize("block_bytes", [512, 1000, 4 << 20])
@pytest.mark.parametrize("stream", STREAMS)
def test_the_error_comes_in_the_members_place_and_the_rest_is_read(
    fmt: int, compressed: bool, block_bytes: int, stream: str
) -> None:
    data = write_tar(MEMBERS, fmt)
    got = list(
        iter_members(
            opened(data, stream, compressed),
            url=URL,
            max_member_bytes=4096,
            block_bytes=block_bytes,
            skip_oversized=True,
        )
    )
    at = MEMBERS.index(BIG)
    assert [(m.name, m.data) for m in got[:at] + got[at + 1 :]] == MEMBERS[:at] + MEMBERS[at + 1 :]
    marker = got[at]
    assert marker.name == ""
    assert isinstance(marker.data, Oversized)
    assert marker.data.name == "s003.a"
    header_at, data_at = layout(data)["s003.a"]
    assert marker.offset == data_at
    error = marker.data.error
    assert isinstance(error, ShardFormatError)
    assert (error.url, error.member, error.offset) == (URL, "s003.a", header_at)
    assert "member of 5000 bytes exceeds max_member_bytes=4096" in str(error)
    # Without it, that error ends the iteration there, as before.
    plain = iter_members(opened(data, stream, compressed), url=URL, max_member_bytes=4096)
    with pytest.raises(ShardFormatError) as info:
        for _ in plain:
            pass
    assert str(info.value) == str(error)
    assert (info.value.member, info.value.offset) == (error.member, error.offset)


def test_the_error_names_the_member_as_in_the_archive_and_the_place_as_renamed() -> None:
    data = write_tar(MEMBERS)
    got = list(
        iter_members(
            io.BytesIO(data),
            url=URL,
            name_filter=lambda name: "renamed/" + name if name.endswith(".a") else None,
            max_member_bytes=4096,
            skip_oversized=True,
        )
    )
    markers = [m for m in got if isinstance(m.data, Oversized)]
    assert len(got) == 10
    assert len(markers) == 1
    assert markers[0].data.name == "renamed/s003.a"
    assert markers[0].data.error.member == "s003.a"
    assert [m.name for m in got if m not in markers] == [
        f"renamed/s{i:03d}.a" for i in range(10) if i != 3
    ]


class Counting:
    """A non-seekable stream that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        self._inner = io.BytesIO(data)
        self.taken = 0

    def read(self, size: int) -> bytes:
        chunk = self._inner.read(size)
        self.taken += len(chunk)
        return chunk


def test_the_data_is_skipped_only_when_the_iteration_goes_on() -> None:
    """A caller that stops at the error (the default handler) reads nothing of the member."""
    data = write_tar([("a.x", b"a"), ("b.x", bytes(1 << 20)), ("c.x", b"c")], tarfile.USTAR_FORMAT)
    stream = Counting(data)
    members = iter_members(stream, max_member_bytes=4096, block_bytes=512, skip_oversized=True)
    assert next(members).name == "a.x"
    marker = next(members)
    assert isinstance(marker.data, Oversized)
    members.close()
    assert stream.taken < 4096
    stream = Counting(data)
    rest = list(iter_members(stream, max_member_bytes=4096, block_bytes=512, skip_oversized=True))
    assert [m.name for m in rest] == ["a.x", "", "c.x"]
    assert stream.taken > 1 << 20  # read past it (in blocks), to the end of the archive


@pytest.mark.parametrize("compressed", [False, True], ids=["pipe", "gzip"])
def test_a_skipped_member_is_never_held_in_memory(compressed: bool) -> None:
    """48 MiB of zeros, over a limit of 1 MiB: read (inflated) in blocks and let go."""
    big = 48 << 20
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, size in (("a.x", 10), ("b.x", big), ("c.x", 10)):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
    data = buffer.getvalue()
    if compressed:
        data = gzip.compress(data, 1)
    del buffer
    tracemalloc.start()
    try:
        got = [
            (m.name, len(m.data) if isinstance(m.data, bytes) else m.data.name)
            for m in iter_members(
                STREAMS["nonseekable"](data),
                max_member_bytes=1 << 20,
                block_bytes=1 << 20,
                skip_oversized=True,
            )
        ]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [("a.x", 10), ("", "b.x"), ("c.x", 10)]
    assert peak < 8 << 20, f"peak {peak:,} bytes"


def test_an_archive_that_ends_inside_the_skipped_member_says_so() -> None:
    data = write_tar([("a.x", b"a"), ("b.x", bytes(20_000))], tarfile.USTAR_FORMAT)
    members = iter_members(
        io.BytesIO(data[:5000]), url=URL, max_member_bytes=4096, skip_oversized=True
    )
    assert next(members).name == "a.x"
    assert isinstance(next(members).data, Oversized)
    with pytest.raises(ShardFormatError, match="truncated tar") as info:
        next(members)
    assert info.value.member == "b.x"


def test_the_marker_is_a_member() -> None:
    # group_members unpacks it as (name, data, offset) and finds no key in its name.
    error = ShardFormatError("too large", url=URL, member="k.x", offset=0)
    marker = Member("", Oversized("k.x", error), 512)  # type: ignore[arg-type]
    name, data, offset = marker
    assert (name, data.name, data.error, offset) == ("", "k.x", error, 512)
