"""bzip2 and xz shards (``.tar.bz2``, ``.tar.xz``): read as webdataset reads them (through
tarfile's ``r|*``), with the gzip reader's guarantees: bounded output, every stream's own check
made, truncation and damage raised with the shard named. gzip itself is tested in test_tar.py."""

from __future__ import annotations

import bz2
import io
import lzma
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from test_tar import write_tar

import cloudshards as wds
from cloudshards.errors import ShardFormatError
from cloudshards.tar import decompress, iter_members

MEMBERS = [
    ("a/000.bin", bytes(range(256)) * 9),
    ("a/000.json", b'{"x": 1}'),
    ("b/001.bin", b"\x01" * 5000),
    ("b/001.json", b'{"x": 2}'),
    ("empty.txt", b""),
]

COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "bzip2": bz2.compress,
    "xz": lzma.compress,
}


# Without PAX headers: a tar's first bytes are its first member's name (see the bzip2 test).
tar_of = partial(write_tar, float_mtime=False)


class Pipe:
    """read() only, in pieces of at most ``most`` bytes (a socket, an HTTP body)."""

    def __init__(self, data: bytes, most: int = 1 << 30) -> None:
        self._inner = io.BytesIO(data)
        self._most = most

    def read(self, size: int) -> bytes:
        return self._inner.read(min(size, self._most))


def read(data: bytes, **kw: Any) -> list[tuple[str, bytes]]:
    return [(m.name, m.data) for m in iter_members(Pipe(data), url="s3://b/s.tar.x", **kw)]


