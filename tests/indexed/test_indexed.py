"""Indexed mode: the tar index, IndexedDataset, DistributedChunkedSampler and `cloudshards index`.

The oracle for every sample is the streaming reader (``WebDataset(urls, shardshuffle=False)``)
over the same shards. "Remote" shards are local files behind ``countfile://``, a fake store at
the fsspec seam (tests/fakes.py's ``slowfile://`` plus a log of every request and its range).
"""

from __future__ import annotations

import bz2
import collections
import gzip
import io
import itertools
import json
import logging
import lzma
import os
import pickle
import subprocess
import sys
import tarfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakes
import fsspec
import pytest
from conftest import Shards, sample_fields
from torch.utils.data import DataLoader

import cloudshards as wds
from cloudshards.errors import ConfigError, ShardFormatError, ShardOpenError
from cloudshards.indexed import (
    DistributedChunkedSampler,
    IndexedDataset,
    build_index,
    default_index_url,
    load_index,
    shard_sample_counts,
    write_index,
)
from cloudshards.redact import redact_url

Sample = dict[str, Any]

# ------------------------------------------------------------------------------ helpers


class CountFileSystem(fakes.SlowFileSystem):
    """``countfile:///abs/path``: slowfile plus one log line per request (method, path, range)."""

    protocol = "countfile"

    def _log(self, line: str) -> None:
        log = os.environ.get("COUNTFILE_LOG")
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{line}\n".encode())
            finally:
                os.close(fd)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._log(f"HEAD {self._strip_protocol(path)}")
        return super().info(path, **kwargs)

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        self._log(f"GET {self._strip_protocol(path)} {start} {end}")
        data: bytes = super().cat_file(path, start, end, **kwargs)
        return data

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self._log(f"GET {self._strip_protocol(path)} stream")
        return super()._open(path, mode, **kwargs)


def register_countfile(_worker_id: int | None = None) -> None:
    fsspec.register_implementation("countfile", CountFileSystem, clobber=True)


class Requests:
    """The countfile request log of one test."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def lines(self) -> list[list[str]]:
        try:
            return [line.split(" ") for line in self.log.read_text().splitlines()]
        except FileNotFoundError:
            return []

    def clear(self) -> None:
        self.log.unlink(missing_ok=True)


@pytest.fixture
def requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Requests:
    register_countfile()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    log = tmp_path / "requests.log"
    monkeypatch.setenv("COUNTFILE_LOG", str(log))
    return Requests(log)


def count_url(path: Path) -> str:
    return f"countfile://{path}"


def stream(urls: Any, **kw: Any) -> list[Sample]:
    """The oracle: what the streaming reader yields for these shards, in order."""
    with wds.WebDataset(urls, shardshuffle=False, **kw) as ds:
        return list(ds)


def write_wds_shards(directory: Path, sizes: list[int], payload: int = 300) -> list[Path]:
    """Shards written by webdataset 1.0.2's TarWriter (a PAX header before every member)."""
    import webdataset

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard, count in enumerate(sizes):
        path = directory / f"wds-{shard:06d}.tar"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with webdataset.TarWriter(str(path)) as writer:
                for i in range(count):
                    fields = sample_fields(shard, i, payload + 37 * i)
                    writer.write({"__key__": f"w{shard}_{i:05d}", **fields})
        paths.append(path)
    return paths


def write_odd_shard(path: Path, fmt: int) -> None:
    """Metadata and keyless members, a directory, upper-case and multi-dot fields, a long
    name (a GNU ``L`` or PAX ``x`` header), keys with dots in directories, empty members."""
    long_key = "deep/" + "x" * 120 + "/sample"
    members: list[tuple[str, bytes | None]] = [
        ("__meta__", b"dataset-level metadata"),
        ("README", b"no key here"),
        ("a/", None),
        ("a/one.JPG", b"\xff\xd8" + b"j" * 700),
        ("a/one.seg.png", b"p" * 513),
        ("a/one.txt", b""),
        ("between", b"keyless between samples"),
        (f"{long_key}.bin", b"l" * 1024),
        (f"{long_key}.json", b'{"long": true}'),
        ("dir.v2/k.cls", b"3"),
        ("dir.v2/k.meta.json", b"{}"),
    ]
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name.rstrip("/"))
            info.mtime = 1_700_000_000
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def assert_same(dataset: IndexedDataset, expected: list[Sample]) -> None:
    assert len(dataset) == len(expected)
    got = [dataset[i] for i in range(len(dataset))]
    assert [s["__key__"] for s in got] == [s["__key__"] for s in expected]
    assert got == expected


# ------------------------------------------------------------------------------ the index


