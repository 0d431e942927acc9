"""Tests for cloudshards.grouping, with webdataset 1.0.2's tariterators as the oracle."""

from __future__ import annotations

import io
import re
import tarfile
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudshards.errors import ShardFormatError
from cloudshards.grouping import group_members, is_meta_name, make_name_filter, split_key
from cloudshards.tar import iter_members
from cloudshards.types import Member, Oversized, Sample

with warnings.catch_warnings():
    # Only webdataset's own import-time warnings (if a release adds some) are silenced here.
    warnings.filterwarnings("ignore", module=r"webdataset(\..*)?$")
    import webdataset
    from webdataset import tariterators

PROPERTY = settings(
    deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def members(*names: str) -> Iterator[Member]:
    for offset, name in enumerate(names):
        yield Member(name, name.encode(), offset * 512)


def group(*names: str, **kw: Any) -> list[Sample]:
    return list(group_members(members(*names), url="u", **kw))


def write_tar(path: Path, files: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1.5
            tar.addfile(info, io.BytesIO(data))


def wds_samples(path: Path, **kw: Any) -> list[Sample]:
    """What webdataset 1.0.2's tarfile_samples yields for one local shard.

    Its opener never closes the files it opens (a ResourceWarning, an error under our pytest
    config), so the test hands it files it closes itself.
    """
    opened: list[Any] = []

    def gopen(url: str, mode: str = "rb", **kwargs: Any) -> Any:
        stream = open(url, mode)  # noqa: SIM115 - closed below
        opened.append(stream)
        return stream

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tariterators.gopen, "gopen", gopen)
        try:
            return list(tariterators.tarfile_samples([{"url": str(path)}], **kw))
        finally:
            for stream in opened:
                stream.close()


def our_samples(
    path: Path,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
) -> list[Sample]:
    name_filter = make_name_filter(select_files, rename_files)
    with open(path, "rb") as stream:
        return list(group_members(iter_members(stream, name_filter=name_filter), url=str(path)))


def wds_is_meta(name: str) -> bool:
    """webdataset's two skip rules from tar_file_iterator, verbatim."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return True
    return re.match(r"__[^/]*__($|/)", name) is not None


# --- split_key ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a/b/x.seg.png", ("a/b/x", "seg.png")),
        ("dir.v2/x.jpg", ("dir.v2/x", "jpg")),
        ("x.JPG", ("x", "JPG")),
        ("x.tar.gz", ("x", "tar.gz")),
        ("x.", ("x", "")),
        ("noext", None),
        ("dir.v2/noext", None),
        (".hidden", None),
        ("a/.hidden", ("a/", "hidden")),  # webdataset's regex, not "basename up to first dot"
        ("a/b/.x.jpg", ("a/b/", "x.jpg")),
        ("x/y.z/.hidden", None),
        ("", None),
        ("a/", None),
        ("a\nb.d/x.jpg", None),  # "." in the regex stops at newlines
    ],
)
def test_split_key(name: str, expected: tuple[str, str] | None) -> None:
    assert split_key(name) == expected
    key, field = tariterators.base_plus_ext(name)
    assert (None if key is None else (key, field)) == expected


@PROPERTY
@given(st.text(alphabet="ab./_\nA", max_size=14))
def test_split_key_matches_webdataset(name: str) -> None:
    key, field = tariterators.base_plus_ext(name)
    assert split_key(name) == (None if key is None else (key, field))


@given(st.text(max_size=30))
@PROPERTY
def test_split_key_matches_webdataset_unicode(name: str) -> None:
    key, field = tariterators.base_plus_ext(name)
    assert split_key(name) == (None if key is None else (key, field))


# --- meta names and the name filter ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "meta"),
    [
        ("__meta__", True),
        ("___", True),
        ("__", True),
        ("__dir__/x.jpg", True),
        ("__a__b__", True),
        ("__key__.txt", False),
        ("__x__y/z.jpg", False),
        ("a/__meta__", False),
        ("x.__key__", False),
        ("_single_.txt", False),
    ],
)
def test_is_meta_name(name: str, meta: bool) -> None:
    assert is_meta_name(name) is meta
    assert wds_is_meta(name) is meta


@PROPERTY
@given(st.text(alphabet="_a/.", max_size=12))
def test_is_meta_name_matches_webdataset(name: str) -> None:
    assert is_meta_name(name) == wds_is_meta(name)


def test_name_filter_renames_then_selects() -> None:
    seen: list[str] = []

    def select(name: str) -> bool:
        seen.append(name)
        return not name.endswith(".skip")

    name_filter = make_name_filter(select, lambda name: "r/" + name.upper())
    assert name_filter("x.jpg") == "r/X.JPG"
    assert name_filter("x.skip") == "r/X.SKIP"  # selection sees the renamed name
    assert name_filter("__meta__") is None  # meta checked on the original name
    assert seen == ["r/X.JPG", "r/X.SKIP"]

    no_hooks = make_name_filter(None, None)
    assert no_hooks("a.jpg") == "a.jpg"
    assert no_hooks("__dir__/a.jpg") is None
    assert make_name_filter(lambda n: n.endswith(".jpg"), None)("a.cls") is None


# --- group_members --------------------------------------------------------------------------


def test_group_consecutive_members() -> None:
    samples = group("a.jpg", "a.cls", "b.jpg", "noext", "b.seg.PNG", "a.txt")
    assert samples == [
        {"__key__": "a", "__url__": "u", "jpg": b"a.jpg", "cls": b"a.cls"},
        {"__key__": "b", "__url__": "u", "jpg": b"b.jpg", "seg.png": b"b.seg.PNG"},
        {"__key__": "a", "__url__": "u", "txt": b"a.txt"},  # not consecutive: a new sample
    ]


def test_group_keeps_case_when_asked() -> None:
    assert group("a.JPG", lowercase_fields=False) == [
        {"__key__": "a", "__url__": "u", "JPG": b"a.JPG"}
    ]


def test_group_empty() -> None:
    assert group() == []
    assert group("noext", "other") == []


@pytest.mark.parametrize(
    ("names", "field"),
    [(("a.jpg", "a.JPG"), "jpg"), (("a.x", "a.__key__"), "__key__"), (("a.__url__",), "__url__")],
)
def test_group_duplicate_field_raises(names: tuple[str, ...], field: str) -> None:
    with pytest.raises(ShardFormatError) as info:
        list(group_members(members(*names), url="s3://user:pw@b/s.tar", shard_index=3))
    exc = info.value
    assert exc.member == names[-1]
    assert exc.shard_index == 3
    assert exc.url == "s3://<redacted>@b/s.tar"
    assert repr(field) in str(exc)
    assert "'a'" in str(exc)


def test_group_is_lazy_and_streams() -> None:
    def endless() -> Iterator[Member]:
        index = 0
        while True:
            yield Member(f"{index}.cls", b"", 0)
            index += 1

    samples = group_members(endless(), url="u")
    assert next(samples)["__key__"] == "0"
    assert next(samples)["__key__"] == "1"


# --- members too large to read (given by the reader with skip_oversized) --------------------


def with_oversized(*names: str) -> Iterator[Member]:
    """Members named ``names``; a name marked ``!`` is given as the tar reader gives a member
    over the limit with ``skip_oversized``: its error in its place."""
    for offset, name in enumerate(names):
        if name.startswith("!"):
            error = ShardFormatError("too large", url="u", offset=offset * 512, member=name[1:])
            yield Member("", Oversized(name[1:], error), offset * 512)  # type: ignore[arg-type]
        else:
            yield Member(name, name.encode(), offset * 512)


def grouped(names: tuple[str, ...], on_oversize: Any) -> tuple[list[str], BaseException | None]:
    """The keys yielded (``-`` for a dropped sample's place), and the error that ended it."""
    got: list[str] = []
    try:
        for sample in group_members(
            with_oversized(*names), url="u", shard_index=5, on_oversize=on_oversize
        ):
            got.append(sample.get("__key__", "-"))
            if sample:
                assert all(
                    sample[k] == f"{sample['__key__']}.{k}".encode() for k in sample if k[0] != "_"
                )
    except ShardFormatError as exc:
        return got, exc
    return got, None


@pytest.mark.parametrize(
    ("names", "keys", "asked"),
    [
        (("a.x", "a.y", "!b.x", "b.y", "c.x"), ["a", "-", "c"], 1),
        (("a.x", "!a.y", "a.z", "b.x"), ["-", "b"], 1),  # never given with a field missing
        (("!a.x", "a.y", "b.x"), ["-", "b"], 1),
        (("a.x", "!b.x", "!b.y", "c.x"), ["a", "-", "c"], 2),  # asked twice, dropped once
        (("!a.x", "!b.x", "c.x"), ["-", "-", "c"], 2),
        (("a.x", "!b.x"), ["a", "-"], 1),
        (("a.x", "!b.x", "a.y"), ["a", "-", "a"], 1),  # not consecutive: samples of their own
        (("a.x", "!nokey", "a.y"), ["a"], 1),  # no key: grouping skips it, its sample goes on
    ],
)
def test_an_oversized_member_drops_its_whole_sample_when_the_handler_goes_on(
    names: tuple[str, ...], keys: list[str], asked: int
) -> None:
    errors: list[BaseException] = []

    def go_on(exc: BaseException) -> bool:
        errors.append(exc)
        return True

    assert grouped(names, go_on) == (keys, None)
    assert [exc.member for exc in errors] == [n[1:] for n in names if n.startswith("!")]  # type: ignore[attr-defined]
    assert len(errors) == asked
    assert all(exc.shard_index == 5 for exc in errors)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("names", "keys"),
    [
        (("a.x", "!b.x", "c.x"), ["a"]),  # the sample before it is complete: given first
        (("a.x", "!a.y", "b.x"), []),
        (("a.x", "!nokey", "a.y"), []),
    ],
)
def test_an_oversized_member_otherwise_ends_the_shard_as_the_readers_error_did(
    names: tuple[str, ...], keys: list[str]
) -> None:
    at = next(i for i, name in enumerate(names) if name.startswith("!"))

    def reader_raising() -> Iterator[Member]:  # what the tar reader did without skip_oversized
        yield from with_oversized(*names[:at])
        raise ShardFormatError("too large", url="u", offset=at * 512, member=names[at][1:])

    before: list[str] = []
    reference = None
    try:
        for sample in group_members(reader_raising(), url="u", shard_index=5):
            before.append(sample["__key__"])
    except ShardFormatError as exc:
        reference = exc
    assert reference is not None
    assert before == keys
    asked: list[BaseException] = []

    def stop(exc: BaseException) -> bool:
        asked.append(exc)
        return False

    def reraise(exc: BaseException) -> bool:
        asked.append(exc)
        raise exc

    for handler in (None, stop, reraise):
        asked.clear()
        got, error = grouped(names, handler)
        assert got == keys
        assert isinstance(error, ShardFormatError)
        assert (str(error), error.member, error.offset) == (
            str(reference),
            reference.member,
            reference.offset,
        )
        assert error.shard_index == 5
        assert asked == ([] if handler is None else [error])
        # A handler that said stop is not asked again by the reading stage.
        assert getattr(error, "handled", False) == (handler is stop)


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", ""]), st.booleans()), min_size=0, max_size=12
    )
)
@PROPERTY
def test_property_the_samples_kept_are_those_without_an_oversized_member(
    draws: list[tuple[str, bool]],
) -> None:
    """Against plain grouping of the same members: each sample holding an oversized member
    is replaced by ``{}``, every other sample is given as it is."""
    names: list[str] = []
    for number, (key, oversized) in enumerate(draws):
        name = f"{key}.f{number}" if key else f"nokey{number}"  # fields never repeat
        names.append("!" + name if oversized else name)
    plain = list(group_members(members(*(n.lstrip("!") for n in names)), url="u"))
    marked = {n[1:] for n in names if n.startswith("!")}
    expected = [
        {} if any(f"{s['__key__']}.{k}" in marked for k in s if k[0] != "_") else s for s in plain
    ]
    got = list(group_members(with_oversized(*names), url="u", on_oversize=lambda exc: True))
    assert got == expected


