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


#: Most lines a module of the package may have (STYLE.md section 1: split before you cross it).
MAX_MODULE_LINES = 400


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path``, a file of the package directory ``root``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_private(module: str) -> bool:
    """A module whose own name starts with ``_`` (``__init__`` and dunder names aside)."""
    name = module.rpartition(".")[2]
    return name.startswith("_") and not name.startswith("__")


def imported_modules(source: str, package: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of each module of ``modules`` that ``source``, a module of ``package``,
    imports at any depth: ``import a.b``, ``from a import b`` (b a module or a name in a),
    relative imports, and the packages on the way (``import a.b`` imports ``a`` too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        seen: set[str] = set()
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                prefix = ".".join(parts[:end])
                if prefix in modules and prefix not in seen:
                    seen.add(prefix)
                    found.append((node.lineno, prefix))
    return found


def private_imports(root: Path) -> list[str]:
    """Each import of a private module from outside the package (directory) that holds it."""
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(path, root) for path in paths}
    found = []
    for path in paths:
        importer = module_name(path, root)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for line, module in imported_modules(path.read_text(encoding="utf-8"), package, modules):
            home = module.rpartition(".")[0]
            if is_private(module) and package != home and not package.startswith(home + "."):
                found.append(f"{path.relative_to(root.parent)}:{line}: imports {module}")
    return found


def test_private_modules_are_imported_only_from_their_own_package() -> None:
    assert private_imports(PACKAGE) == []


def test_the_package_root_holds_no_private_modules() -> None:
    # Every module of the package is in the root's package, so a private module at the root
    # would be private to nothing: what one concern keeps to itself lives in that concern's
    # package (tar/, indexed/, cache/...).
    private = [path.name for path in PACKAGE.glob("*.py") if is_private(path.stem)]
    assert private == []


def test_the_private_import_scan(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "from pkg import _root\n",
        "_root.py": "",
        "top.py": (
            "import pkg.tar._blocks\n"
            "from pkg.tar import _blocks, members\n"
            "from pkg.tar._blocks import BlockReader\n"
            "def f():\n"
            "    from pkg.indexed import _read\n"
            "from pkg.tar.members import _private_name\n"
        ),
        "tar/__init__.py": "from ._blocks import BlockReader\nfrom . import members\n",
        "tar/_blocks.py": "from ..indexed._read import x\n",
        "tar/members.py": "from pkg.tar._blocks import BlockReader\nfrom pkg import _root\n",
        "tar/sub/__init__.py": "from pkg.tar import _blocks\n",
        "indexed/__init__.py": "",
        "indexed/_read.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    assert private_imports(root) == [
        "pkg/tar/_blocks.py:1: imports pkg.indexed._read",
        "pkg/top.py:1: imports pkg.tar._blocks",
        "pkg/top.py:2: imports pkg.tar._blocks",
        "pkg/top.py:3: imports pkg.tar._blocks",
        "pkg/top.py:5: imports pkg.indexed._read",
    ]


def test_every_module_is_at_most_400_lines() -> None:
    lines = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert len(lines) > 20
    assert {path: n for path, n in lines.items() if n > MAX_MODULE_LINES} == {}


#: The fsspec filesystem methods that read (or stream) an object's bytes.
_BYTE_READS = frozenset(
    {
        "open",
        "cat",
        "cat_file",
        "_cat_file",
        "cat_ranges",
        "_cat_ranges",
        "read_block",
        "open_async",
    }
)


def filesystem_reads(source: str) -> list[int]:
    """Lines that call a byte-reading method on something named ``fs`` (``fs.x(...)``,
    ``self.fs.x(...)``), or hand such a bound method on (``sync(loop, fs._cat_file, ...)``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr in _BYTE_READS):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        if name in ("fs", "filesystem"):
            lines.append(node.lineno)
    return sorted(lines)


def test_exactly_one_module_reads_bytes_through_fsspec() -> None:
    readers = {
        str(path.relative_to(PACKAGE.parent))
        for path in sorted(PACKAGE.rglob("*.py"))
        if filesystem_reads(path.read_text(encoding="utf-8"))
    }
    assert readers == {"cloudshards/source/remote.py"}


def test_the_fsspec_read_scan_finds_every_form() -> None:
    source = (
        "def a(fs, self):\n"
        "    fs.open(p)\n"
        "    self.fs.cat_file(p)\n"
        "    sync(fs.loop, fs._cat_file, p)\n"
        "    fs.info(p)\n"
        "    other.open(p)\n"
    )
    assert filesystem_reads(source) == [2, 3, 4]


def test_test_folders_mirror_the_packages() -> None:
    """tests/ mirrors the package: each folder of tests is named after the package it tests, so
    a reader finds the cache's tests in tests/cache/ (module-level code's tests stay at the top)."""
    tests = Path(__file__).resolve().parent
    folders = {
        path.name for path in tests.iterdir() if path.is_dir() and any(path.glob("test_*.py"))
    }
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders, "no test folders found"
    assert folders <= packages, f"test folders without a package: {sorted(folders - packages)}"
    assert {"cache", "tar", "source", "indexed"} <= folders