@pytest.fixture(params=sorted(COMPRESSORS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("block_bytes", [512, 1000, 4 << 20])
def test_round_trip(kind: str, block_bytes: int) -> None:
    raw = tar_of(MEMBERS)
    assert read(COMPRESSORS[kind](raw), block_bytes=block_bytes) == MEMBERS


def test_detected_whatever_the_first_read_returns(kind: str) -> None:
    packed = COMPRESSORS[kind](tar_of(MEMBERS))
    got = [(m.name, m.data) for m in iter_members(Pipe(packed, most=1), block_bytes=512)]
    assert got == MEMBERS


def test_concatenated_streams_with_zero_padding(kind: str) -> None:
    raw = tar_of(MEMBERS)
    compress = COMPRESSORS[kind]
    packed = compress(raw[:3000]) + bytes(8) + compress(raw[3000:]) + bytes(100)
    assert read(packed, block_bytes=700) == MEMBERS


def test_offsets_are_those_of_the_tar(kind: str) -> None:
    raw = tar_of(MEMBERS)
    for item in iter_members(Pipe(COMPRESSORS[kind](raw)), block_bytes=512):
        assert raw[item.offset : item.offset + len(item.data)] == item.data


@pytest.mark.parametrize("cut", [12, 100, -1, -12])
def test_truncated_raises_naming_the_shard(kind: str, cut: int) -> None:
    packed = COMPRESSORS[kind](tar_of(MEMBERS))
    with pytest.raises(ShardFormatError, match=f"truncated {kind} stream") as info:
        read(packed[:cut])
    assert info.value.url == "s3://b/s.tar.x"


def test_damage_raises(kind: str) -> None:
    packed = bytearray(COMPRESSORS[kind](tar_of(MEMBERS)))
    packed[len(packed) // 2] ^= 0xFF
    with pytest.raises(ShardFormatError, match=f"corrupt {kind} stream"):
        read(bytes(packed))


def test_trailing_garbage_loses_no_member_and_is_named_in_a_warning(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes after a whole, verified stream that start no other stream (an upload tool's
    padding, an appended signature): every member is read, as gzip(1) and webdataset (which
    stops at the end of the archive) read them, and a warning names the shard. It raised, and
    the last sample, complete, was lost with the error."""
    packed = COMPRESSORS[kind](tar_of(MEMBERS)) + b"not another stream, just garbage"
    with caplog.at_level("WARNING", logger="cloudshards"):
        assert read(packed) == read(COMPRESSORS[kind](tar_of(MEMBERS)))
    assert f"s3://b/s.tar.x: what follows its {kind} stream is not {kind} data" in caplog.text


def test_a_second_stream_after_the_first_is_still_read(kind: str) -> None:
    """``cat a.gz b.gz``: a stream that follows is read on (padding of zeros between them)."""
    whole = tar_of(MEMBERS)
    packed = COMPRESSORS[kind](whole[:1024]) + bytes(7) + COMPRESSORS[kind](whole[1024:])
    assert read(packed) == read(COMPRESSORS[kind](whole))


def test_a_bomb_comes_out_in_bounded_pieces(kind: str) -> None:
    packed = COMPRESSORS[kind](bytes(64 << 20))
    assert len(packed) < 100_000
    reader = decompress.DecompressReader(Pipe(packed[10:]), packed[:10], None, 1 << 16, kind)
    pieces = [len(reader.read(1 << 30)) for _ in range(50)]
    assert max(pieces) <= 1 << 16
    assert sum(pieces) == 50 << 16


def test_an_xz_stream_asking_for_too_much_memory_is_refused() -> None:
    dictionary = decompress.XZ_MEMORY_LIMIT * 2  # a hostile header: lzma would allocate it
    filters = [{"id": lzma.FILTER_LZMA2, "dict_size": dictionary}]
    packed = lzma.compress(tar_of(MEMBERS), format=lzma.FORMAT_XZ, filters=filters)
    with pytest.raises(ShardFormatError, match=r"refused: the xz stream needs more than 256 MiB"):
        read(packed)


def test_a_tar_whose_first_member_looks_like_bzip2_is_a_tar() -> None:
    # tarfile's r|* takes any stream starting "BZh91" for bzip2; the block magic after the
    # level tells them apart.
    members = [("BZh91.bin", b"not bzip2"), ("BZh9.txt", b"nor this")]
    assert read(tar_of(members)) == members
    assert decompress.compression_of(bz2.compress(b"x")[:10]) == "bzip2"
    assert decompress.compression_of(bz2.compress(b"")[:10]) == "bzip2"
    assert decompress.compression_of(b"BZh9.txt\0\0") is None


def test_plain_and_gzip_tars_never_touch_bz2_or_lzma(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("bz2 or lzma used")

    monkeypatch.setattr(bz2, "BZ2Decompressor", boom)
    monkeypatch.setattr(lzma, "LZMADecompressor", boom)
    assert read(tar_of(MEMBERS)) == MEMBERS


@pytest.mark.parametrize("suffix", ["tar.bz2", "tar.xz"])
def test_webdataset_reads_what_its_tarwriter_writes(tmp_path: Path, suffix: str) -> None:
    """webdataset 1.0.2 reads .tar.bz2 and .tar.xz shards; cloudshards' TarWriter writes them."""
    path = tmp_path / f"shard.{suffix}"
    with wds.TarWriter(str(path)) as sink:
        for i in range(5):
            sink.write({"__key__": f"{i:03d}", "txt": f"sample {i}", "cls": i})
    assert path.read_bytes()[:3] in (b"BZh", b"\xfd7z")
    got = [(s["__key__"], s["txt"], s["cls"]) for s in wds.WebDataset(str(path)).decode()]
    assert got == [(f"{i:03d}", f"sample {i}", i) for i in range(5)]


def test_a_stream_inflating_past_the_limit_is_refused(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few hundred bytes that inflate to gigabytes (of members a filter skips, even) kept a
    worker busy for an hour: past the floor, more than MAX_INFLATION times the compressed
    size is a ShardFormatError naming the shard; CLOUDSHARDS_MAX_INFLATION raises it."""
    monkeypatch.setattr(decompress, "INFLATION_FLOOR", 1 << 20)
    zeros = tar_of([("__meta__.bin", bytes(8 << 20)), ("k.txt", b"v")])
    packed = COMPRESSORS[kind](zeros)
    ratio = len(zeros) // len(packed)
    monkeypatch.setenv("CLOUDSHARDS_MAX_INFLATION", str(ratio // 2))
    with pytest.raises(ShardFormatError, match="inflates over") as info:
        read(packed)
    assert info.value.url == "s3://b/s.tar.x"
    monkeypatch.setenv("CLOUDSHARDS_MAX_INFLATION", str(ratio * 2))
    assert [name for name, _ in read(packed)] == ["__meta__.bin", "k.txt"]
