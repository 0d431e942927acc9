"""A shard cut short on a real HTTP server keeps every complete sample before the damage.

The shards are served by nginx (Range requests, so they are read with parallel ranged GETs and
streamed, never seeked). With webdataset's ``warn_and_continue`` handler, a shard truncated in
a member's data or padding must deliver every sample before the damaged one, and never the
damaged (partial) sample itself; the same through the node cache and for gzipped shards.

What "complete" means where a cut hides the next member's name (in a header, on a member
boundary): the last sample may go on after the cut, so it is not delivered.
"""

from __future__ import annotations

import gzip
import io
import random
import shutil
import tarfile
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import cloudshards as wds

if TYPE_CHECKING:
    from conftest import RemoteDataset
    from servers import NginxServer

Sample = tuple[str, dict[str, bytes]]
Layout = list[tuple[str, int, int, int]]  # name, first header offset, data offset, size
BIN_SIZES = [3000, 700, 5000, 100]  # the third .bin straddles several 512-byte blocks


def fields(index: int) -> dict[str, bytes]:
    # Random bytes, so that a gzipped copy does not compress the data to nothing.
    return {"bin": random.Random(index).randbytes(BIN_SIZES[index]), "cls": str(index).encode()}


def build_shard(fmt: int) -> tuple[bytes, Layout, int]:
    """Four samples of two members; their layout as tarfile reads it; the end-marker offset."""
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


def expected_keys(layout: Layout, end: int, cut: int) -> list[str]:
    """The samples all of whose members lie before ``cut``, less the last one unless the cut is
    inside the data of a member (its header read, so its name known) of another sample."""
    complete = [name for name, _, data, size in layout if data + size + (-size % 512) <= cut]
    keys = list(dict.fromkeys(name.split(".")[0] for name in complete))
    if not keys:
        return []
    if len(complete) < len(layout):
        damaged, _, data, _ = layout[len(complete)]
        proven = cut >= data and damaged.split(".")[0] != keys[-1]
    else:
        proven = cut >= end + 512  # one zero block, then EOF: a proper end
    return keys if proven else keys[:-1]


def cuts(layout: Layout, end: int) -> dict[str, int]:
    """Named cut points around the first member of the third sample (k2.bin) and elsewhere."""
    by_name = {name: (first, data, size) for name, first, data, size in layout}
    first, data, size = by_name["k2.bin"]
    cls_first, cls_data, _ = by_name["k2.cls"]
    return {
        "inside-k2.bin-data": data + size // 2,
        "inside-k2.bin-padding": data + size + 10,
        "inside-k2.cls-data": cls_data,
        "inside-k2.cls-header": cls_first + 300,
        "inside-k2.bin-header": first + 100,
        "on-k2.bin-boundary": first,
        "inside-first-zero-block": end + 100,
        "inside-second-zero-block": end + 600,
    }


def gzip_cut_inflating_to(packed: bytes, target: int) -> int:
    """The shortest prefix of a gzip stream that inflates to at least ``target`` bytes."""
    low, high = 0, len(packed)
    while low < high:
        middle = (low + high) // 2
        if len(zlib.decompressobj(wbits=31).decompress(packed[:middle])) >= target:
            high = middle
        else:
            low = middle + 1
    return low