def test_index_round_trip_json_and_gzip(make_shards: Callable[..., Shards], tmp_path: Path) -> None:
    shards = make_shards([3, 5, 1])
    urls = [str(p) for p in shards.paths]
    index = build_index(shards.spec())
    assert [s.url for s in index.shards] == urls
    assert [s.num_samples for s in index.shards] == [3, 5, 1]
    assert len(index) == index.num_samples == 9
    assert shard_sample_counts(index) == dict(zip(urls, [3, 5, 1], strict=True))
    assert [s.size for s in index.shards] == [p.stat().st_size for p in shards.paths]
    first = index.shards[1].sample(0)
    assert first.key == shards.keys[3]
    assert [m.name for m in first.members] == [f"{first.key}.{f}" for f in ("bin", "json", "cls")]
    assert first.members[0].size == 100
    with open(shards.paths[1], "rb") as f:  # offsets point at the members' data
        for member in first.members:
            f.seek(member.offset)
            assert f.read(member.size) == shards.samples[3][1][member.name.rsplit(".", 1)[1]]

    for name in ("idx.index.json", "idx.index.json.gz"):
        target = shards.paths[0].parent / name
        written = write_index(index, str(target))
        assert written.url == str(target)
        raw = target.read_bytes()
        document = json.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)
        assert raw.startswith(b"\x1f\x8b" if name.endswith(".gz") else b"{")
        assert document["format"] == "cloudshards-index"
        assert document["version"] == 1
        # Next to the shards: stored relative, resolved absolute on load.
        assert [s["url"] for s in document["shards"]] == [p.name for p in shards.paths]
        loaded = load_index(str(target))
        assert loaded.url == str(target)
        assert [s.url for s in loaded.shards] == urls
        for a, b in zip(index.shards, loaded.shards, strict=True):
            assert list(a.samples()) == list(b.samples())
            assert (a.size, a.etag, a.mtime, a.fields) == (b.size, b.etag, b.mtime, b.fields)

    # Elsewhere: stored absolute.
    elsewhere = tmp_path / "other" / "x.index.json"
    write_index(index, str(elsewhere))
    stored = [s["url"] for s in json.loads(elsewhere.read_text())["shards"]]
    assert stored == urls
    with pytest.raises(ConfigError, match="allow_external_shards=True"):
        load_index(str(elsewhere))  # outside the index's directory: opt in to read them
    assert [s.url for s in load_index(str(elsewhere), allow_external_shards=True).shards] == urls
    assert not list(elsewhere.parent.glob("*.tmp"))


def test_moved_dataset_keeps_working(make_shards: Callable[..., Shards], tmp_path: Path) -> None:
    shards = make_shards([2, 2])
    target = default_index_url([str(p) for p in shards.paths])
    write_index(build_index(shards.spec()), target)
    moved = tmp_path / "moved"
    shards.paths[0].parent.rename(moved)
    with IndexedDataset(str(moved / Path(target).name)) as ds:
        assert ds[3]["__url__"] == str(moved / shards.paths[1].name)
        assert_same(ds, stream(f"{moved}/shard-{{000000..000001}}.tar"))


def test_default_index_location() -> None:
    assert default_index_url(["s3://b/d/train-000000.tar", "s3://b/d/train-000001.tar"]) == (
        "s3://b/d/train.index.json"
    )
    assert default_index_url(["/x/shard_0007.tar"]) == "/x/shard.index.json"
    assert default_index_url(["gs://b/a.tar", "gs://b/b.tar"]) == "gs://b/dataset.index.json"
    assert (
        default_index_url([f"https://h/p/v-{i}.tar?sig=SECRET" for i in (0, 1)])
        == "https://h/p/v.index.json"
    )
    with pytest.raises(ConfigError):
        default_index_url([])


def test_load_rejects_other_versions_and_files(tmp_path: Path) -> None:
    path = tmp_path / "i.index.json"
    path.write_text(json.dumps({"format": "cloudshards-index", "version": 2, "shards": []}))
    with pytest.raises(ConfigError, match=r"version 2.*reads version 1"):
        load_index(str(path))
    path.write_text(json.dumps({"shards": []}))
    with pytest.raises(ConfigError, match="not a cloudshards index"):
        load_index(str(path))
    path.write_bytes(b"\x1f\x8b not gzip")
    with pytest.raises(ShardFormatError, match="not valid"):
        load_index(str(path))
    bad = {"url": "a.tar", "size": 10, "keys": ["k"], "fields": ["x"], "starts": [0]}
    path.write_text(json.dumps({"format": "cloudshards-index", "version": 1, "shards": [bad]}))
    with pytest.raises(ShardFormatError, match="shard entry 0"):
        load_index(str(path))
    with pytest.raises(ShardOpenError, match="not found"):
        load_index(str(tmp_path / "missing.index.json"))


@pytest.mark.parametrize(
    ("kind", "compress"),
    [("gzip", gzip.compress), ("bzip2", bz2.compress), ("xz", lzma.compress)],
)
def test_compressed_shards_are_refused(
    make_shards: Callable[..., Shards], tmp_path: Path, kind: str, compress: Any
) -> None:
    shards = make_shards([2])
    packed = tmp_path / f"g.tar.{kind}"
    packed.write_bytes(compress(shards.paths[0].read_bytes()))
    with pytest.raises(ShardFormatError, match=f"{kind}-compressed") as info:
        build_index(str(packed))
    assert info.value.url == str(packed)


# ------------------------------------------------------------------------------ samples


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_every_sample_equals_the_streaming_reader(
    make_shards: Callable[..., Shards], fmt: int
) -> None:
    shards = make_shards([4, 1, 6], payload_bytes=777, fmt=fmt)
    with IndexedDataset(shards.spec()) as ds:
        assert_same(ds, stream(shards.spec()))
        assert ds[-1]["__key__"] == shards.keys[-1]
        with pytest.raises(IndexError):
            ds[len(ds)]
        with pytest.raises(IndexError):
            ds[-len(ds) - 1]


