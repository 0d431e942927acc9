"""Indexed mode's safety rules: an index reads only inside its own location unless the user
opts in, and a stale or inconsistent index is an error, never a silently shortened field.

Indexes are built from generated shards, saved, then edited as JSON the way a careless tool
(or a hostile server) would write them.
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
from conftest import Shards, write_tar

import cloudshards as wds
from cloudshards.balance import resolve_sample_counts
from cloudshards.errors import ConfigError, ShardFormatError
from cloudshards.indexed import (
    DatasetIndex,
    IndexedDataset,
    IndexedMember,
    IndexedSample,
    ShardIndex,
    build_index,
    default_index_url,
    load_index,
    read_index,
    write_index,
)
from cloudshards.redact import redact_url

Document = dict[str, Any]


def stream(urls: Any) -> list[dict[str, Any]]:
    with wds.WebDataset(urls, shardshuffle=False) as ds:
        return list(ds)


def saved_index(shards: Shards) -> tuple[Path, Document]:
    """Index the shards, save the index at its default place; return its path and document."""
    path = Path(default_index_url([str(p) for p in shards.paths]))
    write_index(build_index(shards.spec()), str(path))
    return path, json.loads(path.read_text())


def save(path: Path, document: Document) -> str:
    path.write_text(json.dumps(document))
    return str(path)


# ------------------------------------------------------------------ where an index may point


@pytest.fixture
def elsewhere(make_shards: Callable[..., Shards], tmp_path: Path) -> Shards:
    """A shard outside the indexed dataset's directory (a sibling directory)."""
    return make_shards([2], directory=tmp_path / "secret", payload_bytes=50)


OUTSIDE_ENTRIES = {
    "absolute path": "{secret}",
    "file URL": "file://{secret}",
    "parent directory": "../secret/shard-000000.tar",
    "parent after a subdirectory": "sub/../../secret/shard-000000.tar",
    "percent-encoded parent": "%2e%2e/secret/shard-000000.tar",
    "percent-encoded parent and slash": "%2E%2E%2Fsecret/shard-000000.tar",
    "double-encoded parent": "%252e%252e/secret/shard-000000.tar",
    "backslashes": "..\\secret\\shard-000000.tar",
    "another protocol": "memory://elsewhere/shard-000000.tar",
    "another host": "http://other.example/shard-000000.tar",
    "an fsspec chain to a file": "simplecache::file://{secret}",
}


