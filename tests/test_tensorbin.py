"""webdataset's tenbin format (.ten/.tb fields): written and read as webdataset 1.0.2 does, and
checked before any array is made (a hostile field is a DecodeError, not a huge allocation)."""

from __future__ import annotations

import struct
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset

import cloudshards as wds
from cloudshards import tensorbin as tenbin
from cloudshards.errors import DecodeError

ARRAYS = [
    np.arange(24, dtype="float32").reshape(2, 3, 4),
    np.array([1, -2, 3], dtype="int64"),
    np.zeros((0, 5), dtype="uint8"),
    np.array([1.5], dtype="float16"),
    np.arange(6, dtype="uint16").reshape(3, 2),
]


def test_every_type_webdataset_writes_round_trips_byte_for_byte() -> None:
    ours = bytes(tenbin.encode_buffer(ARRAYS))
    assert ours == bytes(webdataset.tenbin.encode_buffer(ARRAYS))
    for got, want in zip(tenbin.decode_buffer(ours), ARRAYS, strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    # A 0-d array and an uint32 one read back too (webdataset cannot decode the first, and
    # reads u4 with a misspelt dtype name: cloudshards writes neither u4 nor refuses 0-d).
    scalar = tenbin.decode_buffer(tenbin.encode_buffer([np.array(3.5)]))[0]
    assert scalar.shape == ()
    assert float(scalar) == 3.5
    with pytest.raises(ValueError, match="uint32"):
        tenbin.encode_buffer([np.zeros(2, dtype="uint32")])


def test_fields_decode_in_a_pipeline_and_encode_in_a_writer(tmp_path: Path) -> None:
    path = str(tmp_path / "ten-000000.tar")
    with wds.TarWriter(path) as sink:
        sink.write({"__key__": "a", "ten": ARRAYS, "tb": ARRAYS[0]})
    (sample,) = list(wds.WebDataset(path).decode())
    for got, want in zip(sample["ten"], ARRAYS, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(sample["tb"][0], ARRAYS[0])
    # webdataset 1.0.2's decoder reads the field cloudshards wrote the same way.
    with tarfile.open(path) as tar:
        member = tar.extractfile("a.ten")
        assert member is not None
        theirs = webdataset.autodecode.tenbin_loads(member.read())
    for got, want in zip(theirs, ARRAYS, strict=True):
        np.testing.assert_array_equal(got, want)


def _chunk(data: bytes, length: int | None = None) -> bytes:
    size = len(data) if length is None else length
    return (
        tenbin.MAGIC + struct.pack("<q", size) + data + bytes(tenbin.roundup(len(data)) - len(data))
    )


def _header(code: str, shape: tuple[int, ...], rank: int | None = None) -> bytes:
    values = [tenbin.str64(code), 0, len(shape) if rank is None else rank, *shape]
    return np.array(values, dtype="<i8").tobytes()


@pytest.mark.parametrize(
    ("field", "message"),
    [
        (b"~TenBix~" + bytes(8), "no chunk"),
        (tenbin.MAGIC + struct.pack("<q", 10**12), "a chunk of"),
        (tenbin.MAGIC + struct.pack("<q", -5), "a chunk of"),
        (_chunk(_header("f4", (1 << 40, 1 << 20))) + _chunk(bytes(16)), "needs"),
        (_chunk(_header("f4", (2,), rank=60)) + _chunk(bytes(8)), "dimensions"),
        (_chunk(_header("zz", (2,))) + _chunk(bytes(8)), "unknown array type"),
        (_chunk(_header("f4", (-3,))) + _chunk(bytes(8)), "negative"),
        (_chunk(_header("f4", (2,))), "without its data"),
        (_chunk(bytes(12)) + _chunk(bytes(8)), "header of 12 bytes"),
    ],
    ids=[
        "magic",
        "huge-length",
        "negative-length",
        "huge-shape",
        "rank",
        "dtype",
        "dim",
        "odd",
        "short",
    ],
)
def test_hostile_fields_are_decode_errors(tmp_path: Path, field: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tenbin.decode_buffer(field)
    path = str(tmp_path / "bad-000000.tar")
    with wds.TarWriter(path) as sink:
        sink.write({"__key__": "bad", "ten": field})
    with pytest.raises(DecodeError, match="ten"):
        list(wds.WebDataset(path).decode())


def test_decoded_arrays_are_views_of_the_field(tmp_path: Any) -> None:
    data = bytes(tenbin.encode_buffer([np.arange(1000, dtype="float64")]))
    (array,) = tenbin.decode_buffer(data)
    assert not array.flags.owndata  # no copy was made
    assert not array.flags.writeable
