"""The one-GET obstore stream (index building, counting, a cache taking a download over): reads
of at most ``block_bytes``, every byte that arrived before a failure handed on, the failure
raised after them and from then on, and resumed reads of stores that ignore Range."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from cloudshards.source import adapt
from cloudshards.source.objread import ObstoreReader

DATA = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture
def source() -> Iterator[Any]:
    from obstore.store import MemoryStore

    store = MemoryStore()
    store.put("shard.tar", DATA)
    yield SimpleNamespace(store=store, key="shard.tar", url="memory://bucket/shard.tar")
    adapt.UNRANGED_HOSTS.discard(adapt.host_key("memory://bucket/shard.tar"))


def read_all(reader: ObstoreReader, size: int) -> tuple[bytes, list[int]]:
    data, sizes = b"", []
    while chunk := reader.read(size):
        data += chunk
        sizes.append(len(chunk))
    return data, sizes


def pieces_then(pieces: list[bytes], error: Exception | None) -> Iterator[bytes]:
    yield from pieces
    if error is not None:
        raise error


def test_sized_reads_return_at_most_block_bytes(source: Any) -> None:
    reader = ObstoreReader(source, block_bytes=5000)
    data, sizes = read_all(reader, 1 << 20)
    assert data == DATA
    assert max(sizes) <= 5000
    assert ObstoreReader(source, block_bytes=5000).read() == DATA  # all of it: no bound


def test_a_failure_ends_a_read_with_the_bytes_before_it_then_is_raised_from_then_on(
    source: Any,
) -> None:
    reader = ObstoreReader(source, block_bytes=1 << 20)
    cut = ConnectionError("connection reset")
    reader._chunks = pieces_then([b"abc", b"defg"], cut)  # the answer's pieces, then a cut
    assert reader.read(100) == b"abcdefg"
    for _ in range(2):  # never a quiet end after it
        with pytest.raises(ConnectionError, match="connection reset"):
            reader.read(100)


def test_a_failure_before_any_byte_of_a_read_is_raised_at_once(source: Any) -> None:
    reader = ObstoreReader(source, block_bytes=4)
    reader._chunks = pieces_then([b"abcd"], ConnectionError("reset"))
    assert reader.read(100) == b"abcd"  # a whole read's worth before the cut
    with pytest.raises(ConnectionError):
        reader.read(100)


def test_reading_everything_never_ends_short_on_a_failure(source: Any) -> None:
    """read() with no size means "to the end": a short answer would be taken for it."""
    reader = ObstoreReader(source, block_bytes=1 << 20)
    reader._chunks = pieces_then([b"abc", b"def"], ConnectionError("reset"))
    with pytest.raises(ConnectionError):
        reader.read()


def test_pieces_larger_than_a_read_are_split_without_loss(source: Any) -> None:
    reader = ObstoreReader(source, block_bytes=1 << 20)
    reader._chunks = pieces_then([b"abcdefgh", b"", b"ij"], None)
    assert [reader.read(3) for _ in range(5)] == [b"abc", b"def", b"ghi", b"j", b""]


def test_a_resumed_read_starts_at_its_offset(source: Any) -> None:
    reader = ObstoreReader(source, block_bytes=1 << 20)
    reader.seek(1000)
    assert reader.read() == DATA[1000:]


def test_a_resumed_read_of_a_store_that_ignores_range_drops_the_prefix(source: Any) -> None:
    adapt.UNRANGED_HOSTS.add(adapt.host_key(source.url))
    reader = ObstoreReader(source, block_bytes=1 << 20)
    reader.seek(1000)
    assert reader.read(600) == DATA[1000:1600]
    assert reader.read() == DATA[1600:]


def test_a_resumed_read_past_the_end_of_a_store_that_ignores_range_fails(source: Any) -> None:
    """The object is shorter than the bytes already read: no clean end there."""
    adapt.UNRANGED_HOSTS.add(adapt.host_key(source.url))
    reader = ObstoreReader(source, block_bytes=1 << 20)
    reader.seek(len(DATA) + 10)
    with pytest.raises(ConnectionError, match="shorter than before"):
        reader.read(100)
