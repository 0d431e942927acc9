"""Warm path: a shard parsed completely into the node cache gets a member table, and later
epochs slice its members by offset. Same samples as parsing, always; a missing, stale or
corrupt table, a gzip shard or an early stop fall back to parsing."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import fakes
import pytest

import cloudshards as wds
from cloudshards.cache.membertable import iter_table, load_table
from cloudshards.errors import ShardFormatError
from cloudshards.grouping import make_name_filter, split_key


@pytest.fixture(autouse=True)
def slowfile(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)


def samples(ds: Any) -> list[tuple[str, dict[str, bytes]]]:
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in ds]


def tables(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "meta").glob("*.members.json"))


def forbid_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    import cloudshards.stages.read as read_module

    def no_parse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("parsed a shard that has a member table")

    monkeypatch.setattr(read_module, "iter_members", no_parse)


def dataset(urls: list[str], cache_dir: Path, **kw: Any) -> Any:
    return wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), **kw)


def test_second_epoch_slices_by_the_table_with_identical_samples(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3, 5, 4])
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    first = samples(dataset(urls, cache_dir))
    assert len(tables(cache_dir)) == 3  # written with the entries
    forbid_parsing(monkeypatch)  # the warm epoch must come from the tables alone
    assert samples(dataset(urls, cache_dir)) == first
    assert [key for key, _ in first] == shards.keys


def test_a_duplicated_member_skipped_by_the_handler_is_skipped_by_the_table_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "dup-000000.tar"
    with tarfile.open(path, "w") as tar:
        for key, data in [("a", b"1"), ("b", b"2"), ("b", b"twice"), ("c", b"3")]:
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    urls = [fakes.url_of(path)]
    cache_dir = tmp_path / "cache"
    handler = wds.ignore_and_continue
    first = samples(dataset(urls, cache_dir, handler=handler))
    assert first == [("a", {"txt": b"1"}), ("b", {"txt": b"2"}), ("c", {"txt": b"3"})]
    assert len(tables(cache_dir)) == 1
    forbid_parsing(monkeypatch)
    assert samples(dataset(urls, cache_dir, handler=handler)) == first
    with pytest.raises(ShardFormatError, match="duplicate field 'txt'"):
        list(dataset(urls, cache_dir))


def test_balanced_and_resumed_reads_skip_by_the_table(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3, 5, 4, 6])
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    samples(dataset(urls, cache_dir))  # fills the cache and the tables
    forbid_parsing(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "3")
    per_rank = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        per_rank.append([key for key, _ in samples(dataset(urls, cache_dir))])
    assert [len(keys) for keys in per_rank] == [6, 6, 6]
    assert [key for keys in per_rank for key in keys] == shards.keys


def test_a_stale_or_corrupt_table_is_ignored(make_shards: Any, tmp_path: Path) -> None:
    shards = make_shards([4, 4])
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    first = samples(dataset(urls, cache_dir))
    stale, corrupt = tables(cache_dir)
    edit_header(stale, size=header_of(stale)["size"] + 512)  # a table for another file
    size = header_of(corrupt)["size"]
    corrupt.write_text(
        json.dumps(
            {"version": 1, "size": size, "names": ["x.bin"], "offsets": [0], "sizes": [size + 1]}
        )
    )
    assert load_table(str(corrupt), size) is None
    assert samples(dataset(urls, cache_dir)) == first


def test_an_early_stop_or_a_gzip_shard_leaves_no_table(make_shards: Any, tmp_path: Path) -> None:
    shards = make_shards([6])
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    it = iter(dataset(urls, cache_dir))
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert tables(cache_dir) == []
    zipped = tmp_path / "zipped.tar.gz"
    zipped.write_bytes(gzip.compress(shards.paths[0].read_bytes()))
    zipped_cache = tmp_path / "zipped-cache"
    first = samples(dataset([fakes.url_of(zipped)], zipped_cache))
    assert tables(zipped_cache) == []
    assert samples(dataset([fakes.url_of(zipped)], zipped_cache)) == first


def test_iter_table_applies_the_name_filter_and_member_limit(make_shards: Any) -> None:
    shards = make_shards([2])
    from cloudshards.cache.membertable import MemberTable
    from cloudshards.tar import iter_members

    record = MemberTable()
    with open(shards.paths[0], "rb") as f:
        parsed = list(iter_members(f, record=record, name_filter=make_name_filter(None, None)))
    assert record.complete
    assert len(record) == 6
    with open(shards.paths[0], "rb") as f:
        sliced = list(
            iter_table(
                f.fileno(),
                record,
                url="x",
                name_filter=make_name_filter(None, None),
                max_member_bytes=1 << 20,
            )
        )
        assert sliced == parsed
        from cloudshards.errors import ShardFormatError

        with pytest.raises(ShardFormatError, match="max_member_bytes"):
            list(iter_table(f.fileno(), record, url="x", name_filter=None, max_member_bytes=1))


def test_a_reader_that_followed_a_download_ahead_saves_its_table(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards downloaded ahead are parsed by a reader following the download; it reaches the
    end-of-archive marker before the downloader commits (padding, verification, rename), and
    must still leave a table for the next epoch."""
    import threading
    import time

    from cloudshards.cache import lock as _cachelock

    def slow_commit(point: str) -> None:
        # Only the downloads ahead (background threads) commit late; the reader's own do not.
        if point == "before_rename" and threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)

    monkeypatch.setattr(_cachelock, "_checkpoint", slow_commit)
    shards = make_shards([3, 5, 4, 6])
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    first = samples(dataset(urls, cache_dir))
    assert len(tables(cache_dir)) == 4
    forbid_parsing(monkeypatch)
    assert samples(dataset(urls, cache_dir)) == first


