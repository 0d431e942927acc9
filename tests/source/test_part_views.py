"""Parts handed on as views (obstore's buffers, not copied into bytes): the tar reader slices
members out of them as bytes of their own; every other reader of the stream gets bytes."""

from __future__ import annotations

import concurrent.futures as cf
import gzip
import io
import tarfile
from collections.abc import Iterator
from typing import Any

import pytest

from cloudshards.cache.facts import Checksum
from cloudshards.source import FetchOptions, IOStats
from cloudshards.source.parts import PartStream
from cloudshards.tar import iter_members

PART = 64 << 10


class ViewSource:
    """A store object whose ranged reads come back as read-only views of one buffer."""

    url = "mem://bucket/shard.tar"

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.views = 0
        self.copies = 0

    def info(self, timeout: float | None = None) -> dict[str, int]:
        return {"size": len(self.data)}

    def cat_range(self, start: int, end: int, timeout: float | None = None) -> bytes:
        self.copies += 1
        return self.data[start:end]

    def cat_range_view(self, start: int, end: int) -> memoryview:
        self.views += 1
        return memoryview(self.data)[start:end]

    def cat(self) -> bytes:
        return self.data

    def open(self, block_bytes: int) -> io.BytesIO:
        return io.BytesIO(self.data)


def shard(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1.5  # a float: a PAX header before every member, as webdataset writes
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def executor() -> Iterator[cf.ThreadPoolExecutor]:
    with cf.ThreadPoolExecutor(4, thread_name_prefix="cloudshards-test") as pool:
        yield pool


def part_stream(source: ViewSource, executor: cf.ThreadPoolExecutor) -> PartStream:
    options = FetchOptions(part_bytes=PART, concurrency=4)
    stream = PartStream(source, source.info(), executor=executor, options=options, stats=IOStats())
    stream.start()
    return stream


# Members of every size around the parts' edges: small ones, one straddling each boundary, one
# larger than a part, and empty ones.
MEMBERS = [
    (f"s{i:03d}.{ext}", bytes([i % 251]) * size)
    for i, size in enumerate([0, 1, 511, 512, 513, 20_000, 70_000, 3, PART, 150_000] * 4)
    for ext in ("bin",)
]


@pytest.mark.parametrize("count", [len(MEMBERS), 5], ids=["many-parts", "one-part"])
@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_members_sliced_from_views_are_bytes_of_their_own(
    executor: cf.ThreadPoolExecutor, compress: bool, count: int
) -> None:
    data = shard(MEMBERS[:count])
    source = ViewSource(gzip.compress(data, mtime=0) if compress else data)
    stream = part_stream(source, executor)
    try:
        members = list(iter_members(stream, url=source.url, block_bytes=PART))
    finally:
        stream.close()
    assert [(m.name, m.data) for m in members] == MEMBERS[:count]
    assert all(type(m.data) is bytes for m in members)
    assert source.views >= max(1, len(source.data) // PART)  # the parts really came as views
    assert source.copies == 0


def test_read_gives_bytes(executor: cf.ThreadPoolExecutor) -> None:
    data = shard(MEMBERS)
    source = ViewSource(data)
    stream = part_stream(source, executor)
    pieces: list[bytes] = []
    try:
        while piece := stream.read():
            assert type(piece) is bytes
            pieces.append(piece)
    finally:
        stream.close()
    assert b"".join(pieces) == data
    assert source.views > 1


@pytest.mark.parametrize("md5", [False, True], ids=["by-length", "md5-verified"])
def test_a_download_into_the_cache_hands_parts_on_as_views(
    executor: cf.ThreadPoolExecutor, tmp_path: Any, md5: bool
) -> None:
    """Through the node cache's tee, parts are written to disk and parsed as the views they
    came as (no copy into bytes); the entry and the members are the object's bytes."""
    import hashlib

    from cloudshards.cache.stats import CacheStats
    from cloudshards.cache.tee import TeeStream

    data = shard(MEMBERS)
    source = ViewSource(data)
    committed: list[int] = []
    partial = tmp_path / "entry.partial"
    tee = TeeStream(
        part_stream(source, executor),
        str(partial),
        commit=lambda n: committed.append(n) is None,
        abandon=lambda: None,
        on_close=lambda: None,
        stats=CacheStats(),
        expected_size=len(data),
        checksum=Checksum("md5", hashlib.md5(data).hexdigest()) if md5 else None,
    )
    handed: list[type] = []
    read_view = tee.read_view

    def spy(size: int) -> bytes | memoryview:
        block = read_view(size)
        handed.append(type(block))
        return block

    tee.read_view = spy  # type: ignore[method-assign]
    try:
        members = list(iter_members(tee, url=source.url, block_bytes=PART))
    finally:
        tee.close()
    assert [(m.name, m.data) for m in members] == MEMBERS
    assert all(type(m.data) is bytes for m in members)
    assert source.copies == 0
    assert source.views >= len(data) // PART
    # Every part reached the reader as a view (bar the verified tail, held back as bytes).
    assert handed.count(memoryview) >= len(data) // PART - 1
    assert committed == [len(data)]
    assert partial.read_bytes() == data


class ConditionalSource(ViewSource):
    """A source whose ranged GETs can be conditional on the ETag (as obstore's and HTTP's)."""

    conditional = True

    def __init__(self, data: bytes, etag: str) -> None:
        super().__init__(data)
        self.etag = etag
        self.conditions: list[str | None] = []

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        return {"size": len(self.data), "ETag": self.etag}

    def cat_range_view(self, start: int, end: int, if_match: str | None = None) -> memoryview:
        self.conditions.append(if_match)
        return super().cat_range_view(start, end)


@pytest.mark.parametrize(
    ("etag", "setting", "sent"),
    [
        ('"abc"', None, '"abc"'),
        ('W/"abc"', None, None),  # a weak ETag never matches If-Match
        ('"abc"', "0", None),  # CLOUDSHARDS_IF_MATCH=0
    ],
)
def test_parts_ask_for_the_first_answers_etag(
    executor: cf.ThreadPoolExecutor,
    monkeypatch: pytest.MonkeyPatch,
    etag: str,
    setting: str | None,
    sent: str | None,
) -> None:
    if setting is None:
        monkeypatch.delenv("CLOUDSHARDS_IF_MATCH", raising=False)
    else:
        monkeypatch.setenv("CLOUDSHARDS_IF_MATCH", setting)
    data = shard(MEMBERS)
    source = ConditionalSource(data, etag)
    stream = part_stream(source, executor)
    assert b"".join(bytes(stream.read_view()) for _ in range(len(data) // PART + 2)) == data
    assert len(source.conditions) == -(-len(data) // PART)
    assert set(source.conditions) == {sent}
