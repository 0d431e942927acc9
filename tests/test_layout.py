"""The package's layers: nothing in the core imports the webdataset layer.

``cloudshards/webdataset/`` is the only home of webdataset's module layout and of the names
and behaviours only webdataset code uses; the root ``__init__.py`` (the facade) forwards them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cloudshards

PACKAGE = Path(cloudshards.__file__).parent
LAYER = "cloudshards.webdataset"


def core_modules() -> list[Path]:
    """Every module outside cloudshards/webdataset/, except the facade (the root __init__)."""
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if (PACKAGE / "webdataset") not in path.parents and path != PACKAGE / "__init__.py"
    ]


def layer_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of the webdataset layer, at any depth in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        hits = [module for module in modules if module == LAYER or module.startswith(LAYER + ".")]
        if hits:
            found.append((node.lineno, hits[0]))
    return found


def test_the_core_does_not_import_the_webdataset_layer() -> None:
    modules = core_modules()
    assert len(modules) > 20
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: imports {module}"
        for path in modules
        for line, module in layer_imports(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_the_scan_finds_every_form_of_import() -> None:
    source = (
        "import cloudshards.webdataset.filters\n"
        "from cloudshards import webdataset\n"
        "def f():\n"
        "    from cloudshards.webdataset.shardlists import MultiShardSample\n"
        "from cloudshards.webdatasets import x\n"
        "from cloudshards import dataset\n"
    )
    assert layer_imports(source) == [
        (1, LAYER + ".filters"),
        (2, LAYER),
        (4, LAYER + ".shardlists"),
    ]


def test_core_module_names_shared_with_the_layer_are_the_known_few() -> None:
    # webdataset/ mirrors webdataset 1.0.2's module layout (``import webdataset.X`` after
    # install_as_webdataset); where the core has a module of the same concept, the layer's
    # module adapts it. compat.py and wrappers.py were core modules of webdataset's names only.
    def names(directory: Path) -> set[str]:
        return {
            path.stem
            for path in directory.iterdir()
            if not path.name.startswith("_") and (path.suffix == ".py" or path.is_dir())
        }

    shared = names(PACKAGE) & names(PACKAGE / "webdataset")
    assert shared <= {"cache", "handlers", "mix", "pipeline"}