def test_webdataset_tarwriter_shards(tmp_path: Path) -> None:
    paths = write_wds_shards(tmp_path / "w", [5, 8])
    urls = [str(p) for p in paths]
    with IndexedDataset(urls) as ds:
        assert_same(ds, stream(urls))
        # A PAX header (512) and its record (512) precede every member's own header (512):
        # each sample's range starts at its first PAX header.
        sample = ds.index.shards[0].sample(1)
        assert sample.members[0].offset - sample.start == 1536
        assert sample.start == ds.index.shards[0].sample(0).end


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_odd_members_follow_the_streaming_rules(tmp_path: Path, fmt: int) -> None:
    path = tmp_path / "odd.tar"
    write_odd_shard(path, fmt)
    expected = stream(str(path))
    long_key = "deep/" + "x" * 120 + "/sample"
    assert [s["__key__"] for s in expected] == ["a/one", long_key, "dir.v2/k"]
    with IndexedDataset(str(path)) as ds:
        assert_same(ds, expected)
        assert set(ds[0]) == {"__key__", "__url__", "__local_path__", "jpg", "seg.png", "txt"}


def test_transform_and_decoder(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([3])
    expected = stream(shards.spec())
    with IndexedDataset(shards.spec(), transform=wds.Decoder([])) as ds:
        decoded = ds[1]
    assert decoded["json"] == json.loads(expected[1]["json"])
    assert decoded["cls"] == int(expected[1]["cls"])
    assert decoded["bin"] == expected[1]["bin"]
    with IndexedDataset(shards.spec(), transform=lambda s: s["__key__"]) as ds:
        assert [ds[i] for i in range(3)] == shards.keys


def test_get_many_and_dataloader(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([7, 3, 9, 5])
    expected = stream(shards.spec())
    order = [13, 0, 23, 5, 5, 7, 19, 2]
    with IndexedDataset(shards.spec(), max_workers=4) as ds:
        assert ds.get_many(order) == [expected[i] for i in order]
        assert ds.__getitems__(order) == [expected[i] for i in order]
        assert ds.get_many([]) == []
        loader = DataLoader(
            ds,
            batch_size=4,
            num_workers=2,
            collate_fn=lambda batch: [s["__key__"] for s in batch],
            multiprocessing_context="fork",
        )
        keys = [key for batch in loader for key in batch]
    assert keys == [s["__key__"] for s in expected]


def test_concurrent_reads_from_many_threads(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([20] * 6, payload_bytes=2000)
    expected = stream(shards.spec())
    errors: list[BaseException] = []
    with IndexedDataset(shards.spec()) as ds:

        def reader(offset: int) -> None:
            try:
                for i in range(offset, len(ds) * 3, 7):
                    assert ds[i % len(ds)] == expected[i % len(ds)]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []


def test_pickles_without_its_threads_and_files(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([4])
    with IndexedDataset(shards.spec()) as ds:
        ds.get_many(range(4))
        clone = pickle.loads(pickle.dumps(ds))
    with clone:
        assert_same(clone, stream(shards.spec()))


# ------------------------------------------------------------------------------ remote + cache


def test_one_ranged_get_per_sample(make_shards: Callable[..., Shards], requests: Requests) -> None:
    shards = make_shards([4, 6], payload_bytes=3000)
    urls = [count_url(p) for p in shards.paths]
    expected = stream(urls)
    index = build_index(urls)
    requests.clear()
    with IndexedDataset(index) as ds:
        order = [7, 0, 9, 3, 3, 5]
        for i in order:
            assert ds[i] == expected[i]
        assert ds.stats()["indexed"]["ranged_gets"] == len(order)
    lines = requests.lines()
    assert len(lines) == len(order), lines
    for (method, path, start, end), i in zip(lines, order, strict=True):
        shard, within = index.locate(i)
        sample = index.shards[shard].sample(within)
        assert (method, path) == ("GET", str(shards.paths[shard]))
        assert (int(start), int(end)) == (sample.start, sample.end)
        assert int(end) - int(start) < 3 * (3000 + 1024)  # the sample, not the shard


def test_cache_downloads_each_shard_once(
    make_shards: Callable[..., Shards], requests: Requests, tmp_path: Path
) -> None:
    shards = make_shards([5, 7, 3], payload_bytes=5000)
    urls = [count_url(p) for p in shards.paths]
    expected = stream(urls)
    index = build_index(urls)
    requests.clear()
    cache_dir = tmp_path / "cache"
    with IndexedDataset(index, cache_dir=cache_dir, max_workers=8) as ds:
        order = list(range(len(ds)))[::-1] * 2
        assert ds.get_many(order) == [expected[i] for i in order]
        stats = ds.stats()
    assert stats["indexed"]["disk_reads"] == len(order)
    assert stats["indexed"].get("ranged_gets", 0) == 0
    assert stats["cache"]["misses"] == 3
    # Per shard: one HEAD (is it still the indexed size?) and ranged GETs covering it once.
    by_path: dict[str, list[tuple[str, ...]]] = collections.defaultdict(list)
    for method, logged, *rest in requests.lines():
        by_path[logged].append((method, *rest))
    assert set(by_path) == {str(p) for p in shards.paths}
    for path in shards.paths:
        heads = [r for r in by_path[str(path)] if r[0] == "HEAD"]
        ranges = sorted((int(r[1]), int(r[2])) for r in by_path[str(path)] if r[0] == "GET")
        assert len(heads) == 1
        assert ranges[0][0] == 0
        assert ranges[-1][1] == path.stat().st_size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    # A second dataset (another process would do the same) reads the cache: no request.
    requests.clear()
    with IndexedDataset(index, cache_dir=cache_dir) as again:
        # Cache counters are per process and directory (shared with the first dataset).
        hits = again.stats()["cache"]["hits"]
        assert again[4] == expected[4]
        assert again.stats()["cache"]["hits"] == hits + 1
    assert requests.lines() == []


def test_cache_with_dataloader_workers(
    make_shards: Callable[..., Shards], requests: Requests, tmp_path: Path
) -> None:
    shards = make_shards([6, 6, 6, 6])
    urls = [count_url(p) for p in shards.paths]
    expected = stream(urls)
    index = build_index(urls)
    requests.clear()
    ds = IndexedDataset(index, cache_dir=tmp_path / "cache")
    sampler = DistributedChunkedSampler(ds, num_replicas=1, rank=0, seed=3)
    loader = DataLoader(
        ds,
        batch_size=5,
        sampler=sampler,
        num_workers=2,
        collate_fn=list,
        worker_init_fn=register_countfile,
        multiprocessing_context="fork",
    )
    got = [sample for batch in loader for sample in batch]
    assert sorted(got, key=lambda s: s["__key__"]) == expected
    gets = collections.Counter(p for m, p, *r in requests.lines() if m == "GET" and r[0] == "0")
    assert gets == {str(p): 1 for p in shards.paths}, "each shard downloaded once per node"


def test_stale_index_is_detected(make_shards: Callable[..., Shards], tmp_path: Path) -> None:
    shards = make_shards([3, 3], payload_bytes=200)
    index = build_index(shards.spec())
    # Rewrite shard 1 with longer payloads: another size, other offsets.
    path = shards.paths[1]
    longer = [(k, sample_fields(1, i, 900)) for i, (k, _) in enumerate(shards.samples[3:])]
    from conftest import write_tar

    write_tar(path, longer, tarfile.PAX_FORMAT)
    with IndexedDataset(index) as ds:
        assert ds[0]["__key__"] == shards.keys[0]
        with pytest.raises(ShardFormatError, match="rebuild the index") as info:
            ds[4]
    error = info.value
    assert error.url == str(path)
    assert error.shard_index == 1
    assert error.member == f"{shards.keys[4]}.bin"
    assert str(path) in str(error)


def test_stale_remote_shard_is_detected(
    make_shards: Callable[..., Shards], requests: Requests, tmp_path: Path
) -> None:
    shards = make_shards([4], payload_bytes=300)
    url = count_url(shards.paths[0])
    index = build_index(url)
    from conftest import write_tar

    renamed = [(f"z{k}", fields) for k, fields in shards.samples]
    write_tar(shards.paths[0], renamed, tarfile.PAX_FORMAT)  # same layout, other names
    with IndexedDataset(index) as ds, pytest.raises(ShardFormatError, match="index says") as info:
        ds[2]
    assert info.value.member == f"{shards.keys[2]}.bin"
    write_tar(shards.paths[0], shards.samples[:2], tarfile.PAX_FORMAT)  # shorter
    with IndexedDataset(index) as ds, pytest.raises(ShardFormatError, match="shorter"):
        ds[3]
    with (
        IndexedDataset(index, cache_dir=tmp_path / "c") as ds,
        pytest.raises(ShardFormatError, match="index says"),
    ):
        ds[0]  # the download is refused before any byte is fetched


def test_missing_shard(
    make_shards: Callable[..., Shards], requests: Requests, tmp_path: Path
) -> None:
    shards = make_shards([2, 2])
    local = build_index(shards.spec())
    remote = build_index([count_url(p) for p in shards.paths])
    shards.paths[1].unlink()
    # Through the node cache too: its download's size lookup failed with the backend's own
    # FileNotFoundError (the raw URL as its text), which no handler took for a shard error.
    for index, cache in ((local, None), (remote, None), (remote, tmp_path / "cache")):
        with IndexedDataset(index, cache_dir=cache) as ds:
            assert ds[1]["__key__"] == shards.keys[1]
            with pytest.raises(ShardOpenError, match="not found") as info:
                ds[2]
            assert info.value.shard_index == 1
            assert info.value.member == f"{shards.keys[2]}.bin"
            assert "shard-000001.tar" in str(info.value)


def test_handler_substitutes_the_next_readable_sample(
    make_shards: Callable[..., Shards], caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([2, 2, 2])
    index = build_index(shards.spec())
    shards.paths[1].unlink()
    with IndexedDataset(index, handler="warn") as ds, caplog.at_level(logging.WARNING):
        assert [ds[i]["__key__"] for i in range(6)] == [shards.keys[k] for k in (0, 1, 4, 4, 4, 5)]
        # Sample 2's substitute comes from the next shard (sample 3 is in the same missing
        # shard, not tried); sample 3 is passed over without another request.
        assert ds.stats()["indexed"]["skipped"] == 2
    assert "not found" in caplog.text


@pytest.mark.parametrize("damage", ["missing", "truncated"])
@pytest.mark.parametrize("handler", ["warn", "skip"])
def test_a_shard_larger_than_the_substitutes_that_cannot_be_read_is_passed_over(
    make_shards: Callable[..., Shards], caplog: pytest.LogCaptureFixture, handler: str, damage: str
) -> None:
    """A missing shard of more than 16 samples, or one cut short since it was indexed (not
    the shard indexed: its file is refused): every index still returns a sample (it raised
    despite the handler, each sample's substitutes all in the same shard), and the shard is
    asked for once, not once per sample and substitute (17 x 6 tries each)."""
    shards = make_shards([3, 40, 3])
    index = build_index(shards.spec())
    if damage == "missing":
        shards.paths[1].unlink()
    else:
        os.truncate(shards.paths[1], shards.paths[1].stat().st_size - 10240)
    opens: list[str] = []
    real_open = os.open

    def counted(path: Any, *args: Any, **kw: Any) -> int:
        if str(path).endswith(shards.paths[1].name):
            opens.append(str(path))
        return real_open(path, *args, **kw)

    with (
        IndexedDataset(index, handler=handler) as ds,
        caplog.at_level(logging.WARNING),
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(os, "open", counted)
        keys = [ds[i]["__key__"] for i in range(len(ds))]
    good = shards.keys[:3] + shards.keys[43:]
    assert keys[:3] == shards.keys[:3]
    assert keys[3:43] == [shards.keys[43]] * 40  # the next readable shard's first sample
    assert keys[43:] == shards.keys[43:]
    assert set(keys) <= set(good)
    assert len(opens) == 1, opens


def test_a_remote_shard_cut_short_since_it_was_indexed_is_passed_over(
    make_shards: Callable[..., Shards], requests: Requests
) -> None:
    """Read by ranged GETs, the samples before the cut are there; the first past it proves
    the shard is not the one indexed: substitutes come from the next shard, without asking
    for each later sample of this one (17 GETs per sample otherwise, then an error)."""
    shards = make_shards([30, 3], payload_bytes=300)
    urls = [count_url(p) for p in shards.paths]
    index = build_index(urls)
    os.truncate(shards.paths[0], shards.paths[0].stat().st_size // 2)
    requests.clear()
    with IndexedDataset(index, handler="skip") as ds:
        keys = [ds[i]["__key__"] for i in range(len(ds))]
        skipped = ds.stats()["indexed"]["skipped"]
    cut = keys.index(shards.keys[30])  # the first sample past the cut
    assert 0 < cut < 30
    assert keys[:cut] == shards.keys[:cut]
    assert keys[cut:30] == [shards.keys[30]] * (30 - cut)
    assert keys[30:] == shards.keys[30:]
    assert skipped == 30 - cut
    first_shard = [line for line in requests.lines() if line[1] == str(shards.paths[0])]
    assert len(first_shard) == cut + 1  # the samples before the cut, and the one past it


def test_a_cache_entry_older_than_a_rebuilt_index_is_fetched_again(
    make_shards: Callable[..., Shards], requests: Requests, tmp_path: Path
) -> None:
    """A shard rewritten in the store (another size) and its index rebuilt: the cache's copy
    of the old shard is not read under the new index (it was refused, "rebuild the index",
    which had just been done), but fetched again."""
    shards = make_shards([3, 3], payload_bytes=200)
    urls = [count_url(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    with IndexedDataset(build_index(urls), cache_dir=cache_dir) as ds:
        assert [ds[i]["__key__"] for i in range(6)] == shards.keys
    from conftest import write_tar

    longer = [(k, sample_fields(1, i, 900)) for i, (k, _) in enumerate(shards.samples[3:])]
    write_tar(shards.paths[1], longer, tarfile.PAX_FORMAT)
    expected = stream(urls)
    rebuilt = build_index(urls)
    requests.clear()
    with IndexedDataset(rebuilt, cache_dir=cache_dir) as ds:
        assert [ds[i] for i in range(6)] == expected
    assert {line[1] for line in requests.lines()} == {str(shards.paths[1])}  # shard 0: a hit
    assert len(list((cache_dir / "data").iterdir())) == 2


def test_a_shard_over_the_cache_budget_is_read_by_sample_without_a_download(
    make_shards: Callable[..., Shards], requests: Requests, tmp_path: Path
) -> None:
    """The index knows the shard's size: one over the budget is read with ranged GETs from
    the first sample on, not downloaded (and thrown away) first, once per process."""
    shards = make_shards([20], payload_bytes=3000)
    url = count_url(shards.paths[0])
    index = build_index(url)
    expected = stream(url)
    requests.clear()
    budget = shards.paths[0].stat().st_size // 2
    with IndexedDataset(index, cache_dir=tmp_path / "cache", cache_size=budget) as ds:
        assert ds[7] == expected[7]
        assert ds[2] == expected[2]
    sample = index.shards[0].sample(7)
    assert requests.lines()[0] == ["GET", str(shards.paths[0]), str(sample.start), str(sample.end)]
    assert len(requests.lines()) == 2


def test_scanning_without_an_index_warns_and_a_saved_one_is_used(
    make_shards: Callable[..., Shards], caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([2, 3])
    with caplog.at_level(logging.WARNING), IndexedDataset(shards.spec()) as ds:
        assert ds.index.url is None
    assert "scanning" in caplog.text
    target = default_index_url([str(p) for p in shards.paths])
    write_index(ds.index, target)
    caplog.clear()
    with caplog.at_level(logging.WARNING), IndexedDataset(str(shards.paths[1])) as one:
        assert one.index.url == target  # a subset of an indexed dataset
        assert [one[i]["__key__"] for i in range(3)] == shards.keys[2:]
    assert caplog.text == ""


def test_bad_arguments(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([1])
    with pytest.raises(ConfigError):
        IndexedDataset(shards.spec(), max_workers=0)
    with pytest.raises(ConfigError):
        IndexedDataset({"a": 1})
    with pytest.raises(ConfigError):
        build_index(shards.spec(), max_workers=0)
    with pytest.raises(ConfigError):
        build_index("pipe:cat x.tar")


# ------------------------------------------------------------------------------ the sampler


def epoch_of(dataset: Any, world: int, epoch: int = 0, **kw: Any) -> list[list[int]]:
    ranks = []
    for rank in range(world):
        sampler = DistributedChunkedSampler(dataset, num_replicas=world, rank=rank, **kw)
        sampler.set_epoch(epoch)
        ranks.append(list(sampler))
        assert len(sampler) == len(ranks[-1])
    return ranks


class Sized:
    def __init__(self, size: int, ranges: list[tuple[int, int]] | None = None) -> None:
        self.size = size
        if ranges is not None:
            self.shard_ranges = lambda: ranges

    def __len__(self) -> int:
        return self.size


UNEVEN = [(0, 7), (7, 20), (20, 23), (23, 40), (40, 41), (41, 50)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 64])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_disjoint_equal_and_covering(world: int, drop_last: bool) -> None:
    dataset = Sized(50, UNEVEN)
    ranks = epoch_of(dataset, world, seed=5, drop_last=drop_last)
    per_rank = 50 // world if drop_last else -(-50 // world)
    assert [len(r) for r in ranks] == [per_rank] * world
    flat = [i for r in ranks for i in r]
    counts = collections.Counter(flat)
    if drop_last:
        assert max(counts.values(), default=1) == 1  # disjoint
        assert len(flat) == 50 - 50 % world
    else:
        assert set(flat) == set(range(50))  # union = dataset
        padding = per_rank * world - 50
        assert sum(c - 1 for c in counts.values()) == padding
        if padding < 50:
            assert max(counts.values()) <= 2


def test_sampler_chunks_are_contiguous_shard_pieces() -> None:
    dataset = Sized(50, UNEVEN)
    shard_of = {i: s for s, (lo, hi) in enumerate(UNEVEN) for i in range(lo, hi)}
    for rank in epoch_of(dataset, 3, epoch=2, seed=1):
        # A rank reads one shard (or a part of it) after another: each shard appears as one
        # run, and each run covers a contiguous range of indices.
        runs: list[list[int]] = []
        for i in rank:
            if runs and shard_of[runs[-1][-1]] == shard_of[i]:
                runs[-1].append(i)
            else:
                runs.append([i])
        shards = [shard_of[run[0]] for run in runs]
        assert len(shards) == len(set(shards)), shards
        for run in runs:
            assert sorted(run) == list(range(min(run), max(run) + 1))
        assert len(rank) - len(runs) >= 0
        assert rank != sorted(rank)  # shuffled within chunks


def test_sampler_chunk_size_splits_shards() -> None:
    dataset = Sized(50, UNEVEN)
    sampler = DistributedChunkedSampler(dataset, num_replicas=1, rank=0, chunk_size=5)
    assert all(hi - lo <= 5 for lo, hi in sampler.chunks)
    assert all(any(a <= lo and hi <= b for a, b in UNEVEN) for lo, hi in sampler.chunks)
    plain = DistributedChunkedSampler(Sized(2500), num_replicas=1, rank=0)
    assert plain.chunks == [(0, 1000), (1000, 2000), (2000, 2500)]


def test_sampler_epochs_reshuffle_deterministically() -> None:
    dataset = Sized(50, UNEVEN)
    first = epoch_of(dataset, 2, epoch=0, seed=9)
    assert epoch_of(dataset, 2, epoch=0, seed=9) == first
    second = epoch_of(dataset, 2, epoch=1, seed=9)
    assert second != first
    assert sorted(i for r in second for i in r) == sorted(i for r in first for i in r)
    assert epoch_of(dataset, 2, epoch=0, seed=10) != first
    sampler = DistributedChunkedSampler(dataset, num_replicas=2, rank=1, seed=9)
    assert list(sampler) == first[1]
    sampler.set_epoch(1)
    assert list(sampler) == second[1]


def test_sampler_without_shuffle_gives_consecutive_spans() -> None:
    assert epoch_of(Sized(10, [(0, 4), (4, 10)]), 3, shuffle=False) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]


def test_sampler_on_an_indexed_dataset(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([3, 8, 1, 4])
    with IndexedDataset(shards.spec()) as ds:
        ranks = epoch_of(ds, 2, seed=4)
        sampler = DistributedChunkedSampler(ds, num_replicas=2, rank=0, chunk_size=2)
    assert sorted(ranks[0] + ranks[1]) == list(range(16))
    assert all(any(lo <= a and b <= hi for lo, hi in ds.shard_ranges()) for a, b in sampler.chunks)


def test_sampler_detects_rank_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    sampler = DistributedChunkedSampler(Sized(10))
    assert (sampler.rank, sampler.num_replicas, len(sampler)) == (2, 4, 3)
    assert DistributedChunkedSampler(Sized(10), rank=0).num_replicas == 4
    with pytest.raises(ConfigError):
        DistributedChunkedSampler(Sized(10), num_replicas=2, rank=2)
    with pytest.raises(ConfigError):
        DistributedChunkedSampler(Sized(10), num_replicas=0, rank=0)
    with pytest.raises(ConfigError):
        DistributedChunkedSampler(Sized(10), num_replicas=1, rank=0, chunk_size=0)
    with pytest.raises(ConfigError):
        DistributedChunkedSampler(Sized(0), num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match="shard_ranges"):
        DistributedChunkedSampler(Sized(10, [(0, 4), (5, 10)]), num_replicas=1, rank=0)


# ------------------------------------------------------------------------------ the CLI


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudshards.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_cli_index(make_shards: Callable[..., Shards], tmp_path: Path) -> None:
    shards = make_shards([2, 3])
    result = run_cli("index", shards.spec())
    assert result.returncode == 0, result.stderr
    default = shards.paths[0].parent / "shard.index.json"
    assert result.stdout.strip() == f"{default}: 2 shards, 5 samples"
    with IndexedDataset(str(default)) as ds:
        assert_same(ds, stream(shards.spec()))

    out = tmp_path / "elsewhere" / "i.index.json.gz"
    result = run_cli("index", str(shards.paths[0]), str(shards.paths[1]), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert load_index(str(out), allow_external_shards=True).num_samples == 5

    result = run_cli("index", str(tmp_path / "missing.tar"))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"cloudshards: error: object not found (shard {tmp_path}/missing.tar, byte offset 0)"
    )
    result = run_cli("index", shards.spec(), "--storage-option", "novalue")
    assert result.returncode == 2
    assert "KEY=VALUE" in result.stderr
    result = run_cli("index")
    assert result.returncode == 2


def iter_keys(ds: IndexedDataset) -> Iterator[str]:
    for i in range(len(ds)):
        yield ds[i]["__key__"]


def test_index_of_remote_shards_stores_metadata(
    make_shards: Callable[..., Shards], requests: Requests, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fakes.ETAG_ENV, "md5")
    shards = make_shards([2])
    index = build_index(count_url(shards.paths[0]))
    etag = index.shards[0].etag
    assert etag is not None
    assert len(etag.strip('"')) == 32
    methods = [line[0] for line in requests.lines()]
    assert methods == ["HEAD", "GET"]  # one metadata request, one streaming read
    with IndexedDataset(index) as ds:
        assert list(iter_keys(ds)) == shards.keys


def test_index_next_to_shards_in_a_store(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([2, 3])
    fs = fsspec.filesystem("memory")
    root = "/indexed-test"
    try:
        for path in shards.paths:
            fs.pipe_file(f"{root}/data/{path.name}", path.read_bytes())
        urls = [f"memory://{root}/data/{p.name}" for p in shards.paths]
        expected = stream(urls)
        target = default_index_url(urls)
        assert target == f"memory://{root}/data/shard.index.json"
        write_index(build_index(urls), target)
        stored = json.loads(fs.cat_file(f"{root}/data/shard.index.json"))
        assert [s["url"] for s in stored["shards"]] == [p.name for p in shards.paths]
        with IndexedDataset(urls) as ds:  # finds the saved index next to the shards
            assert ds.index.url == target
            assert_same(ds, expected)
    finally:
        fs.rm(root, recursive=True)


def test_relative_local_paths_find_the_saved_index(
    make_shards: Callable[..., Shards], monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([2, 2])
    write_index(build_index(shards.spec()), str(shards.paths[0].parent / "shard.index.json"))
    monkeypatch.chdir(shards.paths[0].parent.parent)
    relative = [f"{p.parent.name}/{p.name}" for p in shards.paths]
    with IndexedDataset(relative) as ds:
        assert ds.index.url is not None
        assert [s.url for s in ds.index.shards] == [str(p) for p in shards.paths]
    assert [s.url for s in build_index(relative).shards] == [str(p) for p in shards.paths]


LOCAL_SPECS = [
    # (shard spec, index URL), {root} the absolute path of the working directory
    ("data/shard-{{000000..000001}}.tar", "data/shard.index.json"),
    ("{root}/data/shard-{{000000..000001}}.tar", "data/shard.index.json"),
    ("file://{root}/data/shard-{{000000..000001}}.tar", "data/shard.index.json"),
    ("data/shard-{{000000..000001}}.tar", "{root}/data/shard.index.json"),
    ("data/shard-{{000000..000001}}.tar", "file://{root}/data/shard.index.json"),
    ("./data/../data/shard-{{000000..000001}}.tar", "./data/shard.index.json"),
]


@pytest.mark.parametrize(
    ("spec", "index_url"),
    LOCAL_SPECS,
    ids=[
        "relative",
        "absolute-shards",
        "file-url-shards",
        "absolute-index",
        "file-url-index",
        "dots",
    ],
)
def test_local_shards_are_stored_relative_to_the_index_however_they_are_named(
    make_shards: Callable[..., Shards],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spec: str,
    index_url: str,
) -> None:
    """A relative or absolute path or a file:// URL, for the shards or the index: shards in the
    index's directory are stored relative to it, so the two can be moved together."""
    shards = make_shards([2, 3], directory=tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    root = str(tmp_path)
    write_index(build_index(spec.format(root=root)), index_url.format(root=root))
    stored = json.loads((tmp_path / "data" / "shard.index.json").read_text())
    assert [s["url"] for s in stored["shards"]] == [p.name for p in shards.paths]
    (tmp_path / "data").rename(tmp_path / "moved")
    with IndexedDataset(str(tmp_path / "moved" / "shard.index.json")) as ds:
        assert list(iter_keys(ds)) == shards.keys
        assert ds[4]["__url__"] == str(tmp_path / "moved" / shards.paths[1].name)


def test_local_shards_below_or_beside_the_index_directory(
    make_shards: Callable[..., Shards], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the index's directory: relative, with the subdirectory. Beside it: stored as
    before (absolute), and loading asks for the opt-in."""
    shards = make_shards([2, 3], directory=tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    index = build_index("data/shard-{000000..000001}.tar")
    write_index(index, "./shard.index.json")
    stored = json.loads((tmp_path / "shard.index.json").read_text())
    assert [s["url"] for s in stored["shards"]] == [f"data/{p.name}" for p in shards.paths]
    write_index(index, "other/shard.index.json")
    stored = json.loads((tmp_path / "other" / "shard.index.json").read_text())
    assert [s["url"] for s in stored["shards"]] == [str(p) for p in shards.paths]
    with pytest.raises(ConfigError, match="allow_external_shards=True"):
        load_index("other/shard.index.json")


def test_cli_index_of_a_relative_spec_can_be_moved_with_its_shards(
    make_shards: Callable[..., Shards], tmp_path: Path
) -> None:
    shards = make_shards([2, 3], directory=tmp_path / "data")
    result = run_cli("index", "data/shard-{000000..000001}.tar", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "data/shard.index.json: 2 shards, 5 samples"
    stored = json.loads((tmp_path / "data" / "shard.index.json").read_text())
    assert [s["url"] for s in stored["shards"]] == [p.name for p in shards.paths]
    (tmp_path / "data").rename(tmp_path / "moved")
    with IndexedDataset(str(tmp_path / "moved" / "shard.index.json")) as ds:
        assert list(iter_keys(ds)) == shards.keys


def test_write_errors_name_the_index(
    make_shards: Callable[..., Shards], requests: Requests
) -> None:
    shards = make_shards([1])
    target = count_url(shards.paths[0].parent / "x.index.json")  # a read-only store
    with pytest.raises(ShardOpenError) as info:
        write_index(build_index(shards.spec()), target)
    assert info.value.url == redact_url(target)
    assert "x.index.json" in str(info.value)


def test_an_indexed_checkpoint_on_another_number_of_ranks_is_refused_clearly(
    make_shards: Callable[..., Shards],
) -> None:
    """A map-style epoch is its sampler's order, which depends on the number of ranks: a
    checkpoint of two ranks restored on one is refused, and the message says why."""
    from cloudshards.errors import StateMismatchError

    shards = make_shards([4, 4])
    dataset = IndexedDataset(build_index(shards.spec()))
    states = []
    for rank in range(2):
        sampler = wds.DistributedChunkedSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
        loader = wds.StatefulLoader(dataset, sampler=sampler, batch_size=2)
        it = iter(loader)
        next(it)
        states.append(loader.state_dict())
        del it
    again = wds.StatefulLoader(dataset, batch_size=2)
    with pytest.raises(StateMismatchError, match="map-style dataset's epoch"):
        again.load_state_dict({"cloudshards_ranks": states, "world_size": 2})


def test_with_the_raising_handler_a_shard_that_failed_is_asked_for_again(
    make_shards: Callable[..., Shards],
) -> None:
    """Only a handler that lets failures pass has a failed shard passed over for a while: a
    caller who catches the error and asks again gets the shard once it is back."""
    shards = make_shards([2, 2])
    index = build_index(shards.spec())
    away = shards.paths[1].with_suffix(".away")
    shards.paths[1].rename(away)
    with IndexedDataset(index) as ds:
        with pytest.raises(ShardOpenError, match="not found"):
            ds[2]
        away.rename(shards.paths[1])
        assert ds[2]["__key__"] == shards.keys[2]