def header_of(path: Path) -> dict[str, Any]:
    """The JSON header of a saved table (after its first line)."""
    value: dict[str, Any] = json.loads(path.read_bytes().split(b"\n", 2)[1])
    return value


def edit_header(path: Path, **changes: Any) -> None:
    magic, header, rest = path.read_bytes().split(b"\n", 2)
    value = {**json.loads(header), **changes}
    path.write_bytes(magic + b"\n" + json.dumps(value).encode() + b"\n" + rest)


# --- gaps found by the mutation check (integration/mutation.py) ------------------------------


def write_raw_table(path: Path, **fields: Any) -> None:
    value = {"version": 1, "size": 10, "names": ["a"], "offsets": [0], "sizes": [10]}
    value.update(fields)
    path.write_text(json.dumps(value))


@pytest.mark.parametrize(
    "fields",
    [
        {"version": 2},
        {"size": 11},
        {"names": "a"},
        {"offsets": 0},
        {"sizes": {"0": 10}},
        {"names": ["a", "b"]},
        {"names": [1]},
        {"offsets": [-1]},
        {"sizes": [-1], "offsets": [5]},
        {"offsets": [1]},  # ends past the file
        {"names": ["a", "b"], "offsets": [0, 5], "sizes": [5, 6]},  # the last ends past it
        {"names": ["a", "b"], "offsets": [0, -1], "sizes": [5, 1]},
        {"names": ["a", "b"], "offsets": [0, 5], "sizes": [5, -1]},
        {"names": ["a", None], "offsets": [0, 5], "sizes": [5, 5]},
        {"offsets": ["0"]},
    ],
    ids=repr,
)
def test_load_table_refuses_what_does_not_fit_the_file(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    path = tmp_path / "table.json"
    write_raw_table(path, **fields)
    assert load_table(str(path), 10) is None
    path.write_text("[1, 2]")  # not an object at all
    assert load_table(str(path), 10) is None


@pytest.mark.parametrize(
    ("offsets", "sizes"),
    [([0], [10]), ([0, 4, 10], [0, 6, 0]), ([10], [0])],
    ids=["whole file", "empty members", "empty at the end"],
)
def test_load_table_takes_members_anywhere_inside_the_file(
    tmp_path: Path, offsets: list[int], sizes: list[int]
) -> None:
    path = tmp_path / "table.json"
    names = [f"m{i}" for i in range(len(offsets))]
    write_raw_table(path, names=names, offsets=offsets, sizes=sizes)
    table = load_table(str(path), 10)
    assert table is not None
    assert table.complete
    assert list(table.rows()) == list(zip(names, offsets, sizes, strict=True))


def test_write_table_leaves_no_temporary_file_behind(tmp_path: Path) -> None:
    from cloudshards.cache.membertable import MemberTable, write_table

    target = tmp_path / "table.json"
    target.mkdir()  # os.replace onto a directory fails
    write_table(str(target), MemberTable(), 0)
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]


def test_iter_table_of_an_empty_file(tmp_path: Path) -> None:
    from cloudshards.cache.membertable import MemberTable

    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    with open(empty, "rb") as f:
        members = iter_table(
            f.fileno(), MemberTable(), url="x", name_filter=None, max_member_bytes=1
        )
        assert list(members) == []


