"""The public API: ``__all__`` is sorted and importable, and webdataset 1.0.2's names exist.

The name lists are explicit: webdataset 1.0.2 exports them and DESIGN.md section 6 says they
must exist in cloudshards, so ``import cloudshards as wds`` finds them.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import io
import subprocess
import sys
from typing import Any

import pytest
import webdataset

import cloudshards

#: webdataset 1.0.2 exports these and DESIGN.md section 6 lists them as "must exist".
MUST_EXIST = [
    "WebDataset",
    "WebLoader",
    "DataPipeline",
    "SimpleShardList",
    "ResampledShards",
    "split_by_node",
    "split_by_worker",
    "single_node_only",
    "non_empty",
    "resampled",
    "tarfile_samples",
    "tarfile_to_samples",
    # filters
    "batched",
    "unbatched",
    "decode",
    "shuffle",
    "detshuffle",
    "map_dict",
    "map_tuple",
    "rename",
    "rename_keys",
    "to_tuple",
    "extract_keys",
    "getfirst",
    "rsample",
    "pipelinefilter",
    "repeatedly",
    # handlers
    "reraise_exception",
    "warn_and_continue",
    "ignore_and_continue",
    "warn_and_stop",
    "ignore_and_stop",
    # decoding
    "Decoder",
    "handle_extension",
    "imagehandler",
    "torch_video",
    "torch_audio",
    "Continue",
    "DecodingError",
    "RandomMix",
    "RoundRobin",
    "MultiShardSample",
    "gopen",
    "with_epoch",
    "with_length",
    "TarWriter",
    "ShardWriter",
]

#: webdataset 1.0.2 exports these too; DESIGN.md does not require them, cloudshards has them.
ALSO_PROVIDED = [
    "FluidInterface",
    "FluidWrapper",
    "PipelineStage",
    "associate",
    "gzfilter",
    "torch_loads",
    "transform_with",
    "xdecode",
]

#: webdataset 1.0.2 exports these too, but on ``from cloudshards import *`` they would shadow
#: builtins (``map``, ``slice``), the ``select`` module, or a common name (``info``): they are
#: attributes (``wds.map(f)`` in a ``DataPipeline``) kept out of ``__all__``.
NOT_IN_ALL = ["info", "map", "select", "slice"]


def test_all_is_sorted_and_unique() -> None:
    assert cloudshards.__all__ == sorted(cloudshards.__all__)
    assert len(set(cloudshards.__all__)) == len(cloudshards.__all__)


def test_every_name_in_all_imports() -> None:
    namespace: dict[str, Any] = {}
    exec("from cloudshards import *", namespace)
    missing = [name for name in cloudshards.__all__ if name not in namespace]
    assert missing == []
    assert all(namespace[name] is getattr(cloudshards, name) for name in cloudshards.__all__)


def test_name_lists_are_webdataset_exports() -> None:
    # Keeps the lists above honest: every name is something webdataset code can use.
    names = MUST_EXIST + ALSO_PROVIDED
    assert [name for name in names if not hasattr(webdataset, name)] == []
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", MUST_EXIST + ALSO_PROVIDED)
def test_webdataset_name_exists(name: str) -> None:
    assert hasattr(cloudshards, name)
    assert name in cloudshards.__all__
    assert callable(getattr(cloudshards, name))


# --- signatures: webdataset code passes arguments by position and by name -------------------


def compatible(theirs: Any, ours: Any, *, skip_stream: bool = False) -> list[str]:
    """Problems calling ``ours`` the way code calls ``theirs`` (empty when compatible).

    webdataset's positional parameters must come first in ours, in the same order; its
    keyword-only ones and ``*args``/``**kw`` must be accepted; any extra parameter of ours
    must be optional. ``skip_stream`` drops a leading data/src/source parameter (the stream a
    curried filter receives later) on both sides.
    """
    their_params = list(inspect.signature(theirs).parameters.values())
    our_params = list(inspect.signature(ours).parameters.values())
    if skip_stream:
        their_params = [p for p in their_params[:1] if p.name not in STREAM] + their_params[1:]
        our_params = [p for p in our_params[:1] if p.name not in STREAM] + our_params[1:]
    problems = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ours_by_name = {p.name: p for p in our_params}
    for i, param in enumerate(their_params):
        if param.kind in positional:
            if i >= len(our_params) or our_params[i].name != param.name:
                problems.append(f"positional parameter {i} should be {param.name!r}")
        elif param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if not any(p.kind == param.kind for p in our_params):
                problems.append(f"no {param.kind.description} parameter")
        elif param.name not in ours_by_name:
            problems.append(f"keyword {param.name!r} missing")
    their_names = {p.name for p in their_params}
    for param in our_params:
        required = param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if param.name not in their_names and required:
            problems.append(f"extra required parameter {param.name!r}")
    return problems


STREAM = {"data", "src", "source"}

CLASSES = [
    "WebDataset",
    "WebLoader",
    "DataPipeline",
    "FluidWrapper",
    "SimpleShardList",
    "ResampledShards",
    "Decoder",
    "detshuffle",
    "TarWriter",
    "ShardWriter",
]

FUNCTIONS = [
    "batched",
    "unbatched",
    "decode",
    "shuffle",
    "map",
    "map_dict",
    "map_tuple",
    "rename",
    "rename_keys",
    "select",
    "to_tuple",
    "extract_keys",
    "rsample",
    "xdecode",
    "non_empty",
    "resampled",
    "tarfile_to_samples",
    "split_by_node",
    "split_by_worker",
    "single_node_only",
    "getfirst",
    "repeatedly",
    "associate",
    "transform_with",
    "handle_extension",
    "imagehandler",
    "torch_video",
    "torch_audio",
]


@pytest.mark.parametrize("name", CLASSES + FUNCTIONS)
def test_signature_accepts_webdataset_calls(name: str) -> None:
    assert compatible(getattr(webdataset, name), getattr(cloudshards, name), skip_stream=True) == []


# mcached/lmdb_cached wrap Cached/LMDBCached, which DESIGN.md section 6 leaves out.
FLUENT_METHODS = [
    *sorted(
        name
        for name in vars(webdataset.FluidInterface)
        if not name.startswith("_") and name not in ("mcached", "lmdb_cached")
    ),
    *["with_epoch", "with_length", "repeat", "compose", "stage", "append", "close"],
]


@pytest.mark.parametrize("name", FLUENT_METHODS)
def test_fluent_method_accepts_webdataset_calls(name: str) -> None:
    theirs = getattr(webdataset.WebDataset, name)
    ours = getattr(cloudshards.WebDataset, name)
    assert compatible(theirs, ours) == []


def test_webdataset_arguments_are_accepted_by_name() -> None:
    # The DESIGN.md section 6 list, by name.
    arguments = [
        *("urls", "handler", "resampled", "repeat", "shardshuffle", "cache_size", "cache_dir"),
        *("url_to_name", "detshuffle", "nodesplitter", "workersplitter", "select_files"),
        *("rename_files", "empty_check", "verbose", "seed"),
    ]
    parameters = inspect.signature(cloudshards.WebDataset).parameters
    assert [name for name in arguments if name not in parameters] == []


# --- the lazy facade ---------------------------------------------------------------------------


def test_all_shadows_no_builtin() -> None:
    namespace: dict[str, Any] = {}
    exec("from cloudshards import *", namespace)
    shadowing = [
        name
        for name in cloudshards.__all__
        if hasattr(builtins, name) or name in sys.stdlib_module_names
    ]
    assert shadowing == []
    assert [name for name in NOT_IN_ALL if name in namespace] == []


@pytest.mark.parametrize("name", NOT_IN_ALL)
def test_names_kept_out_of_all_are_attributes(name: str) -> None:
    assert hasattr(webdataset, name)
    assert name not in cloudshards.__all__
    assert callable(getattr(cloudshards, name))
    assert name in dir(cloudshards)


def test_names_kept_out_of_all_work_in_a_pipeline() -> None:
    import cloudshards as wds

    log = io.StringIO()
    pipeline = wds.DataPipeline(
        lambda: iter([{"__key__": str(i), "x": i} for i in range(10)]),
        wds.map(lambda sample: {**sample, "x": sample["x"] * 2}),
        wds.select(lambda sample: sample["x"] % 4 == 0),
        wds.slice(3),
        wds.info(n=1, stream=log),
    )
    assert [sample["x"] for sample in pipeline] == [0, 4, 8]
    assert log.getvalue().startswith("--- \n__key__ '0'\n")


def test_every_webdataset_top_level_name_resolves() -> None:
    public = [name for name in dir(webdataset) if not name.startswith("_")]
    assert [name for name in public if not hasattr(cloudshards, name)] == []


def test_every_exported_name_resolves_to_its_module() -> None:
    for name, module in cloudshards._MODULE_OF.items():
        assert getattr(cloudshards, name) is getattr(importlib.import_module(module), name)
    assert set(cloudshards.__all__) - {"__version__"} <= set(cloudshards._MODULE_OF)


def test_type_checking_block_matches_the_table() -> None:
    # The names type checkers see (an `if TYPE_CHECKING:` import block) come from the modules
    # that __getattr__ loads them from, and they are exactly the names of __all__.
    tree = ast.parse(inspect.getsource(cloudshards))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    seen = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert {name: cloudshards._MODULE_OF.get(name) for name in seen} == seen
    assert set(seen) == set(cloudshards.__all__) - {"__version__"}


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_does_not_import_torch(make_shards: Any) -> None:
    shards = make_shards([2, 3])
    out = run_python(
        "import sys\n"
        "import cloudshards\n"
        "assert 'torch' not in sys.modules, 'import cloudshards imported torch'\n"
        f"dataset = cloudshards.WebDataset({shards.spec()!r}, shardshuffle=False)\n"
        "print(sum(1 for _ in dataset), 'torch' in sys.modules)\n"
    )
    assert out.split() == ["5", "True"]


def test_submodules_resolve_as_attributes_and_unknown_names_raise() -> None:
    code = (
        "import cloudshards, sys\n"
        "assert cloudshards.balance is sys.modules['cloudshards.balance']\n"
        "assert not hasattr(cloudshards, 'no_such_name')\n"
        "assert 'WebDataset' in dir(cloudshards) and 'map' in dir(cloudshards)\n"
        "print('ok')\n"
    )
    assert run_python(code).split() == ["ok"]
