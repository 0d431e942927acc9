"""A sample's memory bound counts its fields' names, not only their data.

Each member is bounded by ``max_member_bytes`` and a sample by twice that (see
docs/security.md); names held as dict keys are memory too, and a .tar.gz of empty members
with long GNU names costs almost nothing to ship.
"""

from __future__ import annotations

import io
import tarfile
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest

import cloudshards as wds
from cloudshards.errors import ShardFormatError


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w:gz", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def read_keys(url: str, **kw: Any) -> list[str]:
    dataset = wds.WebDataset(url, shardshuffle=False, **kw)
    return [sample["__key__"] for sample in dataset]


def long_names(count: int, length: int) -> list[tuple[str, bytes]]:
    """Empty members of one sample ``k``, each named by ``length`` characters."""
    return [(f"k.{'f' * length}{n}", b"") for n in range(count)]


def test_empty_members_with_long_names_are_refused_past_the_sample_limit(
    tmp_path: Path,
) -> None:
    # 40 names of 20,000 characters: 800 KB of field names in one sample, no data at all.
    members = [("a.txt", b"a"), *long_names(40, 20_000), ("z.txt", b"z")]
    url = write_shard(tmp_path / "names.tar.gz", members)
    assert Path(url).stat().st_size < 20_000

    with pytest.raises(ShardFormatError, match="sample 'k' holds more than 131072 bytes") as info:
        read_keys(url, max_member_bytes=1 << 16)
    assert info.value.url is not None
    assert info.value.url.endswith("names.tar.gz")
    assert info.value.member is not None
    assert info.value.member.startswith("k.fff")
    assert len(info.value.member) > 20_000  # the whole name, for whoever needs it...
    assert len(str(info.value)) < 1_000  # ...but a message shows only its two ends
    assert "characters)" in str(info.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The sample before it is delivered; the one over the limit never is.
        assert read_keys(url, max_member_bytes=1 << 16, handler=wds.warn_and_continue) == ["a"]


def test_long_names_cannot_pile_up_in_memory(tmp_path: Path) -> None:
    """The finding's shard, scaled down: ~24 MB of names from a small .tar.gz. Reading it
    holds about the sample limit (2 MiB here), never all the names."""
    url = write_shard(tmp_path / "names.tar.gz", [*long_names(240, 100_000), ("z.txt", b"z")])
    assert Path(url).stat().st_size < 1_000_000
    tracemalloc.start()
    try:
        with pytest.raises(ShardFormatError, match="holds more than"):
            read_keys(url, max_member_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, f"peak {peak:,} bytes"


def test_many_empty_fields_count_against_the_sample_limit(tmp_path: Path) -> None:
    """Short names too: each field costs Python objects, so 1,000 empty fields are not free."""
    url = write_shard(tmp_path / "many.tar.gz", [(f"k.f{n}", b"") for n in range(1000)])
    with pytest.raises(ShardFormatError, match="sample 'k' holds more than 8192 bytes"):
        read_keys(url, max_member_bytes=4096)


def test_ordinary_samples_still_fit_the_limit(tmp_path: Path) -> None:
    """One field at the member limit, with a few small companions and long-ish names."""
    members: list[tuple[str, bytes]] = []
    for key in ("s0", "s1"):
        members.append((f"{key}.jpg", bytes(10_000)))
        members += [(f"{key}.{'meta' * 50}{n}.json", b"{}") for n in range(20)]
    url = write_shard(tmp_path / "ok.tar.gz", members)
    dataset = wds.WebDataset(url, shardshuffle=False, max_member_bytes=10_000)
    samples = list(dataset)
    assert [sample["__key__"] for sample in samples] == ["s0", "s1"]
    for sample in samples:
        assert len(sample["jpg"]) == 10_000
        assert sum(not field.startswith("__") for field in sample) == 21