def outcome(make: Any) -> tuple[list[dict[str, Any]], Any]:
    """The samples an iterator gives, and the error that ends it (type, text and fields)."""
    got: list[dict[str, Any]] = []
    try:
        for sample in make():
            got.append(dict(sample))
    except Exception as exc:  # compared, not swallowed
        fields = {k: getattr(exc, k, None) for k in ("url", "offset", "member", "shard_index")}
        return got, (type(exc), str(exc), fields)
    return got, None


NAMES = [
    "a.jpg", "a.JSON", "a.cls", "b/c.seg.png", "b/c.txt", "nodot", "__meta__", ".hidden",
    "d/.x", "e.jpg", "e.jpg", "f..g", "g.a\nb", "__x__/y.jpg", "h.Bin", "h.bin",
]  # fmt: skip


#: Names that all have a key (a saved table then carries them split).
KEYED = [name for name in NAMES if split_key(name) is not None]


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("pool", [NAMES, KEYED], ids=["any names", "keyed names"])
def test_table_samples_are_group_members_of_iter_table(
    tmp_path: Path, seed: int, pool: list[str]
) -> None:
    """The warm path's one loop (table_samples) against the two it replaces, on random member
    names (duplicates, keyless names, meta names, upper-case fields), filters and limits, with
    the table as the reader made it and as saved and loaded (names split then)."""
    import random

    from cloudshards.cache.membertable import MemberTable, table_samples, write_table
    from cloudshards.grouping import group_members

    rng = random.Random(seed)
    names = [rng.choice(pool) for _ in range(rng.randrange(0, 14))]
    data = bytes(rng.randrange(256) for _ in range(4096))
    path = tmp_path / "entry"
    path.write_bytes(data if seed % 7 else b"")
    table = MemberTable()
    for name in names:
        offset = rng.randrange(0, 4000)
        table.names.append(name)
        table.offsets.append(offset)
        table.sizes.append(rng.randrange(0, 96))
    hooks = [
        None,
        make_name_filter(None, None),
        make_name_filter(lambda n: not n.endswith(".cls"), str.lower),
    ]
    name_filter = hooks[seed % 3]
    limit = rng.choice([1 << 20, 64])
    # None; over the file (the loop need not count); under it (samples of 300+ bytes refused)
    sample_limit = rng.choice([None, 2 * limit, 300])
    # A member over the limit: raised, or asked about (its sample dropped, or the read stopped)
    asked: list[Any] = []

    def go_on(exc: BaseException) -> bool:
        asked.append(getattr(exc, "member", None))
        return True

    def stop(exc: BaseException) -> bool:
        asked.append(getattr(exc, "member", None))
        return False

    on_oversize = rng.choice([None, go_on, stop])

    def outcome_asked(make: Any) -> tuple[Any, list[Any]]:
        asked.clear()
        return outcome(make), list(asked)

    with open(path, "rb") as f:
        fd = f.fileno()

        def fused(which: Any) -> Any:
            return table_samples(
                fd,
                which,
                url="u",
                name_filter=name_filter,
                max_member_bytes=limit,
                max_sample_bytes=sample_limit,
                shard_index=3,
                on_oversize=on_oversize,
            )

        def reference() -> Any:
            members = iter_table(
                fd,
                table,
                url="u",
                name_filter=name_filter,
                max_member_bytes=limit,
                skip_oversized=on_oversize is not None,
            )
            return group_members(
                members,
                url="u",
                shard_index=3,
                name_filter=name_filter,
                max_sample_bytes=sample_limit,
                on_oversize=on_oversize,
            )

        assert outcome_asked(lambda: fused(table)) == outcome_asked(reference)

        # The same through a saved table, whose names were split when it was saved.
        write_table(str(tmp_path / "table"), table, len(data))
        loaded = load_table(str(tmp_path / "table"), len(data))
        assert loaded is not None
        assert (loaded.keys is not None) == all(split_key(name) is not None for name in names)

        assert outcome_asked(lambda: fused(loaded)) == outcome_asked(reference)


# --- the saved format: columns, names split once -------------------------------------------


def saved(tmp_path: Path, names: list[str], file_size: int = 4096) -> Path:
    from cloudshards.cache.membertable import MemberTable, write_table

    table = MemberTable()
    for index, name in enumerate(names):
        table.names.append(name)
        table.offsets.append(index)
        table.sizes.append(1)
    path = tmp_path / "table.members"
    write_table(str(path), table, file_size)
    return path


