"""Decompression bombs: gzip, .npz and .npy fields inflate at most to the decode limit, with
memory bounded by that limit (not by the bomb), and images keep Pillow's pixel limit."""

from __future__ import annotations

import contextlib
import gzip
import io
import struct
import tarfile
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cloudshards as wds
from cloudshards.decoders import Decoder, gzfilter, make_decoder, npy_loads, npz_loads
from cloudshards.errors import DecodeError
from cloudshards.imagedecode import decode_image

MiB = 1 << 20


def gz_bomb(size: int) -> bytes:
    return gzip.compress(b"\0" * size, compresslevel=9, mtime=0)


def npz_bytes(**arrays: Any) -> bytes:
    out = io.BytesIO()
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def npy_bytes(array: Any) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def npy_declaring(shape: tuple[int, ...], payload: bytes) -> bytes:
    """A float64 ``.npy`` whose header declares ``shape`` but whose data is ``payload``."""
    out = io.BytesIO()
    header = {"descr": "<f8", "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue() + payload


def peak_bytes(call: Callable[[], Any]) -> int:
    """Peak traced allocation while ``call`` runs (it may raise DecodeError)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with contextlib.suppress(DecodeError):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> str:
    with tarfile.open(path, "w") as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


# -------------------------------------------------------------------------------------- gzip


def test_gz_bomb_stops_at_the_pipelines_member_limit(tmp_path: Path) -> None:
    bomb = gz_bomb(64 * MiB)
    assert len(bomb) < MiB  # the member itself passes max_member_bytes
    url = write_shard(tmp_path / "bomb.tar", [("ok", {"txt": b"fine"}), ("boom", {"txt.gz": bomb})])
    ds = wds.WebDataset(url, shardshuffle=False, max_member_bytes=MiB).decode()
    it = iter(ds)
    assert next(it)["txt"] == "fine"
    with pytest.raises(DecodeError) as info:
        next(it)
    assert (info.value.key, info.value.field) == ("boom", "txt.gz")
    message = str(info.value)
    assert "1,048,576" in message
    assert "max_member_bytes" in message


def test_gz_bomb_memory_is_bounded_by_the_limit_not_the_bomb() -> None:
    bomb = gz_bomb(64 * MiB)
    decoder = Decoder([], max_bytes=MiB)
    sample = {"__key__": "k", "txt.gz": bomb}
    with pytest.raises(DecodeError, match="decode limit"):
        decoder(sample)
    assert peak_bytes(lambda: decoder(sample)) < 8 * MiB


def test_gz_up_to_the_limit_decodes_like_gzip() -> None:
    text = b"x" * MiB
    decoder = Decoder([], max_bytes=MiB)
    assert decoder({"__key__": "k", "txt.gz": gzip.compress(text)})["txt.gz"] == text.decode()
    # Several members and trailing zero padding, as gzip.decompress accepts them.
    joined = gzip.compress(b"ab") + gzip.compress(b"cd") + b"\0" * 7
    assert decoder.decode1("bin.gz", joined) == b"abcd" == gzip.decompress(joined)
    with pytest.raises(DecodeError):
        decoder({"__key__": "k", "txt.gz": gzip.compress(text + b"y")})


@pytest.mark.parametrize(
    "bad",
    [gzip.compress(b"hello")[:-3], b"not gzip at all", gzip.compress(b"a") + b"garbage!!"],
    ids=["truncated", "not-gzip", "trailing-garbage"],
)
def test_corrupt_gzip_is_a_decode_error(bad: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        Decoder([]).decode({"__key__": "k", "txt.gz": bad})
    assert info.value.field == "txt.gz"


def test_gzfilter_alone_uses_the_default_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDSHARDS_MAX_DECODED_BYTES", str(MiB))
    with pytest.raises(DecodeError, match="CLOUDSHARDS_MAX_DECODED_BYTES"):
        gzfilter(".txt.gz", gz_bomb(4 * MiB))
    bomb = gz_bomb(32 * MiB)
    assert peak_bytes(lambda: gzfilter(".txt.gz", bomb)) < 8 * MiB
    result = gzfilter(".txt.gz", gzip.compress(b"small"))
    assert result is not None
    assert result.data == b"small"


def test_decode_max_bytes_overrides_the_member_limit(tmp_path: Path) -> None:
    payload = gzip.compress(b"y" * (2 * MiB))
    url = write_shard(tmp_path / "a.tar", [("big", {"txt.gz": payload})])
    strict = wds.WebDataset(url, shardshuffle=False, max_member_bytes=MiB)
    with pytest.raises(DecodeError):
        list(strict.decode())
    (sample,) = list(strict.decode(max_bytes=4 * MiB))
    assert len(sample["txt.gz"]) == 2 * MiB


def test_environment_sets_the_default_decode_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = write_shard(tmp_path / "a.tar", [("big", {"txt.gz": gz_bomb(2 * MiB)})])
    assert len(next(iter(wds.WebDataset(url, shardshuffle=False).decode()))["txt.gz"]) == 2 * MiB
    monkeypatch.setenv("CLOUDSHARDS_MAX_DECODED_BYTES", str(MiB))
    with pytest.raises(DecodeError, match="decode limit"):
        list(wds.WebDataset(url, shardshuffle=False).decode())
    with pytest.raises(DecodeError):
        list(wds.WebDataset(url, shardshuffle=False).compose(wds.decode()))


# --------------------------------------------------------------------------------------- npz


def test_npz_bomb_is_refused_before_inflating() -> None:
    bomb = npz_bytes(a=np.zeros(32 * MiB, np.uint8))
    assert len(bomb) < MiB
    decoder = Decoder([], max_bytes=MiB)
    sample = {"__key__": "k", "npz": bomb}
    with pytest.raises(DecodeError, match="decode limit") as info:
        decoder(sample)
    assert (info.value.key, info.value.field) == ("k", "npz")
    assert peak_bytes(lambda: decoder(sample)) < 4 * MiB


def test_npz_limit_counts_all_members() -> None:
    data = npz_bytes(a=np.zeros(600_000, np.uint8), b=np.zeros(600_000, np.uint8))
    with pytest.raises(DecodeError, match="decode limit"):
        Decoder([], max_bytes=MiB).decode1("npz", data)
    loaded = Decoder([], max_bytes=2 * MiB).decode1("npz", data)
    assert sorted(loaded) == ["a", "b"]
    assert loaded["a"].shape == (600_000,)


def _patch_sizes(data: bytes, name: str, new_size: int) -> bytes:
    """Make the zip declare ``new_size`` uncompressed bytes for ``name`` (central directory and
    local header), leaving the compressed data as it is."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo(name)
    out = bytearray(data)
    struct.pack_into("<I", out, info.header_offset + 22, new_size)
    central = bytes(out).find(b"PK\x01\x02")
    while central != -1:
        (length,) = struct.unpack_from("<H", out, central + 28)
        if bytes(out[central + 46 : central + 46 + length]) == name.encode():
            struct.pack_into("<I", out, central + 24, new_size)
        central = bytes(out).find(b"PK\x01\x02", central + 4)
    return bytes(out)


def test_npz_member_inflating_past_its_declared_size_is_refused() -> None:
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("blob", b"\0" * (32 * MiB))
        archive.writestr("a.npy", npy_bytes(np.arange(10)))
    lying = _patch_sizes(raw.getvalue(), "blob", 1000)
    decoder = Decoder([], max_bytes=MiB)
    sample = {"__key__": "k", "npz": lying}
    with pytest.raises(DecodeError, match="CRC"):
        decoder(sample)
    assert peak_bytes(lambda: decoder(sample)) < 4 * MiB


def test_npz_npy_member_with_a_huge_shape_is_refused() -> None:
    header = npy_declaring((100_000_000,), bytes(80))
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("a.npy", header)
    data = raw.getvalue()
    with pytest.raises(DecodeError, match="declares"):
        Decoder([]).decode1("npz", data)
    assert peak_bytes(lambda: npz_loads(data)) < 4 * MiB


def test_npz_still_loads_and_refuses_object_arrays() -> None:
    data = npz_bytes(a=np.arange(6).reshape(2, 3), b=np.array([1.5]))
    loaded = npz_loads(data)
    assert loaded["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert loaded["b"].tolist() == [1.5]
    with pytest.raises(ValueError, match="allow_pickle"):
        npz_loads(npz_bytes(o=np.array([{"a": 1}], dtype=object)))


# --------------------------------------------------------------------------------------- npy


def test_npy_with_a_huge_shape_header_is_refused_before_allocating() -> None:
    lying = npy_declaring((16_777_216,), bytes(80))
    with pytest.raises(DecodeError, match="declares 134,217,728 bytes"):
        npy_loads(lying)
    assert peak_bytes(lambda: npy_loads(lying)) < MiB
    with pytest.raises(DecodeError) as info:
        Decoder([]).decode({"__key__": "k", "npy": lying})
    assert info.value.field == "npy"


def test_npy_over_the_limit_is_refused_and_within_it_loads() -> None:
    array = np.arange(300_000, dtype=np.int32)  # 1.2 MB
    with pytest.raises(DecodeError, match="decode limit"):
        Decoder([], max_bytes=MiB).decode1("npy", npy_bytes(array))
    loaded = Decoder([], max_bytes=2 * MiB).decode1("npy", npy_bytes(array))
    assert np.array_equal(loaded, array)
    assert loaded.flags.writeable
    fortran = np.asfortranarray(np.arange(12).reshape(3, 4))
    assert np.array_equal(npy_loads(npy_bytes(fortran)), fortran)


def test_npy_gz_is_bounded_at_both_steps() -> None:
    data = gzip.compress(npy_bytes(np.zeros(4 * MiB, np.uint8)))
    with pytest.raises(DecodeError, match="decode limit"):
        Decoder([], max_bytes=MiB).decode1("npy.gz", data)
    assert Decoder([], max_bytes=8 * MiB).decode1("npy.gz", data).shape == (4 * MiB,)


def test_pth_zip_is_bounded_by_its_declared_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    out = io.BytesIO()
    torch.save({"w": torch.zeros(300_000)}, out)  # 1.2 MB of storage
    data = out.getvalue()
    monkeypatch.setenv("CLOUDSHARDS_MAX_DECODED_BYTES", str(MiB))
    with pytest.raises(DecodeError, match="decode limit") as info:
        Decoder([]).decode({"__key__": "k", "pth": data})
    assert info.value.field == "pth"
    monkeypatch.setenv("CLOUDSHARDS_MAX_DECODED_BYTES", str(2 * MiB))
    assert Decoder([]).decode1("pth", data)["w"].shape == (300_000,)


# ------------------------------------------------------------------------------------ images


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels (Pillow reads only the header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_image_bomb_is_a_decode_error() -> None:
    bomb = png_header(40_000, 40_000)
    with pytest.raises(DecodeError, match="MAX_IMAGE_PIXELS") as info:
        decode_image(bomb, "rgb8")
    assert "1600000000 pixels" in str(info.value)
    with pytest.raises(DecodeError) as info:
        make_decoder("rgb8")({"__key__": "k", "png": bomb})
    assert (info.value.key, info.value.field) == ("k", "png")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, at open
def test_an_image_over_max_image_pixels_is_refused_not_only_warned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pillow only warns between MAX_IMAGE_PIXELS and twice that, and decodes: refused here
    from the header (as docs/security.md says), at the limit itself."""
    import PIL.Image

    def png(width: int, height: int) -> bytes:
        out = io.BytesIO()
        PIL.Image.new("RGB", (width, height)).save(out, format="PNG")
        return out.getvalue()

    small, large = png(10, 10), png(11, 10)
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 100)
    assert decode_image(small, "rgb8").shape == (10, 10, 3)
    with pytest.raises(DecodeError, match="11x10 = 110 pixels is over the limit"):
        decode_image(large, "rgb8")
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", None)  # turned off
    assert decode_image(large, "rgb8").shape == (10, 11, 3)