@pytest.mark.parametrize("entry", list(OUTSIDE_ENTRIES.values()), ids=list(OUTSIDE_ENTRIES))
def test_entries_outside_the_index_location_are_refused(
    make_shards: Callable[..., Shards],
    elsewhere: Shards,
    entry: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shards = make_shards([2, 2])
    path, document = saved_index(shards)
    monkeypatch.chdir(os.path.dirname(path))  # a relative reading must not make it "inside"
    stored = entry.format(secret=elsewhere.paths[0])
    document["shards"][1]["url"] = stored
    url = save(path, document)
    for load in (
        lambda: load_index(url),
        lambda: IndexedDataset(url),
        lambda: IndexedDataset(shards.spec()),  # the default index next to the shards
        lambda: resolve_sample_counts([str(p) for p in shards.paths], index=url),
    ):
        with pytest.raises(ConfigError, match="allow_external_shards=True") as info:
            load()
        message = str(info.value)
        assert url in message
        assert "shard entry 1" in message
        assert repr(stored) in message


def test_opting_in_reads_shards_anywhere(
    make_shards: Callable[..., Shards], elsewhere: Shards
) -> None:
    shards = make_shards([2, 2])
    path, document = saved_index(shards)
    outside = build_index(str(elsewhere.paths[0])).shards[0]
    document["shards"][1] = outside.to_json("../secret/shard-000000.tar")
    document["shards"].append(outside.to_json(str(elsewhere.paths[0])))
    document["num_shards"], document["num_samples"] = 3, 6
    url = save(path, document)
    loaded = load_index(url, allow_external_shards=True)
    assert loaded.shards[2].url == str(elsewhere.paths[0])
    with IndexedDataset(url, allow_external_shards=True) as ds:
        got = [ds[i] for i in range(len(ds))]
    expected = stream([str(p) for p in (shards.paths[0], *elsewhere.paths, *elsewhere.paths)])
    for sample in (*got, *expected):
        del sample["__url__"], sample["__local_path__"]
    assert got == expected


def test_pipe_entries_are_refused_even_when_opted_in(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([1])
    path, document = saved_index(shards)
    document["shards"][0]["url"] = "pipe:cat /etc/passwd"
    url = save(path, document)
    with pytest.raises(ConfigError, match="pipe:"):
        load_index(url, allow_external_shards=True)


def test_entries_inside_the_index_location_load(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([1, 1, 1], payload_bytes=20)
    path, document = saved_index(shards)
    sub = shards.paths[0].parent / "sub"
    sub.mkdir()
    shards.paths[2].rename(sub / shards.paths[2].name)
    document["shards"][0]["url"] = str(shards.paths[0])  # absolute, but inside
    document["shards"][1]["url"] = f"file://{shards.paths[1]}"
    document["shards"][2]["url"] = "sub/shard-000002.tar"
    urls = [str(shards.paths[0]), f"file://{shards.paths[1]}", str(sub / "shard-000002.tar")]
    with IndexedDataset(save(path, document)) as ds:
        assert [s.url for s in ds.index.shards] == urls
        assert [ds[i]["__key__"] for i in range(3)] == shards.keys


@pytest.mark.parametrize(
    ("entry", "allowed"),
    [
        ("x.tar", True),
        ("https://host/d/x.tar", True),
        ("https://HOST/d/deeper/x.tar?part=1", True),
        ("http://host/d/x.tar", False),  # another protocol
        ("https://host:8443/d/x.tar", False),  # another port
        ("https://host.evil.example/d/x.tar", False),
        ("https://host/dx/x.tar", False),  # a sibling that shares the prefix
        ("https://host/d/%2e%2e/x.tar", False),
        ("https://host/d/x%5c..%5cy.tar", False),
        ("s3://host/d/x.tar", False),
        ("/etc/passwd", False),
        ("//other/d/x.tar", False),
    ],
)
def test_remote_index_locations(entry: str, allowed: bool) -> None:
    url = "https://user:hunter2@host/d/train.index.json?X-Amz-Signature=SECRET"
    shard = {
        "url": entry, "size": 2048, "num_samples": 1, "fields": ["bin"], "keys": ["k"],
        "starts": [0], "ends": [1024], "member_counts": [1], "member_fields": [0],
        "member_offsets": [512], "member_sizes": [10],
    }  # fmt: skip
    data = json.dumps({"format": "cloudshards-index", "version": 1, "shards": [shard]}).encode()
    if allowed:
        assert read_index(data, url).shards[0].url.startswith("https://")
        return
    with pytest.raises(ConfigError) as info:
        read_index(data, url)
    message = str(info.value)
    assert "SECRET" not in message
    assert "hunter2" not in message
    assert "host/d/train.index.json" in message
    assert read_index(data, url, allow_external_shards=True).num_samples == 1


def test_memory_store_locations(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([1], payload_bytes=20)
    fs = fsspec.filesystem("memory")
    root = "/index-safety"
    try:
        fs.pipe_file(f"{root}/d/a.tar", shards.paths[0].read_bytes())
        fs.pipe_file(f"{root}/dx/a.tar", shards.paths[0].read_bytes())
        index_url = f"memory://{root}/d/train.index.json"
        write_index(build_index(f"memory://{root}/d/a.tar"), index_url)
        assert load_index(index_url).shards[0].url == f"memory://{root}/d/a.tar"
        document = json.loads(fs.cat_file(f"{root}/d/train.index.json"))
        for outside in (f"memory://{root}/dx/a.tar", "../dx/a.tar", str(shards.paths[0])):
            document["shards"][0]["url"] = outside
            fs.pipe_file(f"{root}/d/train.index.json", json.dumps(document).encode())
            with pytest.raises(ConfigError, match="allow_external_shards"):
                load_index(index_url)
            loaded = load_index(index_url, allow_external_shards=True)
            if ".." not in outside:  # the memory store does not resolve "..": no such object
                with IndexedDataset(loaded) as ds:
                    assert ds[0]["__key__"] == shards.keys[0]
    finally:
        fs.rm(root, recursive=True)


def test_balance_and_webdataset_follow_the_rule(
    make_shards: Callable[..., Shards], tmp_path: Path
) -> None:
    shards = make_shards([2, 3])
    urls = [str(p) for p in shards.paths]
    other = tmp_path / "indexes" / "train.index.json"
    write_index(build_index(urls), str(other))  # shards stored as absolute paths elsewhere
    with pytest.raises(ConfigError, match="allow_external_shards"):
        resolve_sample_counts(urls, index=str(other))
    assert resolve_sample_counts(urls, index=str(other), allow_external_shards=True) == [2, 3]

    def epoch(**kw: Any) -> list[str]:
        with wds.WebDataset(
            urls, shardshuffle=False, balance="drop", rank=0, world_size=1,
            sample_counts=str(other), **kw,
        ) as ds:  # fmt: skip
            return [s["__key__"] for s in ds]

    with pytest.raises(ConfigError, match="allow_external_shards"):
        epoch()
    assert epoch(allow_external_shards=True) == shards.keys


def test_writing_an_index_that_points_outside_warns(
    make_shards: Callable[..., Shards], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([1, 1])
    index = build_index(shards.spec())
    with caplog.at_level(logging.WARNING):
        write_index(index, str(shards.paths[0].parent / "train.index.json"))
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):
        write_index(index, str(tmp_path / "elsewhere" / "train.index.json"))
    assert "allow_external_shards=True" in caplog.text


def test_an_index_object_is_trusted(make_shards: Callable[..., Shards], elsewhere: Shards) -> None:
    # Built (or loaded, and so checked) by the caller's own code: no location rule applies.
    shards = make_shards([1])
    index = build_index([str(shards.paths[0]), str(elsewhere.paths[0])])
    with IndexedDataset(index) as ds:
        assert ds[2]["__key__"] == elsewhere.keys[1]


# ------------------------------------------------------------------ a stale or careless index


def layered_shard(path: Path) -> list[tuple[str, dict[str, bytes]]]:
    """Two samples whose last member is the large one (so cutting its end cuts its data)."""
    samples = [(f"k{i}", {"txt": b"t" * 10, "bin": bytes([i]) * 3000}) for i in range(3)]
    write_tar(path, samples, tarfile.PAX_FORMAT)
    return samples


def _shrink_end(s: Document) -> None:
    # The sample ends 512 bytes into its last member's 3000 bytes.
    s["ends"][0] = s["member_offsets"][1] + 512


def _set(column: str, position: int, value: Any) -> Callable[[Document], None]:
    def change(s: Document) -> None:
        s[column][position] = value

    return change


def _shift(column: str, position: int, delta: int) -> Callable[[Document], None]:
    def change(s: Document) -> None:
        s[column][position] += delta

    return change


def _overlap_samples(s: Document) -> None:
    s["starts"][1] = s["ends"][0] - 512


def _overlap_members(s: Document) -> None:
    s["member_offsets"][1] = s["member_offsets"][0]


def _member_before_start(s: Document) -> None:
    s["member_offsets"][0] = s["starts"][0]


def _no_members(s: Document) -> None:
    s["member_counts"][0], s["member_counts"][1] = 0, s["member_counts"][1] + 2


def _duplicate_field(s: Document) -> None:
    s["member_fields"][1] = s["member_fields"][0]


def _bool_size(s: Document) -> None:
    s["size"] = True


def _empty_field(s: Document) -> None:
    s["fields"][0] = ""


def _empty_key(s: Document) -> None:
    s["keys"][0] = ""


INCONSISTENT = {
    "member past its sample's end": (_shrink_end, "k0.bin"),
    "negative offset": (_set("member_offsets", 0, -512), "k0.txt"),
    "negative size": (_set("member_sizes", 0, -1), "k0.txt"),
    "unaligned offset": (_shift("member_offsets", 1, 1), "k0.bin"),
    "member without room for its header": (_member_before_start, "k0.txt"),
    "overlapping members": (_overlap_members, "k0.bin"),
    "overlapping samples": (_overlap_samples, None),
    "sample without members": (_no_members, None),
    "a field twice in a sample": (_duplicate_field, "k0.txt"),
    "size that is a boolean": (_bool_size, None),
    "empty field name": (_empty_field, None),
    "empty key": (_empty_key, None),
}


@pytest.mark.parametrize(("change", "member"), list(INCONSISTENT.values()), ids=list(INCONSISTENT))
def test_an_inconsistent_index_is_refused_at_load(
    tmp_path: Path, change: Callable[[Document], None], member: str | None
) -> None:
    shard = tmp_path / "d" / "shard-000000.tar"
    shard.parent.mkdir()
    layered_shard(shard)
    path = tmp_path / "d" / "train.index.json"
    write_index(build_index(str(shard)), str(path))
    document = json.loads(path.read_text())
    change(document["shards"][0])
    url = save(path, document)
    for load in (
        lambda: load_index(url),
        lambda: resolve_sample_counts([str(shard)], index=url),
    ):
        with pytest.raises(ShardFormatError, match="shard entry 0") as info:
            load()
        assert info.value.url == url
        assert info.value.shard_index == 0
        assert info.value.member == member
        assert "shard-000000.tar" in str(info.value)


@pytest.mark.parametrize("field", ["num_samples", "num_shards"])
def test_index_totals_must_match_its_shards(make_shards: Callable[..., Shards], field: str) -> None:
    shards = make_shards([2, 3])
    path, document = saved_index(shards)
    document[field] += 1
    with pytest.raises(ShardFormatError, match=field):
        load_index(save(path, document))


def test_an_index_object_that_cuts_a_member_short_fails_at_read(tmp_path: Path) -> None:
    # An index built in memory skips load-time checks: the read checks the bytes instead.
    shard = tmp_path / "shard-000000.tar"
    samples = layered_shard(shard)
    good = build_index(str(shard)).shards[0]
    entries = list(good.samples())
    first = entries[0]
    entries[0] = first._replace(end=first.members[1].offset + 512)
    bad = ShardIndex.from_samples(good.url, good.size, entries)
    with IndexedDataset(DatasetIndex((bad,))) as ds:
        assert ds[1]["bin"] == samples[1][1]["bin"]
        with pytest.raises(ShardFormatError) as info:
            ds[0]
    assert info.value.member == "k0.bin"
    assert info.value.url == str(shard)
    assert info.value.shard_index == 0


def test_a_short_ranged_read_is_an_error(make_shards: Callable[..., Shards]) -> None:
    shards = make_shards([3], payload_bytes=2000)
    fs = fsspec.filesystem("memory")
    root = "/index-safety-short"
    try:
        data = shards.paths[0].read_bytes()
        fs.pipe_file(f"{root}/a.tar", data)
        index = build_index(f"memory://{root}/a.tar")
        fs.pipe_file(f"{root}/a.tar", data[: index.shards[0].ends[2] - 1024])  # cut short
        with IndexedDataset(index) as ds:
            assert ds[1]["__key__"] == shards.keys[1]
            with pytest.raises(ShardFormatError, match="shorter") as info:
                ds[2]
        assert info.value.member == f"{shards.keys[2]}.bin"
        assert info.value.url == redact_url(f"memory://{root}/a.tar")
    finally:
        fs.rm(root, recursive=True)


def test_a_member_header_that_disagrees_with_the_index_is_an_error(tmp_path: Path) -> None:
    shard = tmp_path / "shard-000000.tar"
    samples = layered_shard(shard)
    index = build_index(str(shard))
    size = shard.stat().st_size
    # Same layout and size, one member 10 bytes shorter: its header now disagrees.
    samples[1][1]["bin"] = samples[1][1]["bin"][:-10]
    write_tar(shard, samples, tarfile.PAX_FORMAT)
    assert shard.stat().st_size == size
    with IndexedDataset(index) as ds:
        assert ds[0]["__key__"] == "k0"
        with pytest.raises(ShardFormatError, match="index") as info:
            ds[1]
    assert info.value.member == "k1.txt"
    assert info.value.shard_index == 0


def test_an_index_object_with_a_field_twice_fails_at_read(tmp_path: Path) -> None:
    # A tar that really holds k0.txt twice (the streaming reader refuses it), described by an
    # index built in memory: the second copy must not silently replace the first.
    shard = tmp_path / "shard-000000.tar"
    write_tar(shard, [("k0", {"txt": b"first"}), ("k0", {"txt": b"second"})], tarfile.USTAR_FORMAT)
    with pytest.raises(ShardFormatError, match="duplicate"):
        build_index(str(shard))
    members = (IndexedMember("k0.txt", 512, 5), IndexedMember("k0.txt", 1536, 6))
    entry = IndexedSample("k0", 0, 2048, members)
    index = DatasetIndex((ShardIndex.from_samples(str(shard), shard.stat().st_size, [entry]),))
    with IndexedDataset(index) as ds, pytest.raises(ShardFormatError, match="duplicate") as info:
        ds[0]
    assert info.value.url == str(shard)


def test_a_gzip_bomb_posing_as_an_index_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gzipped index inflates at most to the decode limit: a bomb is a clear error, found
    before the whole of it is in memory."""
    import gzip

    monkeypatch.setenv("CLOUDSHARDS_MAX_DECODED_BYTES", str(1 << 20))
    bomb = tmp_path / "train.index.json.gz"
    bomb.write_bytes(gzip.compress(b"{" + b" " * (64 << 20) + b"}", mtime=0))
    assert bomb.stat().st_size < 1 << 17
    with pytest.raises(ShardFormatError, match="inflates to more than 1,048,576 bytes") as info:
        wds.load_index(str(bomb))
    assert str(bomb) in str(info.value)