def test_a_saved_table_loads_with_every_name_split_once(tmp_path: Path) -> None:
    names = ["a.JPG", "a.json", "dir.v2/b.seg.png", "a/.hidden", "c.", "d.x\ny", "é\udcff.txt"]
    table = load_table(str(saved(tmp_path, names)), 4096)
    assert table is not None
    assert table.complete
    assert list(table.rows()) == [(name, i, 1) for i, name in enumerate(names)]
    assert table.keys == ["a", "a", "dir.v2/b", "a/", "c", "d", "é\udcff"]
    assert table.fields == ["jpg", "json", "seg.png", "hidden", "", "x\ny", "txt"]


def test_a_name_without_a_key_leaves_the_names_to_split_as_read(tmp_path: Path) -> None:
    names = ["a.jpg", "nodot", ".hidden"]
    table = load_table(str(saved(tmp_path, names)), 4096)
    assert table is not None
    assert table.names == names
    assert table.keys is None
    assert table.fields is None


def test_names_with_a_nul_leave_the_shard_without_a_table(tmp_path: Path) -> None:
    assert not saved(tmp_path, ["a.jpg", "b\0c.jpg"]).exists()


def test_an_empty_table_round_trips(tmp_path: Path) -> None:
    table = load_table(str(saved(tmp_path, [], 0)), 0)
    assert table is not None
    assert list(table.rows()) == []


@pytest.mark.parametrize(
    "damage",
    [
        "version",
        "byteorder",
        "rows",
        "rows type",
        "split type",
        "lengths",
        "lengths type",
        "short",
        "long",
        "not utf-8",
        "header",
        "no header end",
        "keys count",
    ],
)
def test_a_damaged_saved_table_is_refused(tmp_path: Path, damage: str) -> None:
    path = saved(tmp_path, ["a.jpg", "a.cls", "b.jpg"])
    assert load_table(str(path), 4096) is not None
    magic, header, rest = path.read_bytes().split(b"\n", 2)
    value = json.loads(header)
    if damage == "version":
        value["version"] = 3
    elif damage == "byteorder":
        value["byteorder"] = "big" if value["byteorder"] == "little" else "little"
    elif damage == "rows":
        value["rows"] = 2
    elif damage == "rows type":
        value["rows"] = 3.0
    elif damage == "split type":
        value["split"] = 1
    elif damage == "lengths":
        value["lengths"] = value["lengths"][:1]
    elif damage == "lengths type":
        value["lengths"] = [str(n) for n in value["lengths"]]
    elif damage == "short":
        rest = rest[:-1]
    elif damage == "long":
        rest += b"x"
    elif damage == "not utf-8":
        rest = rest[:48] + b"\xff" + rest[49:]  # the first byte of the names
    elif damage == "header":
        header = b"{not json"
    elif damage == "no header end":
        path.write_bytes(magic + b"\n" + header)
        assert load_table(str(path), 4096) is None
        return
    elif damage == "keys count":  # one key fewer, one field more: the same length in all
        keys_at = 48 + value["lengths"][0]
        rest = rest[:keys_at] + rest[keys_at:].replace(b"\0", b"", 1) + b"\0"
        value["lengths"][1] -= 1
        value["lengths"][2] += 1
    if damage != "header":
        header = json.dumps(value).encode()
    path.write_bytes(magic + b"\n" + header + b"\n" + rest)
    assert load_table(str(path), 4096) is None


@pytest.mark.parametrize("where", ["offsets swapped", "a key edited", "a size's byte flipped"])
def test_a_table_changed_on_disk_is_refused(tmp_path: Path, where: str) -> None:
    """Damage that keeps the table's shape (two offsets swapped: two samples would get each
    other's data; a key edited: a sample would vanish) is caught by the table's checksum."""
    path = saved(tmp_path, ["a.jpg", "a.cls", "b.jpg"])
    magic, header, rest = path.read_bytes().split(b"\n", 2)
    if where == "offsets swapped":
        rest = rest[8:16] + rest[0:8] + rest[16:]
    elif where == "a key edited":
        assert b"a\0a\0bjpg" in rest  # the keys column, then the fields
        rest = rest.replace(b"a\0a\0bjpg", b"a\0a\0cjpg")
    else:
        rest = rest[:24] + bytes([rest[24] ^ 1]) + rest[25:]
    path.write_bytes(magic + b"\n" + header + b"\n" + rest)
    assert load_table(str(path), 4096) is None
    value = json.loads(header)  # a table saved before tables had a checksum is read as it is
    del value["crc32"]
    path.write_bytes(magic + b"\n" + json.dumps(value).encode() + b"\n" + rest)
    assert load_table(str(path), 4096) is not None


