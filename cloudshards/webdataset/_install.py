"""The one-line switch: make ``import webdataset`` resolve to :mod:`cloudshards.webdataset`.

A meta path finder maps ``webdataset`` and ``webdataset.<name>`` to the same module objects as
``cloudshards.webdataset[.<name>]`` (never a second copy, so classes compare equal), and the
modules that exist are aliased in ``sys.modules`` at once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

from cloudshards import config
from cloudshards.errors import ConfigError

__all__ = ["ENV_VAR", "install_as_webdataset", "install_from_env"]

logger = logging.getLogger(__name__)

#: Set by :func:`install_as_webdataset`; processes that inherit it install the switch as soon
#: as they import cloudshards (spawned DataLoader workers unpickling a pipeline do).
ENV_VAR = "CLOUDSHARDS_AS_WEBDATASET"

_ALIAS = "webdataset"
_TARGET = "cloudshards.webdataset"


def _target_of(fullname: str) -> str | None:
    if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
        return _TARGET + fullname[len(_ALIAS) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads ``webdataset.X`` by importing ``cloudshards.webdataset.X`` and aliasing it."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # The import system returns whatever sys.modules holds under the name afterwards.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class WebDatasetFinder(importlib.abc.MetaPathFinder):
    """Finds ``webdataset`` and ``webdataset.*`` in :mod:`cloudshards.webdataset`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        target_name = _target_of(fullname)
        if target_name is None:
            return None
        spec = importlib.util.find_spec(target_name)
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: install_as_webdataset() maps webdataset to "
                f"cloudshards.webdataset, which has no such module (docs/migrating.md lists "
                "what is provided)",
                name=fullname,
            )
        is_package = spec.submodule_search_locations is not None
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(target_name), is_package=is_package
        )


def _installed() -> bool:
    return any(isinstance(finder, WebDatasetFinder) for finder in sys.meta_path)


def _real_webdataset() -> ModuleType | None:
    """A module of the real webdataset package already imported, if any."""
    for name, module in list(sys.modules.items()):
        if module is None or _target_of(name) is None:
            continue
        if not getattr(module, "__name__", "").startswith(_TARGET):
            return module
    return None


def _install() -> None:
    if not _installed():
        sys.meta_path.insert(0, WebDatasetFinder())
    package = importlib.import_module(_TARGET)
    sys.modules.setdefault(_ALIAS, package)
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(_TARGET + "."):
            suffix = name[len(_TARGET) :]
            if not suffix.startswith("._"):
                # Aliased now, so that importing them later never sets attributes on the
                # package (``webdataset.gopen`` must stay the function, as in webdataset).
                sys.modules.setdefault(_ALIAS + suffix, module)


def install_as_webdataset(*, propagate: bool = True) -> None:
    """Make ``import webdataset`` and ``import webdataset.X`` give cloudshards' modules.

    Call it once, at the top of the entry script, before anything imports webdataset: code
    written for webdataset 1.0.2 (``from webdataset.filters import _shuffle``,
    ``wds.tariterators.url_opener``, ``wds.WebDataset(...)``) then runs on cloudshards, with
    fsspec URLs (``s3://``, ``gs://``...), prefetch, retries and the node cache. Calling it
    again does nothing.

    DataLoader workers: forked workers inherit the switch. Spawned (and forkserver) workers
    re-run the entry script's top level, which calls it again; with ``propagate`` the
    environment also carries ``CLOUDSHARDS_AS_WEBDATASET=1`` to child processes, which
    install the switch whenever they import cloudshards (unpickling a pipeline does), so the
    call may also sit inside ``main()`` as long as the modules that import webdataset are
    imported after it.

    Args:
        propagate: Set ``CLOUDSHARDS_AS_WEBDATASET=1`` for child processes.

    Raises:
        ConfigError: The real webdataset was imported already; modules holding it would keep
            using it, so the switch refuses to mix the two.
    """
    real = _real_webdataset()
    if real is not None:
        where = getattr(real, "__file__", None) or real.__name__
        raise ConfigError(
            f"webdataset is already imported ({where}); call "
            "cloudshards.install_as_webdataset() before anything imports webdataset, e.g. as "
            "the first lines of the entry script"
        )
    _install()
    if propagate:
        os.environ[ENV_VAR] = "1"
    logger.debug("import webdataset now resolves to cloudshards.webdataset")


def install_from_env() -> None:
    """Install the switch when ``CLOUDSHARDS_AS_WEBDATASET`` is true (at cloudshards import).

    Warns instead of raising when the real webdataset is already imported.
    """
    if not config.env_bool("AS_WEBDATASET"):
        return
    real = _real_webdataset()
    if real is not None:
        warnings.warn(
            f"{ENV_VAR}=1 but webdataset is already imported "
            f"({getattr(real, '__file__', real.__name__)}); import webdataset keeps giving "
            "the real package in this process",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    _install()