# --- oracle: webdataset 1.0.2 ---------------------------------------------------------------


def test_same_samples_as_webdataset_tarwriter(tmp_path: Path) -> None:
    path = tmp_path / "shard.tar"
    with webdataset.TarWriter(str(path), encoder=False) as writer:
        for index in range(50):
            writer.write(
                {
                    "__key__": f"dir.v{index % 3}/sample{index:04d}",
                    "jpg": bytes([index]) * (index * 97),
                    "seg.png": b"seg%d" % index,
                    "CLS": b"%d" % (index % 10),
                    "json": b"{}",
                }
            )
    expected = wds_samples(path)
    assert len(expected) == 50
    assert our_samples(path) == expected


ODD_NAMES = [
    "a/b/x.seg.png",
    "a/b/x.JPG",
    "dir.v2/x.jpg",
    "dir.v2/x.tar.gz",
    "noext",
    "y.txt",
    "__meta__",
    "__dir__/y.json",
    "y.cls",
    ".hidden",
    "a/.hidden",
    "z.",
    "unicodé/ñame.TXT",
    "long/" * 40 + "k.bin",
    "y.jpg",
]


def test_same_samples_as_webdataset_odd_names(tmp_path: Path) -> None:
    path = tmp_path / "odd.tar"
    write_tar(path, [(name, name.encode() * 3) for name in ODD_NAMES])
    assert our_samples(path) == wds_samples(path)


def test_same_samples_as_webdataset_with_hooks(tmp_path: Path) -> None:
    path = tmp_path / "hooks.tar"
    write_tar(path, [(name, name.encode()) for name in ODD_NAMES])

    def select(name: str) -> bool:
        return not name.endswith(".txt")

    def rename(name: str) -> str:
        return name.replace("dir.v2/", "renamed/").replace(".cls", ".label")

    expected = wds_samples(path, select_files=select, rename_files=rename)
    assert our_samples(path, select, rename) == expected


@settings(deadline=None, max_examples=40)
@given(
    st.lists(
        st.tuples(
            st.text(alphabet="ab._/XY", min_size=1, max_size=10).filter(
                lambda n: not n.endswith("/") and "//" not in n and not n.startswith("/")
            ),
            st.binary(max_size=600),
        ),
        max_size=12,
    )
)
def test_property_same_samples_as_webdataset(files: list[tuple[str, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random.tar"
        write_tar(path, files)
        try:
            expected: list[Sample] | type[Exception] = wds_samples(path)
        except ValueError:
            expected = ValueError  # webdataset's duplicate-field error
        try:
            got: list[Sample] | type[Exception] = our_samples(path)
        except ShardFormatError:
            got = ValueError
        assert got == expected