def test_a_saved_tables_warm_path_splits_no_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the names split when the table was saved, the usual reads (no filter, or the
    meta filter) split none; a filter that renames members splits what it returns."""
    from cloudshards.cache import membertable
    from cloudshards.grouping import skip_meta

    data = bytes(range(256)) * 4
    entry = tmp_path / "entry"
    entry.write_bytes(data)
    path = saved(tmp_path, ["a.jpg", "a.cls", "__x__/b.jpg", "b.jpg"], len(data))
    table = load_table(str(path), len(data))
    assert table is not None
    calls: list[str] = []
    split_rows = membertable._split_rows

    def counted(*args: Any) -> Any:
        calls.append("split")
        return split_rows(*args)

    monkeypatch.setattr(membertable, "_split_rows", counted)
    with open(entry, "rb") as f:

        def read(name_filter: Any) -> list[dict[str, Any]]:
            return [
                dict(s)
                for s in membertable.table_samples(
                    f.fileno(), table, url="u", name_filter=name_filter, max_member_bytes=64
                )
            ]

        assert [s["__key__"] for s in read(None)] == ["a", "__x__/b", "b"]
        assert [s["__key__"] for s in read(skip_meta)] == ["a", "b"]
        assert calls == []
        renamed = read(make_name_filter(None, str.upper))
        assert [s["__key__"] for s in renamed] == ["A", "B"]
        assert calls == ["split"]


def test_a_member_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    from cloudshards.cache.membertable import table_samples

    entry = tmp_path / "entry"
    entry.write_bytes(b"x" * 100)
    for table in (
        load_table(str(saved(tmp_path, ["a.bin", "b.bin"], 100)), 100),
        _in_memory(["a.bin", "b.bin"]),
    ):
        assert table is not None
        with open(entry, "rb") as f:
            samples = list(
                table_samples(f.fileno(), table, url="u", name_filter=None, max_member_bytes=1)
            )
            members = list(
                iter_table(f.fileno(), table, url="u", name_filter=None, max_member_bytes=1)
            )
        assert [bytes(s["bin"]) for s in samples] == [b"x", b"x"]
        assert len(members) == 2


def _in_memory(names: list[str]) -> Any:
    from cloudshards.cache.membertable import MemberTable

    table = MemberTable()
    for index, name in enumerate(names):
        table.names.append(name)
        table.offsets.append(index)
        table.sizes.append(1)
    return table


@pytest.mark.parametrize(
    "lengths",
    [lambda n: [n[0], n[1] + n[2]], lambda n: {"0": n[0]}, lambda n: None],
    ids=["two columns of three", "not a list", "missing"],
)
def test_column_lengths_that_do_not_describe_the_columns_are_refused(
    tmp_path: Path, lengths: Any
) -> None:
    path = saved(tmp_path, ["a.jpg", "b.jpg"])
    edit_header(path, lengths=lengths(header_of(path)["lengths"]))
    assert load_table(str(path), 4096) is None


@pytest.mark.parametrize("seed", range(6))
def test_names_are_split_as_split_key_splits_each(tmp_path: Path, seed: int) -> None:
    """A saved table carries each name's key and lower-case field exactly as the readers
    split one name at a time, whether every name has a plain basename (split in one pass)
    or one of them needs webdataset's regex, or has no key at all."""
    import random

    rng = random.Random(seed)
    pieces = ["a", "Bc", ".", "/", "d.x", "ΑΣ", "'", "İ", "é", "\udcff", "\n", "dir.v2/"]
    for _ in range(300):
        names = [
            "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 5)))
            for _ in range(rng.randrange(0, 6))
        ]
        names = [name for name in names if "\0" not in name]
        parts = [split_key(name) for name in names]
        table = load_table(str(saved(tmp_path, names)), 4096)
        assert table is not None
        if any(part is None for part in parts):
            assert table.keys is None, names
            continue
        assert table.keys == [part[0] for part in parts if part is not None], names
        assert table.fields == [part[1].lower() for part in parts if part is not None], names