def collect(url: str, **options: Any) -> tuple[list[Sample], list[str]]:
    """Read ``url`` with webdataset's warn_and_continue handler: samples and warnings."""
    dataset = wds.WebDataset(
        url, shardshuffle=False, handler=wds.warn_and_continue, empty_check=False, **options
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [
            (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in dataset
        ]
    return got, [str(w.message) for w in caught]


def samples_of(keys: list[str]) -> list[Sample]:
    return [(key, fields(int(key[1:]))) for key in keys]


@pytest.fixture(scope="module")
def served(http_server: NginxServer) -> Iterator[dict[str, Any]]:
    """Every cut of a USTAR and a PAX shard, plain and gzipped, on nginx (removed after)."""
    target = http_server.root / "truncated-remote"
    target.mkdir(parents=True, exist_ok=True)
    cases: dict[str, Any] = {}
    for fmt_name, fmt in (("ustar", tarfile.USTAR_FORMAT), ("pax", tarfile.PAX_FORMAT)):
        data, layout, end = build_shard(fmt)
        for cut_name, cut in cuts(layout, end).items():
            name = f"{fmt_name}-{cut_name}.tar"
            (target / name).write_bytes(data[:cut])
            (target / f"{name}.gz").write_bytes(gzip.compress(data[:cut], 1, mtime=0))
            keys = expected_keys(layout, end, cut)
            cases[name] = (keys, cut < end + 512)
            cases[f"{name}.gz"] = (keys, cut < end + 512)
        # The gzip stream itself cut where what it inflates to ends inside k2.bin's data.
        _, _, data_offset, size = next(entry for entry in layout if entry[0] == "k2.bin")
        packed = gzip.compress(data, 1, mtime=0)
        cut = gzip_cut_inflating_to(packed, data_offset + size // 2)
        name = f"{fmt_name}-gzip-stream-cut.tar.gz"
        (target / name).write_bytes(packed[:cut])
        cases[name] = (None, True)
    try:
        yield {"base": http_server.url_for("truncated-remote"), "cases": cases}
    finally:
        shutil.rmtree(target, ignore_errors=True)


@pytest.mark.timeout(120)
def test_truncated_http_shards_keep_every_complete_sample(served: dict[str, Any]) -> None:
    failures = []
    for name, (keys, damaged) in served["cases"].items():
        if keys is None:
            continue
        got, warned = collect(f"{served['base']}/{name}")
        if got != samples_of(keys) or bool(warned) != damaged:
            failures.append((name, [k for k, _ in got], keys, warned))
        if damaged:
            assert any(name in text for text in warned), (name, warned)
    assert not failures


@pytest.mark.timeout(120)
def test_truncated_http_shards_through_the_node_cache(
    served: dict[str, Any], tmp_path: Path
) -> None:
    # Twice: the first read downloads into the cache, the second reads the cached file.
    failures = []
    for name, (keys, _) in served["cases"].items():
        if keys is None or name.endswith(".gz") or "pax" in name:
            continue
        for attempt in range(2):
            got, _ = collect(f"{served['base']}/{name}", cache_dir=str(tmp_path / "cache"))
            if got != samples_of(keys):
                failures.append((name, attempt, [k for k, _ in got], keys))
    assert not failures


@pytest.mark.timeout(60)
def test_cut_gzip_stream_over_http(served: dict[str, Any]) -> None:
    """The gzip stream itself cut: every sample before the damaged member's, none after."""
    keys = [f"k{i}" for i in range(len(BIN_SIZES))]
    for name, (expected, _) in served["cases"].items():
        if expected is not None:
            continue
        errors: list[BaseException] = []

        def handler(exn: BaseException, errors: list[BaseException] = errors) -> bool:
            errors.append(exn)
            return True

        dataset = wds.WebDataset(
            f"{served['base']}/{name}", shardshuffle=False, handler=handler, empty_check=False
        )
        got = [
            (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in dataset
        ]
        assert len(errors) == 1, errors
        exc = errors[0]
        assert isinstance(exc, wds.ShardFormatError)
        assert "gzip" in str(exc)
        # The cut is inside k2.bin's data: k2 is partial, k1 is proven complete.
        assert exc.member == "k2.bin", exc
        assert got == samples_of(keys[:2])


@pytest.mark.timeout(60)
def test_dataset_truncated_shard_with_warn_and_continue(http_dataset: RemoteDataset) -> None:
    """The session dataset's shard cut mid-member: all its intact samples, then the next shard."""
    local = http_dataset.local
    urls = [http_dataset.url_for(local.truncated_shard), http_dataset.url_for(local.shards[3])]
    got, warned = collect(urls[0])
    assert [key for key, _ in got] == local.truncated_intact_keys
    assert all(sample == local.samples[key] for key, sample in got)
    assert len(warned) == 1
    both = wds.WebDataset(urls, shardshuffle=False, handler=wds.warn_and_continue)
    with pytest.warns(UserWarning, match=local.truncated_shard):
        keys = [s["__key__"] for s in both]
    assert keys == local.truncated_intact_keys + local.shard_keys[3]
