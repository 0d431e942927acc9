"""webdataset 1.0.2's module paths in ``cloudshards.webdataset``, with webdataset as the oracle.

First every module-level name webdataset 1.0.2 defines for users must exist in the counterpart
module (or be on the explicit list of names left out, which raise a clear error). Then, module
by module, webdataset and cloudshards run on the same inputs and must give the same outputs.
Last, the errors old code catches and the ``install_as_webdataset()`` switch.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import gzip
import importlib
import inspect
import io
import json
import os
import pickle
import random
import subprocess
import sys
import tarfile
import textwrap
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset
from PIL import Image

import cloudshards
import cloudshards.webdataset as cs
from cloudshards.decoders import allow_unsafe_decoders
from cloudshards.errors import (
    CloudShardsError,
    ConfigError,
    DecodeError,
    ShardFormatError,
    UnsupportedError,
)

MakeShards = Callable[..., Any]

MODULES = [
    "",  # the top level
    "autodecode",
    "cache",
    "compat",
    "extradatasets",
    "filters",
    "gopen",
    "handlers",
    "mix",
    "pipeline",
    "pytorch",
    "shardlists",
    "tariterators",
    "tenbin",
    "utils",
    "writer",
]

# --- helpers ---------------------------------------------------------------------------------


def theirs_and_ours(module: str) -> tuple[types.ModuleType, types.ModuleType]:
    if not module:
        return webdataset, cs
    return (
        importlib.import_module(f"webdataset.{module}"),
        importlib.import_module(f"cloudshards.webdataset.{module}"),
    )


def webdataset_names(module: types.ModuleType) -> list[str]:
    """The names a webdataset module defines for users.

    Classes and functions whose ``__module__`` is webdataset's (defined there or imported from
    another webdataset module), and plain data (bool, int, str, list, dict...) or webdataset
    objects such as curried filters. Left out: dunders, modules, and names imported from the
    standard library, typing, torch or numpy.
    """
    names = []
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
            if (getattr(value, "__module__", "") or "").startswith("webdataset"):
                names.append(name)
        elif type(value).__module__ in ("builtins",) or type(value).__module__.startswith(
            "webdataset"
        ):
            names.append(name)
    return names


#: Names left out on purpose, per module, and why. Each must exist and raise a clear error.
UNSUPPORTED: dict[str, dict[str, str]] = {
    "": {
        "LMDBCached": "pickles samples into LMDB: unpickling is opt-in in cloudshards",
        "LRUCleanup": "webdataset's per-process cache internals; the node cache evicts itself",
    },
    "filters": {"LMDBCached": "pickles samples into LMDB: unpickling is opt-in in cloudshards"},
    "cache": {
        "LRUCleanup": "webdataset's per-process cache internals; the node cache evicts itself",
        "get_filetype": "runs the `file` command; cloudshards never shells out",
    },
    "gopen": {
        "gopen_htgs": "a curl of gs:// URLs; gs:// opens through gcsfs",
        "gopen_ais": "runs the ais command; AIStore is reachable through its S3 API",
    },
}

#: Callables whose parameters differ from webdataset's, and why that is acceptable.
SIGNATURE_DIFFERS = {
    ("", "DecodingError"): "cloudshards' DecodeError: also takes (message, url=, key=, field=)",
    ("autodecode", "DecodingError"): "cloudshards' DecodeError: code catches it",
    ("", "slice"): "webdataset's is itertools.islice curried; it has no signature",
    ("filters", "slice"): "webdataset's is itertools.islice curried; it has no signature",
}

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def signature_problems(theirs: Any, ours: Any) -> list[str]:
    """Ways a call written for ``theirs`` could fail on ``ours`` (empty when none).

    Curried filters (webdataset's ``shuffle = pipelinefilter(_shuffle)``) are compared
    without the stream argument they receive later.
    """
    their_params = list(inspect.signature(theirs).parameters.values())
    our_params = list(inspect.signature(ours).parameters.values())
    if hasattr(theirs, "__wrapped__") and not hasattr(ours, "__wrapped__"):
        their_params = their_params[1:]
    problems = []
    by_name = {p.name: p for p in our_params}
    takes_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in our_params)
    for i, param in enumerate(their_params):
        if param.kind in POSITIONAL:
            ok = i < len(our_params) and (
                our_params[i].name == param.name
                or our_params[i].kind == inspect.Parameter.VAR_POSITIONAL
            )
            if not ok and not any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in our_params):
                problems.append(f"positional parameter {i} should be {param.name!r}")
        elif param.kind in VARIADIC:
            if not any(p.kind == param.kind for p in our_params):
                problems.append(f"no {param.kind.description} parameter")
        elif param.name not in by_name and not takes_kw:
            problems.append(f"keyword {param.name!r} missing")
    their_names = {p.name for p in their_params}
    for param in our_params:
        if (
            param.name not in their_names
            and param.default is inspect.Parameter.empty
            and param.kind not in VARIADIC
        ):
            problems.append(f"extra required parameter {param.name!r}")
    return problems


@contextmanager
def oracle_quirks(files: bool = True) -> Iterator[None]:
    """Run webdataset code: it leaves files for the garbage collector to close.

    Its ResourceWarnings are ignored and the files collected (a full, slow collection: only
    when it may have opened files) while it runs, so cloudshards' own leaks still fail.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            yield
        finally:
            if files:
                gc.collect()


def canon(x: Any) -> Any:
    """A hashable, exactly comparable form: types, dtypes, shapes and bytes count."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.detach().contiguous().numpy().tobytes())
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, x.tobytes())
    if isinstance(x, np.generic):
        return ("npscalar", str(x.dtype), x.item())
    if isinstance(x, Image.Image):
        return ("pil", x.mode, x.size, x.tobytes())
    if isinstance(x, dict):
        items = ((str(k), canon(v)) for k, v in x.items() if k != "__local_path__")
        return ("dict", tuple(sorted(items, key=lambda kv: kv[0])))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(canon(v) for v in x))
    return (type(x).__name__, x)


def canon_list(items: Any) -> list[Any]:
    return [canon(x) for x in items]


def both(run: Callable[..., Any], module: str = "", *, files: bool = False) -> tuple[Any, Any]:
    """(webdataset's result, cloudshards') of ``run(module)`` on each side; ``files`` when
    webdataset opens files."""
    theirs, ours = theirs_and_ours(module)
    with oracle_quirks(files):
        expected = run(theirs)
    return expected, run(ours)


def image_bytes(seed: int, fmt: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> str:
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def memory_samples(n: int = 9) -> list[dict[str, Any]]:
    return [
        {
            "__key__": f"k{i:03d}",
            "__url__": "mem",
            "txt": f"text {i}".encode(),
            "cls": str(i % 3).encode(),
            "json": json.dumps({"i": i}).encode(),
        }
        for i in range(n)
    ]


@pytest.fixture
def unsafe_off() -> Iterator[None]:
    allow_unsafe_decoders(False)
    yield
    allow_unsafe_decoders(False)


@pytest.fixture
def odd_shards(tmp_path: Path) -> list[str]:
    """Shards with the cases grouping has rules for: meta members, directories in names,
    upper-case and multi-part extensions, names without a dot, a gzip member, and the same
    key at the end of one shard and the start of the next."""
    members = [
        ("__meta__", b"skipped"),
        ("a/x.JPG", image_bytes(1, "JPEG")),
        ("a/x.seg.png", image_bytes(2, "PNG")),
        ("a/x.txt.gz", gzip.compress(b"gz text", mtime=0)),
        ("README", b"no dot: skipped"),
        ("dir.v2/y.cls", b"4"),
        ("dir.v2/y.json", b'{"y": 1}'),
        ("same.cls", b"1"),
    ]
    second = [("same.cls", b"2"), ("same.txt", b"two"), ("z.npy", npy_bytes())]
    return [
        write_tar(tmp_path / "odd-0.tar", members, tarfile.USTAR_FORMAT),
        write_tar(tmp_path / "odd-1.tar", second, tarfile.GNU_FORMAT),
    ]


def npy_bytes() -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, np.arange(6, dtype=np.int16).reshape(2, 3))
    return out.getvalue()


# --- every name exists -----------------------------------------------------------------------


def all_names() -> list[tuple[str, str]]:
    return [(m, n) for m in MODULES for n in webdataset_names(theirs_and_ours(m)[0])]


def test_the_enumeration_sees_the_known_names() -> None:
    # Guards the enumeration rule itself: these are what open_clip-style programs import.
    names = set(all_names())
    for expected in [
        ("filters", "_shuffle"),
        ("filters", "_batched"),
        ("filters", "_map"),
        ("filters", "_select"),
        ("filters", "_to_tuple"),
        ("filters", "_xdecode"),
        ("filters", "slice"),
        ("filters", "pipelinefilter"),
        ("tariterators", "base_plus_ext"),
        ("tariterators", "valid_sample"),
        ("tariterators", "url_opener"),
        ("tariterators", "tar_file_expander"),
        ("tariterators", "group_by_keys"),
        ("tariterators", "meta_prefix"),
        ("shardlists", "expand_urls"),
        ("shardlists", "DirectoryShardList"),
        ("shardlists", "MultiShardSample"),
        ("utils", "pytorch_worker_seed"),
        ("utils", "PipelineStage"),
        ("", "PipelineStage"),
        ("", "TarWriter"),
    ]:
        assert expected in names
    assert ("tariterators", "Optional") not in names  # typing is not webdataset's
    assert ("filters", "np") not in names


@pytest.mark.parametrize(("module", "name"), all_names(), ids=lambda v: v or "top")
def test_webdataset_name_exists(module: str, name: str) -> None:
    theirs_module, ours_module = theirs_and_ours(module)
    assert hasattr(ours_module, name), f"cloudshards.webdataset.{module} lacks {name}"
    theirs, ours = getattr(theirs_module, name), getattr(ours_module, name)
    if inspect.isclass(theirs):
        assert inspect.isclass(ours), "webdataset code may subclass it"
    if callable(theirs):
        assert callable(ours)
    if name in UNSUPPORTED.get(module, {}):
        return  # checked in test_unsupported_name_raises_clear_error
    if callable(theirs) and (module, name) not in SIGNATURE_DIFFERS:
        try:
            inspect.signature(theirs)
        except (TypeError, ValueError):
            return  # builtins and exceptions without a signature
        assert signature_problems(theirs, ours) == []
    if not callable(theirs):
        assert type(ours) is type(theirs) or isinstance(ours, type(theirs))


UNSUPPORTED_NAMES = [(m, n) for m, names in UNSUPPORTED.items() for n in names]


@pytest.mark.parametrize(("module", "name"), UNSUPPORTED_NAMES, ids=lambda v: v or "top")
def test_unsupported_name_raises_clear_error(module: str, name: str) -> None:
    theirs_module, ours_module = theirs_and_ours(module)
    assert name in webdataset_names(theirs_module), "the allowlist names webdataset names only"
    ours = getattr(ours_module, name)
    with pytest.raises(CloudShardsError, match="not supported") as info:
        ours(b"")
    message = str(info.value)
    assert name.rpartition(".")[2] in message or "tenbin" in message
    # It says what to use instead.
    assert any(word in message for word in ("use", "instead", ".npy", "cache", "gs://", "S3"))


def test_unsupported_error_is_a_config_and_not_implemented_error() -> None:
    with pytest.raises(NotImplementedError):
        cs.filters.LMDBCached("db")
    with pytest.raises(ConfigError):
        cs.cache.LRUCleanup()
    assert issubclass(UnsupportedError, CloudShardsError)
    assert cloudshards.UnsupportedError is UnsupportedError


def test_multi_module_import_error_says_what_to_use() -> None:
    with pytest.raises(ImportError, match="DataLoader"):
        importlib.import_module("cloudshards.webdataset.multi")


def test_top_level_gopen_is_the_function_and_version_is_webdataset_api() -> None:
    assert cs.gopen is cs.gopen_schemes["__default__"].__globals__["gopen"]
    assert callable(cs.gopen)
    assert not isinstance(cs.gopen, types.ModuleType)
    assert cs.__version__ == webdataset.__version__ == "1.0.2"
    assert (
        cs.shardlists.expand_urls
        is importlib.import_module("cloudshards.webdataset.shardlists").expand_urls
    )


# --- tariterators ----------------------------------------------------------------------------


def shard_dicts(urls: list[str]) -> list[dict[str, Any]]:
    return [{"url": url} for url in urls]


def files_of(mod: types.ModuleType, urls: list[str], **kw: Any) -> list[dict[str, Any]]:
    return list(mod.tar_file_expander(mod.url_opener(shard_dicts(urls)), **kw))


def samples_of(mod: types.ModuleType, urls: list[str], **kw: Any) -> list[dict[str, Any]]:
    return list(mod.group_by_keys(mod.tar_file_expander(mod.url_opener(shard_dicts(urls))), **kw))


def test_tar_file_expander_default_is_webdataset_0_2_without_eof_marker(
    make_shards: MakeShards, odd_shards: list[str]
) -> None:
    urls = [str(p) for p in make_shards([3, 2]).paths] + odd_shards
    # 1.0.2 with its marker turned off gives exactly what cloudshards gives by default ...
    expected = None
    with oracle_quirks():
        expected = files_of(webdataset.tariterators, urls, eof_value=None)
    actual = files_of(cs.tariterators, urls)
    assert canon_list(actual) == canon_list(expected)
    assert {} not in actual
    # ... and asking cloudshards for the marker gives 1.0.2's default output.
    with oracle_quirks():
        expected = files_of(webdataset.tariterators, urls)
    assert canon_list(files_of(cs.tariterators, urls, eof_value={})) == canon_list(expected)
    assert expected.count({}) == len(urls)


def group_by_keys_nothrow(data: Any, keys: Any = None, lcase: bool = True) -> Iterator[Any]:
    """open_clip's grouping (training/data.py): it reads every item's "fname"."""
    keys = keys or webdataset.tariterators.base_plus_ext
    current = None
    for filesample in data:
        fname, value = filesample["fname"], filesample["data"]
        prefix, suffix = keys(fname)
        if prefix is None:
            continue
        if lcase:
            suffix = suffix.lower()
        if current is None or prefix != current["__key__"] or suffix in current:
            if webdataset.tariterators.valid_sample(current):
                yield current
            current = {"__key__": prefix, "__url__": filesample["__url__"]}
        current[suffix] = value
    if webdataset.tariterators.valid_sample(current):
        yield current


def test_custom_grouping_breaks_on_webdataset_1_0_2_and_works_here(
    make_shards: MakeShards,
) -> None:
    urls = [str(p) for p in make_shards([3, 2]).paths]
    with oracle_quirks(), pytest.raises(KeyError, match="fname"):
        list(group_by_keys_nothrow(files_of(webdataset.tariterators, urls)))
    actual = list(group_by_keys_nothrow(files_of(cs.tariterators, urls)))
    with oracle_quirks():
        expected = samples_of(webdataset.tariterators, urls)
    assert len(actual) == 5
    assert canon_list(actual) == canon_list(expected)


@pytest.mark.parametrize("kind", ["pax", "odd", "gzip-tar"])
def test_url_opener_expander_grouping_match(
    make_shards: MakeShards, odd_shards: list[str], tmp_path: Path, kind: str
) -> None:
    if kind == "pax":
        urls = [str(p) for p in make_shards([4, 1, 3]).paths]
    elif kind == "odd":
        urls = odd_shards
    else:
        plain = make_shards([5]).paths[0]
        gz = tmp_path / "shard.tar.gz"
        gz.write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
        urls = [str(gz), "file://" + str(plain)]
    expected, actual = both(lambda mod: samples_of(mod, urls), "tariterators", files=True)
    assert actual
    assert canon_list(actual) == canon_list(expected)
    expected, actual = both(
        lambda mod: list(mod.tarfile_samples(shard_dicts(urls))), "tariterators", files=True
    )
    assert canon_list(actual) == canon_list(expected)
    expected, actual = both(
        lambda mod: list(mod.tarfile_to_samples()(shard_dicts(urls))), "tariterators", files=True
    )
    assert canon_list(actual) == canon_list(expected)


def test_tar_file_iterator_options_match(odd_shards: list[str]) -> None:
    def run(mod: types.ModuleType, **kw: Any) -> list[Any]:
        with open(odd_shards[0], "rb") as stream:
            return list(mod.tar_file_iterator(stream, **kw))

    for kw in [
        {},
        {"skip_meta": None},
        {"skip_meta": r"a/"},
        {"select_files": lambda name: name.endswith(".cls")},
        {"rename_files": lambda name: name.upper()},
        {
            "rename_files": lambda name: name.replace("x.", "renamed."),
            "select_files": lambda name: "renamed" in name,
        },
    ]:
        expected, actual = both(lambda mod, kw=kw: run(mod, **kw), "tariterators", files=True)
        assert canon_list(actual) == canon_list(expected), kw


def test_failing_rename_goes_to_the_handler_per_member(odd_shards: list[str]) -> None:
    def rename(name: str) -> str:
        if name.endswith(".cls"):
            raise ValueError("bad name")
        return name

    def run(mod: types.ModuleType) -> list[Any]:
        with open(odd_shards[0], "rb") as stream:
            return list(
                mod.tariterators.tar_file_iterator(
                    stream, rename_files=rename, handler=mod.handlers.ignore_and_continue
                )
            )

    expected, actual = both(run, files=True)
    assert [f["fname"] for f in actual] == [f["fname"] for f in expected]
    assert "dir.v2/y.json" in [f["fname"] for f in actual]


def test_group_by_keys_options_match(odd_shards: list[str]) -> None:
    for kw in [{"lcase": False}, {"suffixes": {"cls", "txt"}}]:
        expected, actual = both(
            lambda mod, kw=kw: samples_of(mod, odd_shards, **kw), "tariterators", files=True
        )
        assert canon_list(actual) == canon_list(expected), kw


def test_group_by_keys_carries_local_path_like_webdataset(make_shards: MakeShards) -> None:
    url = str(make_shards([2]).paths[0])

    def run(mod: types.ModuleType) -> list[Any]:
        with open(url, "rb") as stream:
            sources = [{"url": url, "stream": stream, "local_path": url}]
            return list(mod.group_by_keys(mod.tar_file_expander(sources)))

    expected, actual = both(run, "tariterators", files=True)
    assert [s["__local_path__"] for s in actual] == [s["__local_path__"] for s in expected]
    assert [s["__local_path__"] for s in actual] == [url, url]


@pytest.mark.parametrize(
    "name",
    ["a.b", "a/b.c.d", "dir.v2/x.jpg", "a/.hidden", ".hidden", "noext", "a/b/", "x.", "é/ü.TXT"],
)
def test_base_plus_ext_matches(name: str) -> None:
    assert cs.tariterators.base_plus_ext(name) == webdataset.tariterators.base_plus_ext(name)


def test_small_tariterator_names_match() -> None:
    for sample in [None, {}, {"a": 1}, {"__bad__": True, "a": 1}, [1], {"__bad__": False}]:
        assert cs.tariterators.valid_sample(sample) == webdataset.tariterators.valid_sample(sample)
    for name in ("trace", "meta_prefix", "meta_suffix"):
        assert getattr(cs.tariterators, name) == getattr(webdataset.tariterators, name)
    assert list(cs.tariterators.shardlist("a-{0..3}.tar")) == list(
        webdataset.tariterators.shardlist("a-{0..3}.tar")
    )
    shuffled = list(cs.tariterators.shardlist(["a", "b", "c"], shuffle=True))
    assert sorted(s["url"] for s in shuffled) == ["a", "b", "c"]


def test_url_opener_handler_skips_missing_shards(make_shards: MakeShards, tmp_path: Path) -> None:
    urls = [str(tmp_path / "missing.tar"), str(make_shards([2]).paths[0])]

    def run(mod: types.ModuleType) -> list[str]:
        handler = mod.handlers.ignore_and_continue
        opened = list(mod.tariterators.url_opener(shard_dicts(urls), handler=handler))
        for source in opened:
            source["stream"].close()
        return [source["url"] for source in opened]

    assert both(run, files=True) == ([urls[1]], [urls[1]])


# --- filters ---------------------------------------------------------------------------------


def add_length(sample: dict[str, Any]) -> dict[str, Any] | None:
    if sample["__key__"].endswith("4"):
        return None  # dropped
    return {"n": len(sample["txt"]), "txt": sample["txt"]}


def fail_on_odd(sample: dict[str, Any]) -> dict[str, Any]:
    if int(sample["cls"]) % 2:
        raise ValueError("odd")
    return sample


def tuples(n: int = 7) -> list[tuple[Any, ...]]:
    return [(i, float(i) / 2, f"s{i}", np.full((2,), i, dtype=np.int32)) for i in range(n)]


def xdecode_samples() -> list[dict[str, Any]]:
    return [
        {"__key__": "a", "x.txt": b"hello", "x.bin": b"\x00\x01", "cls": b"3", "json": b"[1]"},
        {"__key__": "b", "x.txt": b"bye", "x.bin": b"", "cls": b"4", "json": b"{}"},
    ]


def image_samples() -> list[dict[str, Any]]:
    return [
        {"__key__": "i0", "png": image_bytes(0, "PNG"), "cls": b"0"},
        {"__key__": "i1", "jpg": image_bytes(1, "JPEG"), "cls": b"1"},
    ]


# (generator name, positional args, keyword args, input builder); each runs on both sides.
FILTER_CASES: dict[str, tuple[str, tuple[Any, ...], dict[str, Any], Callable[[], Any]]] = {
    "map": ("_map", (add_length,), {}, memory_samples),
    "map-handler": (
        "_map",
        (fail_on_odd,),
        {"handler": webdataset.handlers.ignore_and_continue},
        memory_samples,
    ),
    "map-stop": (
        "_map",
        (fail_on_odd,),
        {"handler": webdataset.handlers.ignore_and_stop},
        memory_samples,
    ),
    "select": ("_select", (lambda s: int(s["cls"]) == 1,), {}, memory_samples),
    "to_tuple": ("_to_tuple", ("txt", "cls;json"), {}, memory_samples),
    "to_tuple-spaces": ("_to_tuple", ("txt cls",), {}, memory_samples),
    "to_tuple-missing": (
        "_to_tuple",
        ("nope", "cls"),
        {"missing_is_error": False, "none_is_error": False},
        memory_samples,
    ),
    "to_tuple-missing-handler": (
        "_to_tuple",
        ("txt", "nope"),
        {"handler": webdataset.handlers.ignore_and_continue},
        lambda: [{**s, "nope": b"x"} if i % 2 else s for i, s in enumerate(memory_samples())],
    ),
    "to_tuple-defaultdict": (
        "_to_tuple",
        ("txt", "nope"),
        {"missing_is_error": False, "none_is_error": False},
        lambda: [collections.defaultdict(lambda: b"default", s) for s in memory_samples()],
    ),
    "rename": ("_rename", (), {"text": "txt", "label": "cls;json"}, memory_samples),
    "rename-keep-false": ("_rename", (), {"keep": False, "text": "txt"}, memory_samples),
    "map_dict": ("_map_dict", (), {"txt": bytes.upper, "cls": int}, memory_samples),
    "map_tuple": ("_map_tuple", (None, lambda x: x * 2, str.upper), {}, tuples),
    "batched": ("_batched", (3,), {}, tuples),
    "batched-dicts": ("_batched", (4,), {}, memory_samples),
    "batched-no-partial": ("_batched", (3,), {"partial": False}, tuples),
    "batched-listed": ("_batched", (2,), {"collation_fn": None}, tuples),
    "unbatched": ("_unbatched", (), {}, lambda: list(webdataset.filters._batched(tuples(), 3))),
    "unlisted": ("_unlisted", (), {}, lambda: [[1, 2], [3], []]),
    "extract_keys": ("_extract_keys", ("*.txt", "*.cls;*.nope"), {}, memory_samples),
    "extract_keys-missing": (
        "_extract_keys",
        ("*.nope", "*.json"),
        {"ignore_missing": True},
        memory_samples,
    ),
    "rename_keys": ("_rename_keys", (), {"text": "*.txt", "label": "cls"}, xdecode_samples),
    "rename_keys-keep": (
        "_rename_keys",
        (("label", "c*"),),
        {"keep_unselected": True},
        xdecode_samples,
    ),
    "xdecode": (
        "_xdecode",
        (("*.cls", lambda s: int(s.read())),),
        {"json": json.load},
        xdecode_samples,
    ),
    "xdecode-lenient": ("_xdecode", (), {"must_decode": False}, memory_samples),
    "associate": ("_associate", ({"k001": {"extra": 1}},), {}, memory_samples),
    "associate-callable": ("_associate", (lambda key: {"len": len(key)},), {}, memory_samples),
    "shuffle-rng": ("_shuffle", (5, 3), {"rng": random.Random(7)}, lambda: list(range(40))),
    "shuffle-seed": (
        "_shuffle",
        (),
        {"bufsize": 8, "initial": 2, "seed": 11},
        lambda: list(range(60)),
    ),
    "decode": ("_decode", (), {}, memory_samples),
    "decode-only": ("_decode", (), {"only": "cls"}, memory_samples),
    "decode-imagespec": ("_decode", ("rgb8",), {}, image_samples),
}


@pytest.mark.parametrize("case", sorted(FILTER_CASES))
def test_filter_generator_matches(case: str) -> None:
    name, args, kw, make_input = FILTER_CASES[case]

    def run(mod: types.ModuleType) -> list[Any]:
        call_kw = dict(kw)
        if "rng" in call_kw:
            call_kw["rng"] = random.Random(7)
        return list(getattr(mod.filters, name)(iter(make_input()), *args, **call_kw))

    expected, actual = both(run)
    assert actual or case in ("unlisted",)
    assert canon_list(actual) == canon_list(expected)
    # The curried form gives the same as the generator.
    curried_name = name.lstrip("_")
    if hasattr(cs.filters, curried_name) and "rng" not in kw:
        curried = getattr(cs.filters, curried_name)(*args, **kw)
        assert canon_list(curried(iter(make_input()))) == canon_list(actual)


def test_detshuffle_epochs_match() -> None:
    def run(mod: types.ModuleType) -> list[list[int]]:
        stage = mod.filters.detshuffle(bufsize=6, initial=3, seed=5)
        return [list(stage.run(iter(range(30)))) for _ in range(3)]

    expected, actual = both(run)
    assert actual == expected
    assert actual[0] != actual[1]


def test_small_filter_functions_match() -> None:
    theirs, ours = webdataset.filters, cs.filters
    sample = {"a": 1, "b": 2}
    for keys in ("b;a", ["c", "a"], "c"):
        assert ours.getfirst(sample, keys, missing_is_error=False) == theirs.getfirst(
            sample, keys, missing_is_error=False
        )
    assert ours.parse_field_spec("a;b c") == theirs.parse_field_spec("a;b c")
    assert ours.transform_with([1, 2, 3], [str, None]) == theirs.transform_with(
        [1, 2, 3], [str, None]
    )
    assert ours.tuple2dict((4, 5)) == theirs.tuple2dict((4, 5))
    assert ours.dict2tuple({0: "a", 1: "b"}) == theirs.dict2tuple({0: "a", 1: "b"})
    assert ours.compose(str, len)(123) == theirs.compose(str, len)(123)
    assert list(ours.pipeline(iter(range(5)), ours.slice(1, 4))) == list(
        theirs.pipeline(iter(range(5)), theirs.slice(1, 4))
    )
    assert ours.identity(sample) is sample
    for values in ([1, 2], [1.5, 2.5], [np.ones(2), np.zeros(2)], [torch.ones(2)] * 2, ["a"]):
        assert canon(ours.combine_values(values)) == canon(theirs.combine_values(values))
    rows = [{"a": 1, "b": np.ones(2)}, {"a": 2, "b": np.zeros(2)}]
    assert canon(ours.default_collation_fn(rows)) == canon(theirs.default_collation_fn(rows))
    # Shapes that cannot be stacked: webdataset asserts; code catching AssertionError (or,
    # for cloudshards, ValueError) catches ours.
    for unequal in ([np.ones(2), np.ones(3)], [torch.ones(2), torch.ones(3)]):
        for mod in (theirs, ours):
            with pytest.raises(AssertionError, match="all shapes must be equal"):
                mod.combine_values(unequal)
        with pytest.raises(ValueError, match="all shapes must be equal"):
            ours.combine_values(unequal)
    buf_ours, buf_theirs = list(range(10)), list(range(10))
    picks = [ours.pick(buf_ours, random.Random(3)) for _ in range(4)]
    assert picks == [theirs.pick(buf_theirs, random.Random(3)) for _ in range(4)]
    assert buf_ours == buf_theirs
    stream = io.BytesIO(b"text")
    assert ours.decode_text(stream) == "text"
    assert ours.decode_bin(io.BytesIO(b"\x00")) == theirs.decode_bin(io.BytesIO(b"\x00"))
    assert [p for p, _ in ours.default_decoders] == [p for p, _ in theirs.default_decoders]
    decoders: list[tuple[str, Callable[[Any], Any]]] = [("*.txt", str), ("*.jpg", bytes)]
    for path in ("a/x.TXT", "__key__", "y.png"):
        assert (ours.find_decoder(decoders, path) is None) == (
            theirs.find_decoder(decoders, path) is None
        )


def test_slice_matches() -> None:
    for args in [(3,), (2, 9), (1, 17, 4)]:
        expected, actual = both(
            lambda mod, args=args: list(mod.filters.slice(*args)(iter(range(20))))
        )
        assert actual == expected


def test_info_and_log_keys_output_match(tmp_path: Path) -> None:
    def run_info(mod: types.ModuleType) -> tuple[list[Any], str]:
        out = io.StringIO()
        passed = list(mod.filters._info(iter(memory_samples()), n=2, every=4, stream=out, name="x"))
        return passed, out.getvalue()

    expected, actual = both(run_info)
    assert canon_list(actual[0]) == canon_list(expected[0])
    assert actual[1] == expected[1]

    def run_log(mod: types.ModuleType) -> tuple[list[Any], str]:
        log = tmp_path / f"{mod.__name__}.log"
        passed = list(mod.filters._log_keys(iter(memory_samples(3)), str(log)))
        return passed, log.read_text()

    expected, actual = both(run_log, files=True)
    assert actual[1] == expected[1] == "".join(f"{i}\tNone\tNone\tk{i:03d}\n" for i in range(3))

    shard = tmp_path / "keys.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(3):
            info = tarfile.TarInfo(f"k{i:03d}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))

    def run_fluent(mod: types.ModuleType) -> str:  # WebDataset(...).log_keys(...) writes the same
        log = tmp_path / f"fluent-{mod.__name__}.log"
        list(mod.WebDataset(str(shard), shardshuffle=False).log_keys(str(log)))
        return log.read_text()

    expected_fluent, actual_fluent = both(run_fluent, files=True)
    assert actual_fluent == expected_fluent == actual[1]


def test_xdecode_false_keeps_the_bytes() -> None:
    def run(mod: types.ModuleType) -> list[Any]:
        return list(
            mod.filters._xdecode(iter(xdecode_samples()), ("*.txt", False), must_decode=False)
        )

    expected, actual = both(run)
    assert actual[0]["x.txt"] == b"hello"
    assert canon_list(actual) == canon_list(expected)


def test_decode_pickle_needs_the_opt_in(unsafe_off: None) -> None:
    payload = pickle.dumps({"x": [1, 2]})
    with pytest.raises(DecodeError, match="allow_unsafe_decoders"):
        cs.filters.decode_pickle(io.BytesIO(payload))
    allow_unsafe_decoders(True)
    expected = webdataset.filters.decode_pickle(io.BytesIO(payload))
    assert cs.filters.decode_pickle(io.BytesIO(payload)) == expected


def test_cached_replays_the_first_pass() -> None:
    stage = cs.filters.Cached()
    source = iter(range(5))
    assert list(stage.run(source)) == [0, 1, 2, 3, 4]
    assert list(stage.run(iter([]))) == [0, 1, 2, 3, 4]
    theirs = webdataset.filters.Cached()
    assert list(theirs.run(iter(range(5)))) == list(cs.filters.Cached().run(iter(range(5))))


# --- autodecode ------------------------------------------------------------------------------


def npz_bytes() -> bytes:
    out = io.BytesIO()
    np.savez(out, a=np.arange(3), b=np.eye(2))
    return out.getvalue()


def torch_bytes() -> bytes:
    out = io.BytesIO()
    torch.save(torch.arange(4, dtype=torch.float32), out)
    return out.getvalue()


#: One field per decoder name webdataset 1.0.2's basichandlers knows, with valid data.
DECODER_FIELDS: dict[str, Callable[[], bytes]] = {
    **dict.fromkeys(["txt", "text", "transcript"], lambda: "héllo".encode()),
    **dict.fromkeys(["cls", "cls2", "index", "inx", "id"], lambda: b" 42"),
    **dict.fromkeys(["json", "jsn"], lambda: b'{"a": [1, 2.5, null]}'),
    "npy": npy_bytes,
    "npz": npz_bytes,
    "pth": torch_bytes,
    "txt.gz": lambda: gzip.compress(b"zipped text"),
    "json.gz": lambda: gzip.compress(b'{"z": 1}'),
    "bin": lambda: b"\x00\xff",
}


@pytest.mark.parametrize("field", sorted(DECODER_FIELDS))
def test_each_decoder_name_matches(field: str, unsafe_off: None) -> None:
    sample = {"__key__": "k", "__url__": b"u", field: DECODER_FIELDS[field]()}
    expected, actual = both(lambda mod: mod.Decoder([])(dict(sample)), "autodecode")
    assert canon(actual) == canon(expected)
    expected, actual = both(lambda mod: mod.default_decoder(dict(sample)), "autodecode")
    assert canon(actual) == canon(expected)


@pytest.mark.parametrize("field", ["pkl", "pickle", "pyd"])
def test_pickle_decoders_match_after_the_opt_in(field: str, unsafe_off: None) -> None:
    sample = {"__key__": "k", field: pickle.dumps({"v": (1, "x")})}
    with pytest.raises(DecodeError, match="allow_unsafe_decoders"):
        cs.autodecode.Decoder([])(dict(sample))
    allow_unsafe_decoders(True)
    expected, actual = both(lambda mod: mod.Decoder([])(dict(sample)), "autodecode")
    assert actual == expected


@pytest.mark.parametrize("field", ["mp", "msg", "cbor"])
def test_decoders_needing_missing_packages_raise_import_errors(field: str) -> None:
    sample = {"__key__": "k", field: b"\x80"}
    for mod in (webdataset.autodecode, cs.autodecode):
        with pytest.raises((ImportError, DecodeError, webdataset.autodecode.DecodingError)) as info:
            mod.Decoder([])(dict(sample))
        cause = info.value if isinstance(info.value, ImportError) else info.value.__cause__
        assert isinstance(cause, ImportError)


@pytest.mark.parametrize("spec", sorted(webdataset.autodecode.imagespecs))
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_each_imagespec_matches(spec: str, fmt: str) -> None:
    data = image_bytes(3, fmt)
    key = ".png" if fmt == "PNG" else ".JPG"
    expected, actual = both(lambda mod: mod.ImageHandler(spec)(key, data), "autodecode")
    assert canon(actual) == canon(expected)
    expected, actual = both(lambda mod: mod.imagehandler(spec)(".cls", data), "autodecode")
    assert actual is expected is None


def test_handler_helpers_match() -> None:
    def upper(data: bytes) -> bytes:
        return data.upper()

    for key in (".seg.png", ".png", ".SEG.PNG", ".x"):
        expected, actual = both(
            lambda mod, key=key: mod.handle_extension("seg.png x", upper)(key, b"ab"), "autodecode"
        )
        assert actual == expected
        expected, actual = both(
            lambda mod, key=key: mod.call_extension_handler(key, b"ab", upper, ["seg.png", "x"]),
            "autodecode",
        )
        assert actual == expected
    for key in (".txt", ".cls", ".unknown", ".a.json"):
        data = b"7" if "cls" in key else b"[1]" if "json" in key else b"t"
        assert cs.autodecode.basichandlers(key, data) == webdataset.autodecode.basichandlers(
            key, data
        )
    theirs = webdataset.autodecode.gzfilter(".txt.gz", gzip.compress(b"abc"))
    ours = cs.autodecode.gzfilter(".txt.gz", gzip.compress(b"abc"))
    assert ours is not None
    assert (ours.key, ours.data) == (theirs.key, theirs.data)
    assert cs.autodecode.gzfilter(".txt", b"") is webdataset.autodecode.gzfilter(".txt", b"")
    assert sorted(cs.autodecode.decoders) == sorted(webdataset.autodecode.decoders)
    assert cs.autodecode.imagespecs == {
        k: tuple(v) for k, v in webdataset.autodecode.imagespecs.items()
    }
    assert cs.autodecode.IMAGE_EXTENSIONS == webdataset.autodecode.IMAGE_EXTENSIONS
    for name in ("npy_loads", "npz_loads"):
        data = npy_bytes() if name == "npy_loads" else npz_bytes()
        assert canon(getattr(cs.autodecode, name)(data)) == canon(
            getattr(webdataset.autodecode, name)(data)
        )


def test_decoder_partial_and_only_match() -> None:
    sample = {"__key__": "k", "cls": b"1", "txt": b"t", "done": 5}
    expected, actual = both(lambda mod: mod.Decoder([], partial=True)(dict(sample)), "autodecode")
    assert actual == expected
    expected, actual = both(lambda mod: mod.Decoder([], only=["cls"])(dict(sample)), "autodecode")
    assert actual == expected


def test_registering_in_the_decoders_table_decodes(unsafe_off: None) -> None:
    cs.autodecode.decoders["rev"] = lambda data: data[::-1]
    try:
        assert cs.autodecode.Decoder([])({"__key__": "k", "rev": b"abc"})["rev"] == b"cba"
    finally:
        del cs.autodecode.decoders["rev"]


def test_audio_and_video_handlers_pass_other_extensions() -> None:
    for mod in (webdataset.autodecode, cs.autodecode):
        assert mod.torch_audio(".txt", b"") is None
        assert mod.torch_video(".txt", b"") is None


# --- shardlists ------------------------------------------------------------------------------


def test_expand_urls_and_sources_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WDS_ROOT", "/data/${SUB}")
    monkeypatch.setenv("WDS_SUB", "train")
    for spec in ["a-{000..003}.tar", "x{a,b}::y-{1..2}", "${ROOT}/s-{0..1}.tar", "plain.tar"]:
        assert cs.shardlists.expand_urls(spec) == webdataset.shardlists.expand_urls(spec)
    assert cs.shardlists.envsubst("${ROOT}") == webdataset.shardlists.envsubst("${ROOT}")
    for make in (lambda: "a{0..2}", lambda: ["x", "y"], lambda: iter(["p", "q"])):
        expected, actual = both(lambda mod, make=make: mod.expand_source(make()), "shardlists")
        assert actual == expected
    with pytest.raises(ValueError, match="cannot handle"):
        cs.shardlists.expand_source(42)
    assert cs.shardlists.expand("~/x") == webdataset.shardlists.expand("~/x")


def test_shard_lists_and_splitters_match(monkeypatch: pytest.MonkeyPatch) -> None:
    urls = [f"shard-{i}.tar" for i in range(9)]
    for seed in (None, 3, 17):
        expected, actual = both(
            lambda mod, seed=seed: list(mod.SimpleShardList(urls, seed=seed)), "shardlists"
        )
        assert actual == expected
    assert len(cs.shardlists.SimpleShardList("a{0..4}")) == 5
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("WORKER", "1")
    monkeypatch.setenv("NUM_WORKERS", "2")
    for splitter in ("split_by_node", "split_by_worker"):
        expected, actual = both(
            lambda mod, splitter=splitter: list(getattr(mod, splitter)(iter(urls))), "shardlists"
        )
        assert actual == expected
    for mod in (webdataset.shardlists, cs.shardlists):
        with pytest.raises(ValueError, match="nodesplitter"):
            list(mod.single_node_only(iter(urls)))
        with pytest.raises(ValueError, match="no data"):
            list(mod.non_empty(iter([])))
    assert list(cs.shardlists.non_empty(iter(urls))) == urls


def test_resampled_draws_from_the_list() -> None:
    urls = ["a", "b", "c"]
    drawn = [s["url"] for s in cs.shardlists.ResampledShards(urls, nshards=20)]
    assert len(drawn) == 20
    assert set(drawn) <= set(urls)
    assert cs.shardlists.ResampledShardList is cs.shardlists.ResampledShards
    picked = list(cs.shardlists.resampled_(iter(urls), n=7))
    assert len(picked) == 7
    assert set(picked) <= set(urls)
    assert len(list(cs.shardlists.resampled(5)(iter(urls)))) == 5


MULTI_SPEC: dict[str, Any] = {
    "prefix": "s3://bucket/",
    "datasets": [
        {"name": "all", "shards": "laion-{000..004}.tar"},
        {"name": "some", "buckets": "cc12m", "shards": "cc-{00..09}.tar", "choose": 3},
        {"name": "more", "shards": ["x-{0..2}.tar", "y.tar"], "resample": 6},
    ],
}


def test_multi_shard_sample_matches_after_set_epoch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ALLOW_OBSOLETE", "1")  # webdataset 1.0.2 marks it obsolete
    spec_file = tmp_path / "spec.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(MULTI_SPEC))
    for spec in (MULTI_SPEC, str(spec_file)):

        def run(mod: types.ModuleType, spec: Any = spec) -> list[list[str]]:
            sample = mod.MultiShardSample(spec)
            sample.set_epoch(1234)
            return [sample.get_shards_for_epoch() for _ in range(3)] + [[s["url"] for s in sample]]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            expected, actual = both(run, "shardlists")
        assert actual == expected
        assert len(actual[0]) == 5 + 3 + 6
        assert actual[0] != actual[1]
    assert dataclasses.asdict(cs.shardlists.MSSource(name="n", urls=["u"])) == dataclasses.asdict(
        webdataset.shardlists.MSSource(name="n", urls=["u"])
    )
    assert type(cs.shardlists.shardspec(str(spec_file))).__name__ == "MultiShardSample"
    assert type(cs.shardlists.shardspec("a{0..1}")).__name__ == "SimpleShardList"
    assert cloudshards.MultiShardSample is cs.shardlists.MultiShardSample


def test_multi_shard_sample_is_the_same_on_every_rank_without_set_epoch() -> None:
    from cloudshards.dist import WorkerInfo
    from cloudshards.stages.base import IterationContext, iteration_context

    lists = []
    for rank in range(3):
        context = IterationContext(seed=9, epoch=2, info=WorkerInfo(rank=rank, world_size=3))
        with iteration_context(context):
            lists.append(cs.shardlists.MultiShardSample(MULTI_SPEC).get_shards_for_epoch())
    assert lists[0] == lists[1] == lists[2]
    with iteration_context(IterationContext(seed=9, epoch=3, info=WorkerInfo())):
        assert cs.shardlists.MultiShardSample(MULTI_SPEC).get_shards_for_epoch() != lists[0]
    pipeline = cloudshards.DataPipeline(
        cs.shardlists.MultiShardSample(MULTI_SPEC), cloudshards.split_by_node
    )
    first, second = list(pipeline), list(pipeline)
    assert len(first) == 14
    assert first != second


def test_multi_shard_sample_rejects_bad_specs() -> None:
    with pytest.raises(ConfigError, match="unknown dataset keys"):
        cs.shardlists.MultiShardSample({"datasets": [{"shards": "a", "weight": 2}]})
    with pytest.raises(ConfigError, match="choose"):
        cs.shardlists.MultiShardSample({"datasets": [{"shards": "a{0..1}", "choose": 3}]})


def test_directory_shard_list_claims_and_recycles(tmp_path: Path) -> None:
    for name in ("a.tar", "b.tgz", "c.txt"):
        (tmp_path / name).write_bytes(b"x")
    shards = cs.shardlists.DirectoryShardList(str(tmp_path) + "/", poll=None, mode="keep")
    seen = []
    for item in shards:
        assert Path(item["url"]).exists()
        assert item["url"].endswith(f"._{os.getpid()}_")
        seen.append(Path(item["url"]).name.split(".")[0])
    assert sorted(seen) == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar._done_", "b.tgz._done_", "c.txt"]
    for fname in ("x.tar._1_", "y.tar._2_"):
        assert cs.shardlists.get_pid_from_filename(
            fname
        ) == webdataset.shardlists.get_pid_from_filename(fname)
        assert cs.shardlists.without_last_extension(
            fname
        ) == webdataset.shardlists.without_last_extension(fname)
    assert cs.shardlists.check_pid_is_running(os.getpid())
    with pytest.raises(ConfigError, match="directory"):
        cs.shardlists.DirectoryShardList(str(tmp_path))


# --- utils -----------------------------------------------------------------------------------


def test_utils_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs, ours = webdataset.utils, cs.utils
    for args in [(1, 2, 3), ("a", 7), ()]:
        assert ours.make_seed(*args) == theirs.make_seed(*args)
    for obj in ["s", b"b", [1], (1,), iter([]), {"a": 1}, 3, None]:
        assert ours.is_iterable(obj) == theirs.is_iterable(obj)
    for name in ("a1.tar", "a2.tar", "b1.tar"):
        (tmp_path / name).write_bytes(b"")
    pattern = str(tmp_path / "{a,b}1.tar")
    assert sorted(ours.glob_with_braces(pattern)) == sorted(theirs.glob_with_braces(pattern))
    assert ours.fnmatch_with_braces("x.jpg", "*.{png,jpg}") == theirs.fnmatch_with_braces(
        "x.jpg", "*.{png,jpg}"
    )
    assert ours.safe_eval("12") == theirs.safe_eval("12") == 12
    for mod in (theirs, ours):
        with pytest.raises(ValueError, match="illegal"):
            mod.safe_eval("1+1")
    assert ours.guess_batchsize(([1, 2, 3], [4, 5, 6])) == 3
    assert list(ours.repeatedly0([1, 2, 3], nepochs=2, nbatches=2)) == list(
        theirs.repeatedly0([1, 2, 3], nepochs=2, nbatches=2)
    )
    kws: list[dict[str, Any]] = [{"nepochs": 3}, {"nbatches": 5}, {"nsamples": 7}]
    for kw in kws:
        batches = [([i, i], [i, i]) for i in range(3)]
        assert list(ours.repeatedly(batches, **kw)) == list(theirs.repeatedly(batches, **kw))
    assert ours.identity(5) == 5
    assert ours.enforce_security == theirs.enforce_security
    np.testing.assert_array_equal(
        ours.compute_sample_weights([(10, 0.5), (4, 2.0)]),
        theirs.compute_sample_weights([(10, 0.5), (4, 2.0)]),
    )
    assert ours.lookup_sym("_shuffle", [".filters"]) is cs.filters._shuffle
    assert theirs.lookup_sym("_shuffle", [".filters"]) is webdataset.filters._shuffle
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("WORKER", "1")
    monkeypatch.setenv("NUM_WORKERS", "3")
    assert ours.pytorch_worker_info() == theirs.pytorch_worker_info() == (2, 4, 1, 3)
    assert ours.pytorch_worker_seed() == theirs.pytorch_worker_seed() == 2001


def plus_one(x: int) -> int:
    return x + 1


def ran() -> str:
    return "ran"


def test_deprecated_and_obsolete_match(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in (webdataset.utils, cs.utils):
        f = mod.deprecated("use g")(plus_one)
        with pytest.warns(DeprecationWarning, match="Reason: use g"):
            assert f(1) == 2
        with pytest.warns(DeprecationWarning, match="plus_one"):
            assert mod.deprecated(plus_one)(2) == 3
        old = mod.obsolete(reason="gone")(ran)
        with pytest.raises(mod.ObsoleteException, match="ALLOW_OBSOLETE"):
            old()
        monkeypatch.setenv("ALLOW_OBSOLETE", "1")
        assert old() == "ran"
        monkeypatch.delenv("ALLOW_OBSOLETE")


# --- handlers --------------------------------------------------------------------------------


def test_handlers_match() -> None:
    error = ValueError("boom")
    for name in ("ignore_and_continue", "ignore_and_stop"):
        assert getattr(cs.handlers, name)(error) == getattr(webdataset.handlers, name)(error)
    for mod in (webdataset.handlers, cs.handlers):
        with pytest.raises(ValueError, match="boom"):
            mod.reraise_exception(error)
    # webdataset's warning handlers also sleep 0.5 s; cloudshards' do not.
    for name, result in (("warn_and_continue", True), ("warn_and_stop", False)):
        with pytest.warns(UserWarning, match="boom"):
            assert getattr(cs.handlers, name)(error) is result


# --- mix, extradatasets, pipeline, compat ----------------------------------------------------


def test_mix_matches() -> None:
    sources: list[list[Any]] = [[1, 2, 3], ["a"], [10, 20]]
    for longest in (False, True):
        expected, actual = both(lambda mod, lg=longest: list(mod.RoundRobin(sources, lg)), "mix")
        assert actual == expected
        expected, actual = both(
            lambda mod, lg=longest: list(
                (mod.round_robin_longest if lg else mod.round_robin_shortest)(
                    *[iter(s) for s in sources]
                )
            ),
            "mix",
        )
        assert actual == expected
    expected, actual = both(lambda mod: list(mod.RandomMix(sources, [1, 2, 3], True)), "mix")
    assert Counter(actual) == Counter(expected)
    expected, actual = both(
        lambda mod: list(mod.random_samples([iter(s) for s in sources], longest=True)), "mix"
    )
    assert Counter(actual) == Counter(expected)


def test_extradatasets() -> None:
    expected, actual = both(lambda mod: list(mod.MockDataset({"a": 1}, 3)), "extradatasets")
    assert actual == expected == [{"a": 1}] * 3
    assert len(cs.extradatasets.with_length([1, 2], 5)) == 5
    # webdataset 1.0.2's with_epoch and repeatedly classes cannot be iterated; these can.
    assert list(cs.extradatasets.with_epoch([1, 2, 3], 5)) == [1, 2, 3, 1, 2]
    assert list(cs.extradatasets.repeatedly([1, 2], nepochs=3)) == [1, 2] * 3
    assert list(cs.extradatasets.repeatedly(None, nbatches=5).run([1, 2])) == [1, 2, 1, 2, 1]


def test_pipeline_and_add_length_method_match() -> None:
    def run(mod: types.ModuleType) -> tuple[list[Any], int]:
        pipeline = mod.pipeline.DataPipeline(
            [memory_samples()],  # a list argument is a list of stages
            mod.filters.map(add_length),
            mod.filters.select(lambda s: s["n"] % 2 == 0),
            mod.filters.to_tuple("txt", "n"),
        )
        result = list(pipeline)
        pipeline.size = 7
        return result, len(mod.pipeline.add_length_method(pipeline))

    expected, actual = both(run)
    assert actual[1] == expected[1] == 7
    assert canon_list(actual[0]) == canon_list(expected[0])


def test_compat_module_matches(make_shards: MakeShards) -> None:
    spec = make_shards([3, 4]).spec()

    def run(mod: types.ModuleType) -> list[Any]:
        ds = mod.compat.WebDataset(spec, shardshuffle=False).decode().to_tuple("cls", "json")
        wrapped = mod.compat.FluidWrapper(memory_samples(4)).map(add_length).to_tuple("n")
        return [*ds, *wrapped, *mod.compat.check_empty(iter([1]))]

    expected, actual = both(run, files=True)
    assert canon_list(actual) == canon_list(expected)
    for mod in (webdataset.compat, cs.compat):
        with pytest.raises(ValueError, match="No samples"):
            list(mod.check_empty(iter([])))


# --- gopen -----------------------------------------------------------------------------------

# As in webdataset, the package attribute `gopen` is the function; these are the modules.
THEIR_GOPEN, OUR_GOPEN = theirs_and_ours("gopen")


def test_gopen_reads_and_writes_local_files_like_webdataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytes(range(256)) * 40
    for mod in (THEIR_GOPEN, OUR_GOPEN):
        path = tmp_path / f"{mod.__name__}.bin"
        with mod.gopen(str(path), "wb") as out:
            out.write(data)
        for url in (str(path), "file://" + str(path)):
            with mod.gopen(url) as stream:
                assert stream.read() == data
            with mod.reader(url) as stream:
                assert stream.read(10) == data[:10]
    monkeypatch.setenv("GOPEN_REWRITE", "gs://bucket=/local/dir;s3://x=/y")
    for url in ("gs://bucket/a.tar", "s3://x/b", "http://h/c"):
        assert OUR_GOPEN.rewrite_url(url) == THEIR_GOPEN.rewrite_url(url)
    for mod in (THEIR_GOPEN, OUR_GOPEN):
        with pytest.raises(ValueError, match="no gopen handler"):
            mod.gopen_error("x://y")
        assert mod.set_options(io.BytesIO(), timeout=1) is False
        with pytest.raises((ValueError, AssertionError)):
            mod.gopen(str(tmp_path / "x"), "r")


def test_gopen_rewrite_applies_to_every_shard_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GOPEN_REWRITE points a bucket at a mirror: webdataset applies it in gopen, so to every
    # shard its pipelines open; the samples keep the URL they were given as __url__.
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for shard in range(2):
        with cloudshards.TarWriter(str(mirror / f"s-{shard}.tar")) as sink:
            for i in range(3):
                sink.write({"__key__": f"k{shard}{i}", "txt": "x"})
    spec = "http://shards.invalid/data/s-{0..1}.tar"
    monkeypatch.setenv("GOPEN_REWRITE", f"http://shards.invalid/data/={mirror}/")
    keys = [f"k{shard}{i}" for shard in range(2) for i in range(3)]
    for mod in (webdataset, cloudshards):
        with oracle_quirks(files=mod is webdataset):
            dataset = mod.WebDataset(spec, shardshuffle=False)
            assert [(s["__key__"], s["__url__"]) for s in dataset] == [
                (key, f"http://shards.invalid/data/s-{key[1]}.tar") for key in keys
            ]
            pipeline = mod.DataPipeline(mod.SimpleShardList(spec), mod.tarfile_to_samples())
            assert [s["__key__"] for s in pipeline] == keys


def test_wds_secure_refuses_local_files_and_rewrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a.tar"
    with cloudshards.TarWriter(str(path)) as sink:
        sink.write({"__key__": "a", "txt": "x"})
    monkeypatch.setattr(cs.utils, "enforce_security", True)
    monkeypatch.setattr(webdataset.utils, "enforce_security", True)
    with pytest.raises(ValueError, match="local files"):
        list(cloudshards.WebDataset(str(path), shardshuffle=False))
    for gopen in (THEIR_GOPEN.gopen, OUR_GOPEN.gopen):
        with pytest.raises(ValueError, match="cannot open local files"):
            gopen(str(path))
    monkeypatch.setenv("GOPEN_REWRITE", "s3://x=/y")
    with pytest.raises(ValueError, match="WDS_SECURE"):
        list(cloudshards.WebDataset("s3://x/a.tar", shardshuffle=False))


def test_gopen_uses_registered_scheme_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    def custom(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        return io.BytesIO(url.encode())

    for mod in (THEIR_GOPEN, OUR_GOPEN):
        monkeypatch.setitem(mod.gopen_schemes, "myproto", custom)
        assert mod.gopen("myproto://thing").read() == b"myproto://thing"
    assert set(THEIR_GOPEN.gopen_schemes) == set(OUR_GOPEN.gopen_schemes)


class _Objects:
    """A store of the test's own behind a URL scheme: what a user registers in gopen_schemes."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []

    def open(self, url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        self.calls.append((url, mode))
        if mode == "rb":
            return io.BytesIO(self.objects[url])
        objects = self.objects

        class Upload(io.BytesIO):
            def close(self) -> None:
                objects[url] = self.getvalue()
                super().close()

        return Upload()


@pytest.mark.parametrize("scheme", ["myproto", "http"])
def test_datasets_and_writers_use_registered_scheme_handlers(
    monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """webdataset's readers and writers open through gopen_schemes: a scheme of the user's,
    or one whose entry the user replaced, reads and writes through the user's opener."""
    got = {}
    for name, lib, gopen in (("theirs", webdataset, THEIR_GOPEN), ("ours", cloudshards, OUR_GOPEN)):
        store = _Objects()
        monkeypatch.setitem(gopen.gopen_schemes, scheme, store.open)
        with lib.ShardWriter(f"{scheme}://bucket/s-%d.tar", maxcount=3) as sink:
            for i in range(5):
                sink.write({"__key__": f"k{i}", "txt": f"t{i}"})
        urls = f"{scheme}://bucket/s-{{0..1}}.tar"
        samples = [
            (s["__key__"], s["txt"], s["__url__"]) for s in lib.WebDataset(urls, shardshuffle=False)
        ]
        opened = [
            s["url"] for s in lib.tariterators.url_opener([{"url": f"{scheme}://bucket/s-1.tar"}])
        ]
        got[name] = (sorted(store.objects), samples, opened, sorted(set(store.calls)))
    assert got["ours"] == got["theirs"]
    assert len(got["ours"][1]) == 5


def test_gopen_opens_fsspec_urls_that_webdataset_cannot(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/wds-gopen/a.bin", b"in memory")
    with pytest.raises(ValueError, match="no gopen handler"):
        THEIR_GOPEN.gopen("memory://wds-gopen/a.bin")
    with OUR_GOPEN.gopen("memory://wds-gopen/a.bin") as stream:
        assert stream.read() == b"in memory"
    with OUR_GOPEN.gopen("memory://wds-gopen/b.bin", "wb") as out:
        out.write(b"written")
    assert fs.cat("/wds-gopen/b.bin") == b"written"
    fs.rm("/wds-gopen", recursive=True)


def test_pipe_urls_need_the_opt_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"through a pipe")
    url = f"pipe:cat {path}"
    with pytest.raises(ConfigError, match="CLOUDSHARDS_ALLOW_PIPE"):
        OUR_GOPEN.gopen(url)
    with pytest.raises(ConfigError, match="allow_pipe"):
        OUR_GOPEN.Pipe(["cat", str(path)], mode="rb")
    expected = None
    with oracle_quirks(), THEIR_GOPEN.gopen(url) as stream:
        expected = stream.read()
    with OUR_GOPEN.gopen(url, allow_pipe=True) as stream:
        assert stream.read() == expected == b"through a pipe"
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PIPE", "1")
    with OUR_GOPEN.gopen(url) as stream:
        assert OUR_GOPEN.set_options(stream, timeout=5.0) is True
        assert stream.read() == expected
    with OUR_GOPEN.gopen(f"pipe:cat > {tmp_path / 'out.bin'}", "wb") as out:
        out.write(b"written by a pipe")
    assert (tmp_path / "out.bin").read_bytes() == b"written by a pipe"

    def read_all(url: str) -> bytes:
        with OUR_GOPEN.gopen(url) as stream:
            data: bytes = stream.read()
            return data

    with pytest.raises(OSError, match="exit 3"):
        read_all("pipe:exit 3")


def test_pipe_errors_name_the_program_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rest of a command line may hold a token (curl -H 'Authorization: Bearer ...')."""
    secret = "Bearer SECRETTOKEN"
    command = f"sh -c 'exit 3' -- -H 'Authorization: {secret}'"
    for attempt in (
        lambda: OUR_GOPEN.gopen(f"pipe:HF_TOKEN=SECRETTOKEN {command}"),  # a variable first
        lambda: OUR_GOPEN.gopen(f"pipe:{command}"),
        lambda: OUR_GOPEN.Pipe(command, mode="rb", shell=True),
        lambda: OUR_GOPEN.Pipe(["sh", "-c", "exit 3", secret], mode="rb"),
    ):
        with pytest.raises(ConfigError) as refused:
            attempt()
        assert "SECRETTOKEN" not in str(refused.value)
        assert "'sh'" in str(refused.value)
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PIPE", "1")
    pipe = OUR_GOPEN.gopen(f"pipe:{command}")
    assert "SECRETTOKEN" not in str(pipe)
    pipe.stream.read()  # to the end: the command has exited
    with pytest.raises(OSError, match="exit 3") as failed:
        pipe.close()
    assert "SECRETTOKEN" not in str(failed.value)


# --- writer ----------------------------------------------------------------------------------


def writer_samples() -> list[dict[str, Any]]:
    pixels = np.random.default_rng(0).integers(0, 256, size=(4, 6, 3), dtype=np.uint8)
    return [
        {
            "__key__": f"w{i:03d}",
            "txt": f"caption {i}",
            "cls": i,
            "json": {"i": i, "tags": ["a", "b"]},
            "npy": np.arange(i + 2, dtype=np.float32),
            "png": pixels,
            "txt.gz": "compressed " * 5,
            "bin": bytes([i]) * 3,
        }
        for i in range(5)
    ]


def write_with(mod: types.ModuleType, path: Path) -> str:
    with mod.writer.TarWriter(str(path)) as sink:
        for sample in writer_samples():
            sink.write(sample)
    return str(path)


def test_both_writers_output_reads_the_same_with_both_readers(
    tmp_path: Path, unsafe_off: None
) -> None:
    with oracle_quirks():
        written = [write_with(webdataset, tmp_path / "theirs.tar")]
    written.append(write_with(cs, tmp_path / "ours.tar"))
    results = []
    for url in written:
        expected, actual = both(
            lambda mod, url=url: list(
                mod.filters.decode()(mod.tariterators.tarfile_samples([{"url": url}]))
            ),
            files=True,
        )
        assert canon_list(actual) == canon_list(expected)
        results.append([{k: v for k, v in s.items() if k != "__url__"} for s in actual])
    assert canon_list(results[0]) == canon_list(results[1])
    assert [s["txt.gz"] for s in results[1]] == ["compressed " * 5] * 5


def test_shard_writers_split_alike(tmp_path: Path) -> None:
    def run(mod: types.ModuleType) -> list[list[str]]:
        directory = tmp_path / mod.__name__
        directory.mkdir()
        with mod.writer.ShardWriter(str(directory / "s-%03d.tar"), maxcount=2, verbose=0) as sink:
            for sample in writer_samples():
                sink.write(sample)
        shards = sorted(str(p) for p in directory.iterdir())
        return [
            [s["__key__"] for s in mod.tariterators.tarfile_samples([{"url": url}])]
            for url in shards
        ]

    expected, actual = both(run, files=True)
    assert actual == expected == [["w000", "w001"], ["w002", "w003"], ["w004"]]


@pytest.mark.parametrize("field", ["cls", "txt", "json", "npy", "png", "jpg", "pgm", "tiff"])
def test_encoders_give_the_same_bytes(field: str) -> None:
    values: dict[str, Any] = {
        "cls": 7,
        "txt": "text",
        "json": {"a": [1, 2]},
        "npy": np.arange(5, dtype=np.int64),
        "png": np.random.default_rng(1).integers(0, 256, size=(3, 4, 3), dtype=np.uint8),
        "jpg": np.random.default_rng(2).random((3, 4, 3)),
        "pgm": np.random.default_rng(3).integers(0, 256, size=(3, 4), dtype=np.uint8),
        "tiff": np.random.default_rng(4).integers(0, 256, size=(3, 4, 3), dtype=np.uint8),
    }
    if field == "pgm":  # Pillow has no "PGM" writer name: webdataset's encoder fails, so does ours
        for mod in (webdataset.writer, cs.writer):
            with pytest.raises(KeyError):
                mod.encode_based_on_extension1(values[field], field, mod.default_handlers)
        return
    theirs = webdataset.writer.encode_based_on_extension1(
        values[field], field, webdataset.writer.default_handlers
    )
    ours = cs.writer.encode_based_on_extension1(values[field], field, cs.writer.default_handlers)
    assert ours == theirs
    sample = {"__key__": "k", field: values[field]}
    assert cs.writer.make_encoder(True)(sample) == webdataset.writer.make_encoder(True)(sample)


def test_writer_helpers_match() -> None:
    theirs, ours = webdataset.writer, cs.writer
    assert ours.numpy_dumps(np.eye(3)) == theirs.numpy_dumps(np.eye(3))
    arrays = {"a": np.arange(3)}
    assert canon(dict(np.load(io.BytesIO(ours.numpy_npz_dumps(arrays))))) == canon(
        dict(np.load(io.BytesIO(theirs.numpy_npz_dumps(arrays))))
    )
    tensor = torch.arange(3)
    assert torch.equal(torch.load(io.BytesIO(ours.torch_dumps(tensor))), tensor)
    for value in (b"x", "y", 3):
        assert ours.bytestr(value) == theirs.bytestr(value)
    table_ours: dict[str, Any] = {}
    table_theirs: dict[str, Any] = {}
    ours.add_handlers(table_ours, "a b", len)
    theirs.add_handlers(table_theirs, "a b", len)
    assert table_ours == table_theirs
    assert set(theirs.make_handlers()) <= set(ours.make_handlers())
    image = np.zeros((2, 2, 3), dtype=np.uint8)
    assert ours.imageencoder(image, "PNG") == theirs.imageencoder(image, "PNG")
    # Every spelling a caller may give, with the quality webdataset picks for each (100 for
    # "jpg" and "JPEG", Pillow's default for "jpeg"): the same bytes.
    photo = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    for spelling in ("jpg", "JPG", "jpeg", "JPEG", "Jpeg", "png", "img", "image", "tiff", "ppm"):
        assert ours.imageencoder(photo, spelling) == theirs.imageencoder(photo, spelling), spelling
    for mod in (theirs, ours):
        with pytest.raises(ImportError):
            mod.mp_dumps({"a": 1})
        with pytest.raises(ImportError):
            mod.cbor_dumps({"a": 1})
    assert ours.TarWriter is cloudshards.TarWriter
    assert ours.ShardWriter is cloudshards.ShardWriter


# --- cache -----------------------------------------------------------------------------------


def test_cache_helpers_match(make_shards: MakeShards, tmp_path: Path) -> None:
    theirs, ours = webdataset.cache, cs.cache
    for url in (
        "s3://bucket/dir/train-000.tar",
        "http://host/a/b.tar?x=1",
        "/local/x.tar",
        "weird+proto://a b/c",
        "pipe:curl -s http://h/x.tar",
    ):
        for ndir in (0, 1):
            assert ours.url_to_cache_name(url, ndir) == theirs.url_to_cache_name(url, ndir)
        assert ours.islocal(url) == theirs.islocal(url)
    tar = str(make_shards([1]).paths[0])
    gz = tmp_path / "x.gz"
    gz.write_bytes(gzip.compress(b"data"))
    other = tmp_path / "other"
    other.write_bytes(b"plain")
    for path in (tar, str(gz), str(other)):
        assert ours.magic_filetype(path) == theirs.magic_filetype(path)
        assert ours.check_tar_format(path) == theirs.check_tar_format(path)
    for value in ("default_cache_dir", "default_cache_size", "verbose_cache"):
        assert getattr(ours, value) == getattr(theirs, value)


def test_pipe_cleaner_is_obsolete_in_both(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = "pipe:curl -s -L https://host/shard-0.tar"
    with pytest.raises(cs.utils.ObsoleteException):
        cs.cache.pipe_cleaner(spec)
    with pytest.raises(webdataset.utils.ObsoleteException):
        webdataset.cache.pipe_cleaner(spec)
    monkeypatch.setenv("ALLOW_OBSOLETE", "1")
    for value in (spec, "s3://b/k.tar"):
        assert cs.cache.pipe_cleaner(value) == webdataset.cache.pipe_cleaner(value)


def test_cache_openers_match_on_local_files(make_shards: MakeShards, tmp_path: Path) -> None:
    urls = [str(p) for p in make_shards([2, 1]).paths]

    def run(mod: types.ModuleType, opener: Any) -> list[tuple[str, str | None, bytes]]:
        result = []
        for source in opener(urls):
            result.append((source["url"], source.get("local_path"), source["stream"].read()))
            source["stream"].close()
        return result

    for make in (
        lambda mod: mod.StreamingOpen(),
        lambda mod: mod.FileCache(str(tmp_path / f"cache-{mod.__name__}")),
    ):
        expected, actual = both(lambda mod, make=make: run(mod, make(mod)), "cache", files=True)
        assert actual == expected
    dest = tmp_path / "copy.tar"
    cs.cache.download(urls[0], str(dest))
    assert dest.read_bytes() == Path(urls[0]).read_bytes()


def test_file_cache_caches_remote_shards_once(make_shards: MakeShards, tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    local = make_shards([3]).paths[0]
    fs.pipe("/wds-cache/shard.tar", local.read_bytes())
    cache_dir = tmp_path / "node-cache"
    try:
        for _ in range(2):
            opener = cs.cache.FileCache(str(cache_dir), cache_size=10**9)
            (source,) = list(opener(["memory://wds-cache/shard.tar"]))
            assert source["stream"].read() == local.read_bytes()
            source["stream"].close()
        assert cloudshards.cache_info(cache_dir)["entries"] == 1
    finally:
        fs.rm("/wds-cache", recursive=True)


# --- tenbin ----------------------------------------------------------------------------------


def test_tenbin_writes_and_reads_what_webdataset_does(tmp_path: Path) -> None:
    for name in ("long_to_short", "short_to_long", "magic_str", "magic", "magic_bytes"):
        assert getattr(cs.tenbin, name) == getattr(webdataset.tenbin, name)
    # (No 0-d array: webdataset 1.0.2 fails to decode one; cloudshards reads and writes them.)
    arrays = [np.arange(12, dtype="float32").reshape(3, 4), np.array([7, -1], dtype="int16")]
    ours = cs.tenbin.encode_buffer(arrays, infos=["a", "bb"])
    assert bytes(ours) == bytes(webdataset.tenbin.encode_buffer(arrays, infos=["a", "bb"]))
    for got, want in zip(webdataset.tenbin.decode_buffer(ours), arrays, strict=True):
        np.testing.assert_array_equal(got, want)
    assert cs.tenbin.decode_buffer(ours, infos=True)[1] == ["a", "bb"]
    assert bytes(cs.writer.tenbin_dumps(arrays[0])) == bytes(
        webdataset.writer.tenbin_dumps(arrays[0])
    )
    path = str(tmp_path / "a.ten")
    cs.tenbin.save(path, *arrays)
    for got, want in zip(webdataset.tenbin.load(path), arrays, strict=True):
        np.testing.assert_array_equal(got, want)
    webdataset.tenbin.save(path, *arrays)
    for got, want in zip(cs.tenbin.load(path), arrays, strict=True):
        np.testing.assert_array_equal(got, want)


# --- errors old code catches -----------------------------------------------------------------


@pytest.fixture
def truncated_shard(make_shards: MakeShards, tmp_path: Path) -> str:
    """A shard cut in the middle of a member's data."""
    data = make_shards([6], payload_bytes=4000).paths[0].read_bytes()
    path = tmp_path / "truncated.tar"
    path.write_bytes(data[: len(data) // 2 + 100])
    return str(path)


READERS: dict[str, Callable[[types.ModuleType, str], Any]] = {
    "WebDataset": lambda mod, url: list(mod.WebDataset(url, shardshuffle=False)),
    "tarfile_samples": lambda mod, url: list(mod.tariterators.tarfile_samples([{"url": url}])),
    "url_opener+tar_file_expander": lambda mod, url: list(
        mod.tariterators.group_by_keys(
            mod.tariterators.tar_file_expander(mod.tariterators.url_opener([{"url": url}]))
        )
    ),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("caught", [tarfile.ReadError, OSError, ValueError])
def test_a_truncated_shard_is_caught_by_old_except_clauses(
    truncated_shard: str, reader: str, caught: type[Exception]
) -> None:
    read = READERS[reader]
    # webdataset lets tarfile raise ReadError here: code written for it catches that.
    with oracle_quirks(), pytest.raises(tarfile.ReadError):
        read(webdataset, truncated_shard)
    with pytest.raises(caught) as info:
        read(cs, truncated_shard)
    assert isinstance(info.value, ShardFormatError)
    assert "truncated" in str(info.value)
    assert truncated_shard in str(info.value)


def test_shard_format_error_keeps_its_fields_across_pickling() -> None:
    exc = ShardFormatError("truncated tar", url="s3://b/k.tar", offset=1024, member="x.jpg")
    clone = pickle.loads(pickle.dumps(exc))
    assert isinstance(clone, ShardFormatError)
    assert isinstance(clone, (tarfile.ReadError, OSError, ValueError))
    assert (clone.url, clone.offset, clone.member, str(clone)) == (
        exc.url,
        exc.offset,
        exc.member,
        str(exc),
    )
    assert exc.errno is None


# --- install_as_webdataset() -----------------------------------------------------------------


def run_python(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (stderr on failure)."""
    environ = {k: v for k, v in os.environ.items() if k != "CLOUDSHARDS_AS_WEBDATASET"}
    environ.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        env=environ,
        cwd=cwd,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_install_makes_webdataset_imports_resolve_to_cloudshards() -> None:
    out = run_python(
        """
        import os, sys
        import cloudshards
        assert "webdataset" not in sys.modules
        cloudshards.install_as_webdataset()
        cloudshards.install_as_webdataset()  # harmless
        import webdataset as wds
        import webdataset.filters
        import webdataset.gopen
        from webdataset.filters import _shuffle
        from webdataset.tariterators import base_plus_ext, url_opener, tar_file_expander
        import cloudshards.webdataset as cw
        assert wds is cw and webdataset.filters is cw.filters
        assert _shuffle is cw.filters._shuffle and url_opener is cw.tariterators.url_opener
        for name, module in list(sys.modules.items()):
            if name.startswith("webdataset."):
                assert module is sys.modules["cloudshards." + name], name
        assert callable(wds.gopen) and wds.gopen is cw.gopen  # the function, as in webdataset
        assert wds.shardlists.expand_urls("a{0..1}") == ["a0", "a1"]
        assert wds.utils.pytorch_worker_seed() == 0
        class Stage(wds.PipelineStage):
            def run(self, src):
                return (x * 2 for x in src)
        assert list(wds.DataPipeline([[1, 2]], Stage())) == [2, 4]
        finders = [f for f in sys.meta_path if type(f).__name__ == "WebDatasetFinder"]
        assert len(finders) == 1
        assert os.environ["CLOUDSHARDS_AS_WEBDATASET"] == "1"
        try:
            import webdataset.nonexistent
        except ModuleNotFoundError as exc:
            assert "cloudshards.webdataset" in str(exc), exc
        else:
            raise AssertionError("imported a module that does not exist")
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_the_environment_variable_installs_the_switch_at_import() -> None:
    out = run_python(
        """
        import cloudshards, webdataset
        print(webdataset.__name__)
        """,
        env={"CLOUDSHARDS_AS_WEBDATASET": "1"},
    )
    assert out.strip() == "cloudshards.webdataset"


def test_the_real_webdataset_imported_first_warns_or_raises() -> None:
    out = run_python(
        """
        import sys, warnings
        import webdataset
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import cloudshards  # the environment asks for the switch: too late, a warning
        print([str(w.message) for w in caught])
        try:
            cloudshards.install_as_webdataset()  # asked for explicitly: an error
        except cloudshards.ConfigError as exc:
            print(exc)
        assert sys.modules["webdataset"].__name__ == "webdataset"
        """,
        env={"CLOUDSHARDS_AS_WEBDATASET": "1"},
    )
    warned, raised = out.splitlines()
    assert "CLOUDSHARDS_AS_WEBDATASET=1 but webdataset is already imported" in warned
    assert "webdataset is already imported" in raised
    assert "before anything imports webdataset" in raised


SPAWN_PROGRAM = '''
"""Written against webdataset only."""
import webdataset as wds
from webdataset.filters import _shuffle
from webdataset.tariterators import base_plus_ext, tar_file_expander, url_opener


class Shuffle(wds.PipelineStage):
    def run(self, src):
        return _shuffle(src, 4, 2, seed=wds.utils.pytorch_worker_seed())


def group(files):
    current = None
    for item in files:
        prefix, suffix = base_plus_ext(item["fname"])
        if current is None or prefix != current["__key__"]:
            if current is not None:
                yield current
            current = {"__key__": prefix, "__url__": item["__url__"]}
        current[suffix] = item["data"]
    if current is not None:
        yield current


def samples(src):
    return group(tar_file_expander(url_opener(src)))


def pipeline(spec):
    return wds.DataPipeline(
        wds.SimpleShardList(spec), wds.split_by_worker, samples, Shuffle(), wds.to_tuple("cls")
    )
'''

SPAWN_MAIN = """
import sys
import cloudshards  # at the top; the switch itself is turned on inside main()


def main(spec):
    cloudshards.install_as_webdataset()
    import torch.utils.data
    import wdsprog  # imports webdataset

    for method in ("fork", "spawn"):
        loader = torch.utils.data.DataLoader(
            wdsprog.pipeline(spec), batch_size=None, num_workers=2, multiprocessing_context=method
        )
        print(method, sorted(int(c) for (c,) in loader))


if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.slow
def test_dataloader_workers_see_the_switch_with_fork_and_spawn(
    make_shards: MakeShards, tmp_path: Path
) -> None:
    shards = make_shards([3, 4, 2, 5])
    (tmp_path / "wdsprog.py").write_text(SPAWN_PROGRAM)
    (tmp_path / "main.py").write_text(SPAWN_MAIN)
    environ = {k: v for k, v in os.environ.items() if k != "CLOUDSHARDS_AS_WEBDATASET"}
    result = subprocess.run(
        [sys.executable, "main.py", shards.spec()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=environ,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    expected = sorted(int(fields["cls"]) for _, fields in shards.samples)
    assert result.stdout.splitlines() == [f"fork {expected}", f"spawn {expected}"]


class _Payload:
    """Unpickling this runs code: what a hostile ``.pyd`` or full ``torch.load`` would do."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo ran > /dev/null",))


@pytest.mark.parametrize("how", ["enforce_security", "WDS_SECURE"])
def test_wds_secure_refuses_pickle_and_pipes_even_after_the_opt_ins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """webdataset's security switch refuses unpickling and shell commands outright; the
    cloudshards opt-ins (CLOUDSHARDS_ALLOW_PICKLE, allow_pipe=True) used to win over it."""
    import pickle

    from cloudshards.decoders import allow_unsafe_decoders
    from cloudshards.unsafe import torch_loads, unpickle_loads

    if how == "WDS_SECURE":
        monkeypatch.setenv("WDS_SECURE", "1")
    else:
        monkeypatch.setattr(cs.utils, "enforce_security", True)
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PICKLE", "1")
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PIPE", "1")
    allow_unsafe_decoders()
    try:
        payload = pickle.dumps(_Payload())
        with pytest.raises(ValueError, match="WDS_SECURE"):
            unpickle_loads(payload)
        with pytest.raises(ValueError, match="WDS_SECURE"):
            cs.autodecode.decoders["pkl"](payload)
        buffer = io.BytesIO()
        torch.save({"x": _Payload()}, buffer)
        with pytest.raises(ValueError, match="WDS_SECURE"):  # weights_only: never run
            torch_loads(buffer.getvalue())
    finally:
        allow_unsafe_decoders(False)
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="WDS_SECURE"):
        OUR_GOPEN.gopen(f"pipe:touch {marker}", allow_pipe=True)
    with pytest.raises(ValueError, match="WDS_SECURE"):
        cloudshards.TarWriter(f"pipe:touch {marker}", allow_pipe=True)
    assert not marker.exists()


def test_wds_secure_refuses_a_pipe_dataset_naming_its_program_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command's arguments may hold a token; under WDS_SECURE the refusal printed them all,
    and called the command a local file."""
    monkeypatch.setenv("WDS_SECURE", "1")
    marker = tmp_path / "ran"
    url = f"pipe:touch {marker} POSITIONALSECRET"
    for allow_pipe in (None, True):
        with pytest.raises(ValueError, match="refused under WDS_SECURE") as refused:
            next(iter(cloudshards.WebDataset(url, shardshuffle=False, allow_pipe=allow_pipe)))
        assert "'pipe:touch ...'" in str(refused.value)
        assert "POSITIONALSECRET" not in str(refused.value)
        assert "local file" not in str(refused.value)
    assert not marker.exists()