@pytest.mark.parametrize("given", ["before the commit", "during the commit", "after the commit"])
def test_exactly_one_side_writes_a_pending_table(given: str) -> None:
    """The reader gives its table from its thread, the download commits from its own: the
    commit saves a table given before it; one given while it runs is the committer's to write
    once the entry is in place; one given after, the reader's."""
    from cloudshards.cache.pending import PendingTable

    pending, table = PendingTable(), fakes.member_table()
    if given == "before the commit":
        assert not pending.give(table)
    taken = pending.take()  # the commit looks (and saves what it found with the entry)
    if given == "during the commit":
        assert not pending.give(table)
    late = pending.committed()  # the entry is in place
    reader_writes = pending.give(table) if given == "after the commit" else False
    assert (taken is table, late is table, reader_writes) == {
        "before the commit": (True, False, False),
        "during the commit": (False, True, False),
        "after the commit": (False, False, True),
    }[given]


def test_a_warm_epoch_refuses_a_sample_over_the_limit_as_a_cold_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which samples a pipeline gets must not depend on what another one left in the cache:
    a table saved by a pipeline with the default limits is read under a smaller one."""
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, size in (("a", 100), ("b", 3000), ("c", 100)):
            for field in ("x", "y", "z"):
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = size
                tar.addfile(info, io.BytesIO(bytes(size)))
    url = fakes.url_of(shard)
    cache_dir = tmp_path / "cache"
    assert [key for key, _ in samples(dataset([url], cache_dir))] == ["a", "b", "c"]
    assert len(tables(cache_dir)) == 1

    def read(cache: Path, **kw: Any) -> tuple[list[str], Exception | None]:
        keys: list[str] = []
        try:
            for sample in dataset([url], cache, max_member_bytes=4096, **kw):
                keys.append(sample["__key__"])
        except Exception as exc:  # the outcome compared
            return keys, exc
        return keys, None

    cold_keys, cold_error = read(tmp_path / "fresh")
    forbid_parsing(monkeypatch)  # from the table (the exact path slices it too)
    warm_keys, warm_error = read(cache_dir)
    assert cold_keys == warm_keys == ["a"]  # "b" holds 9,000 bytes, over twice 4096
    assert isinstance(cold_error, ShardFormatError)
    assert isinstance(warm_error, ShardFormatError)
    assert "sample 'b' holds more than 8192 bytes" in str(warm_error)
    assert (warm_error.member, warm_error.offset) == (cold_error.member, cold_error.offset)


def test_a_warm_epoch_drops_the_sample_of_an_oversized_member_as_a_cold_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a handler that goes on, a member over the limit loses its sample alone, read from
    the table as when parsed (whose table is then saved whole); the default handler raises
    the same error after the same samples."""
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, sizes in (("a", (10, 10)), ("b", (10, 5000)), ("c", (10, 10)), ("d", (6000, 1))):
            for field, size in zip(("x", "y"), sizes, strict=True):
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = size
                tar.addfile(info, io.BytesIO(bytes(size)))
    url = fakes.url_of(shard)

    def read(cache: Path, **kw: Any) -> tuple[list[str], list[Any], Exception | None]:
        keys: list[str] = []
        asked: list[Any] = []

        def go_on(exc: BaseException) -> bool:
            asked.append((type(exc), str(exc), getattr(exc, "shard_index", None)))
            return True

        handler = kw.pop("handler", go_on)
        try:
            for sample in dataset([url], cache, max_member_bytes=4096, handler=handler, **kw):
                keys.append(sample["__key__"])
        except Exception as exc:  # the outcome compared
            return keys, asked, exc
        return keys, asked, None

    cold = read(tmp_path / "cold")  # parsed, with the limit: its table is saved all the same
    assert cold[0] == ["a", "c"]
    assert [text.split(" (")[0] for _, text, _ in cold[1]] == [
        "member of 5000 bytes exceeds max_member_bytes=4096",
        "member of 6000 bytes exceeds max_member_bytes=4096",
    ]
    assert cold[2] is None
    assert len(tables(tmp_path / "cold")) == 1
    cold_error = read(tmp_path / "fresh", handler=wds.reraise_exception)  # parsed
    forbid_parsing(monkeypatch)
    assert read(tmp_path / "cold") == cold  # warm: from that table
    warm_error = read(tmp_path / "cold", handler=wds.reraise_exception)
    assert cold_error[:2] == warm_error[:2] == (["a"], [])
    assert isinstance(cold_error[2], ShardFormatError)
    assert isinstance(warm_error[2], ShardFormatError)
    assert str(warm_error[2]) == str(cold_error[2])
    assert warm_error[2].member == cold_error[2].member == "b.y"
    assert warm_error[2].offset == cold_error[2].offset
