"""A member over ``max_member_bytes`` in an intact shard, read by a pipeline: with a handler
that goes on, only the sample it belongs to is lost (never given with a field missing), the
samples after it are read; the default handler still raises. Positions count the lost sample,
so a resumed or balanced read gives what an uninterrupted one does."""

from __future__ import annotations

import gzip
import io
import tarfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import cloudshards as wds
from cloudshards.errors import ShardFormatError

LIMIT = 4096


def fields(shard: int, index: int) -> dict[str, bytes]:
    size = {(0, 3, "a"): 5000, (0, 7, "b"): 6000, (2, 9, "a"): 5000}
    return {
        field: f"{shard}:{index}:{field}".encode().ljust(size.get((shard, index, field), 20), b".")
        for field in ("a", "b")
    }


def key(shard: int, index: int) -> str:
    return f"x{shard}/s{index:03d}"


def write_shard(path: Path, shard: int, count: int, fmt: int = tarfile.PAX_FORMAT) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for index in range(count):
            for field, data in fields(shard, index).items():
                info = tarfile.TarInfo(f"{key(shard, index)}.{field}")
                info.size = len(data)
                info.mtime = 1_700_000_000.5  # PAX: webdataset's writer's 'x' header each
                tar.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def samples(dataset: Any) -> list[tuple[str, dict[str, bytes]]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warn_and_continue's own warnings
        return [
            (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in dataset
        ]


def expected(shard: int, indices: Any) -> list[tuple[str, dict[str, bytes]]]:
    return [(key(shard, index), fields(shard, index)) for index in indices]


#: Shard 0's samples without the two holding a member over the limit.
KEPT = [index for index in range(10) if index not in (3, 7)]


@pytest.mark.parametrize(
    ("name", "fmt"),
    [("s.tar", tarfile.USTAR_FORMAT), ("s.tar", tarfile.PAX_FORMAT), ("s.tar.gz", None)],
    ids=["ustar", "pax", "gzip"],
)
def test_a_handler_that_goes_on_loses_only_the_samples_of_oversized_members(
    tmp_path: Path, name: str, fmt: int | None
) -> None:
    path = write_shard(tmp_path / name, 0, 10, fmt or tarfile.PAX_FORMAT)
    asked: list[BaseException] = []

    def go_on(exc: BaseException) -> bool:
        asked.append(exc)
        return True

    for handler in (wds.warn_and_continue, "warn", "skip", go_on):
        got = samples(
            wds.WebDataset(str(path), shardshuffle=False, handler=handler, max_member_bytes=LIMIT)
        )
        assert got == expected(0, KEPT), handler
    # Asked once about each, with the error naming the URL, shard, member and offset.
    assert [(exc.member, exc.shard_index) for exc in asked] == [  # type: ignore[attr-defined]
        ("x0/s003.a", 0),
        ("x0/s007.b", 0),
    ]
    assert all(isinstance(exc, ShardFormatError) for exc in asked)
    assert all(exc.url == str(path) and exc.offset for exc in asked)  # type: ignore[attr-defined]
    assert "member of 5000 bytes exceeds max_member_bytes=4096" in str(asked[0])


def test_the_warnings_name_each_oversized_member(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "s.tar", 0, 10)
    dataset = wds.WebDataset(
        str(path), shardshuffle=False, handler=wds.warn_and_continue, max_member_bytes=LIMIT
    )
    with pytest.warns(UserWarning, match="exceeds max_member_bytes") as caught:
        keys = [sample["__key__"] for sample in dataset]
    assert keys == [key(0, index) for index in KEPT]
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 2
    assert "x0/s003.a" in messages[0]
    assert "x0/s007.b" in messages[1]


@pytest.mark.parametrize("name", ["s.tar", "s.tar.gz"])
def test_the_default_handler_still_raises_after_the_samples_before(
    tmp_path: Path, name: str
) -> None:
    path = write_shard(tmp_path / name, 0, 10)
    got: list[str] = []

    def read() -> None:
        for sample in wds.WebDataset(str(path), shardshuffle=False, max_member_bytes=LIMIT):
            got.append(sample["__key__"])

    with pytest.raises(ShardFormatError, match="exceeds max_member_bytes=4096") as info:
        read()
    assert got == [key(0, index) for index in range(3)]
    assert (info.value.url, info.value.member, info.value.shard_index) == (
        str(path),
        "x0/s003.a",
        0,
    )


def test_a_handler_that_stops_is_asked_once_and_stops(tmp_path: Path) -> None:
    path = write_shard(tmp_path / "s.tar", 0, 10)
    asked: list[BaseException] = []

    def stop(exc: BaseException) -> bool:
        asked.append(exc)
        return False

    got = samples(
        wds.WebDataset(str(path), shardshuffle=False, handler=stop, max_member_bytes=LIMIT)
    )
    assert got == expected(0, range(3))
    assert [exc.member for exc in asked] == ["x0/s003.a"]  # type: ignore[attr-defined]


def test_the_next_shards_are_read_and_the_hooks_see_the_renamed_member(tmp_path: Path) -> None:
    first = write_shard(tmp_path / "shard-000000.tar", 0, 10)
    write_shard(tmp_path / "shard-000001.tar", 1, 4)
    spec = f"{first.parent}/shard-{{000000..000001}}.tar"
    got = samples(
        wds.WebDataset(
            spec,
            shardshuffle=False,
            handler=wds.ignore_and_continue,
            max_member_bytes=LIMIT,
            select_files=lambda name: not name.endswith(".b"),
        )
    )
    # Without its .b fields, sample 7's member over the limit is never read: it is kept.
    keep = [index for index in range(10) if index != 3]
    assert got == [(k, {"a": f["a"]}) for k, f in expected(0, keep) + expected(1, range(4))]


def keys_of(items: Any) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [item["__key__"] for item in items]


def stopped_and_restored(build: Any, k: int) -> list[str]:
    """The keys of a dataset stopped after ``k`` samples, then of one restored from its
    state."""
    first = build()
    it = iter(first)
    head = [next(it)["__key__"] for _ in range(k)]
    state = first.state_dict()
    it.close()
    second = build()
    second.load_state_dict(state)
    return head + keys_of(second)


@pytest.mark.parametrize("k", [0, 2, 3, 4, 6, 7, 8, 11])
def test_a_resumed_read_gives_what_an_uninterrupted_one_does(tmp_path: Path, k: int) -> None:
    """The lost samples are counted in the reader's position (the shard's numbering), so a
    checkpoint after one resumes after it, neither repeating nor losing a sample."""
    write_shard(tmp_path / "shard-000000.tar", 0, 10)
    write_shard(tmp_path / "shard-000001.tar", 1, 4)
    spec = f"{tmp_path}/shard-{{000000..000001}}.tar"

    def build() -> Any:
        return wds.WebDataset(
            spec, shardshuffle=False, handler=wds.ignore_and_continue, max_member_bytes=LIMIT
        )

    everything = keys_of(build())
    assert everything == [key(0, i) for i in KEPT] + [key(1, i) for i in range(4)]
    assert stopped_and_restored(build, k) == everything


def test_balanced_ranks_stay_in_step_and_disjoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Balancing counts a lost sample (it is in the shard): the rank it was given to repeats
    its last sample instead, and never takes the next rank's first."""
    path = write_shard(tmp_path / "s.tar", 0, 20)
    monkeypatch.setenv("WORLD_SIZE", "2")
    per_rank = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        per_rank.append(
            keys_of(
                wds.WebDataset(
                    str(path),
                    shardshuffle=False,
                    handler=wds.ignore_and_continue,
                    max_member_bytes=LIMIT,
                )
            )
        )
    assert [len(keys) for keys in per_rank] == [10, 10]
    assert per_rank[1] == [key(0, index) for index in range(10, 20)]
    assert per_rank[0] == [key(0, index) for index in KEPT] + [key(0, 9), key(0, 9)]
    assert max(Counter(per_rank[1]).values()) == 1


@pytest.mark.parametrize("k", range(11))
def test_a_balanced_read_resumed_while_it_repeats_gives_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """Rank 0's last sample is lost: it repeats the one before, and a checkpoint taken at
    any point (the repeat included) resumes to the same items."""
    path = write_shard(tmp_path / "s.tar", 2, 20)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    def build() -> Any:
        return wds.WebDataset(
            str(path), shardshuffle=False, handler=wds.ignore_and_continue, max_member_bytes=LIMIT
        )

    everything = keys_of(build())
    assert everything == [key(2, index) for index in range(9)] + [key(2, 8)]
    assert stopped_and_restored(build, k) == everything
