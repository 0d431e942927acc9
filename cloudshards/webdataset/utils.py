"""webdataset 1.0.2's ``webdataset.utils``: small helpers, worker info and seeds.

``pytorch_worker_info`` reads torch.distributed before ``RANK``/``WORLD_SIZE`` (webdataset
reads the variables first); both agree whenever the two are consistent.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import importlib
import itertools
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import braceexpand
import numpy as np

from cloudshards import config
from cloudshards.dist import pytorch_worker_info, pytorch_worker_seed
from cloudshards.stages.base import PipelineStage
from cloudshards.stages.epoch import guess_batchsize, repeatedly
from cloudshards.stages.transform import identity

__all__ = [
    "ObsoleteException",
    "PipelineStage",
    "compute_sample_weights",
    "deprecated",
    "enforce_security",
    "fnmatch_with_braces",
    "glob_with_braces",
    "guess_batchsize",
    "identity",
    "is_iterable",
    "lookup_sym",
    "make_seed",
    "obsolete",
    "pytorch_worker_info",
    "pytorch_worker_seed",
    "repeatedly",
    "repeatedly0",
    "safe_eval",
]

#: webdataset's ``WDS_SECURE`` switch. cloudshards is secure without it: no unpickling and no
#: ``pipe:`` URLs unless asked for; the value is kept for code that reads it.
enforce_security = bool(int(config.webdataset_var("WDS_SECURE", "0")))


def glob_with_braces(pattern: str) -> list[str]:
    """Expand braces, then glob each expansion on the local filesystem."""
    return [f for pat in braceexpand.braceexpand(pattern) for f in glob.glob(pat)]


def fnmatch_with_braces(filename: str, pattern: str) -> bool:
    """True when ``filename`` matches any brace expansion of ``pattern``."""
    return any(fnmatch.fnmatch(filename, pat) for pat in braceexpand.braceexpand(pattern))


def make_seed(*args: Any) -> int:
    """webdataset's 31-bit seed from ``hash`` of the arguments (salted per process for str)."""
    seed = 0
    for arg in args:
        seed = (seed * 31 + hash(arg)) & 0x7FFFFFFF
    return seed


def is_iterable(obj: Any) -> bool:
    """True for iterables other than ``str`` and ``bytes``."""
    if isinstance(obj, (str, bytes)):
        return False
    return isinstance(obj, (list, Iterable, Iterator))


def safe_eval(s: str, expr: str = "{}") -> Any:
    """Evaluate ``expr.format(s)`` when ``s`` is a single identifier or number.

    Raises:
        ValueError: ``s`` contains anything but letters, digits and underscores.
    """
    if re.sub("[^A-Za-z0-9_]", "", s) != s:
        raise ValueError(f"safe_eval: illegal characters in: '{s}'")
    return eval(expr.format(s))  # noqa: S307 - s is a bare identifier or number, as in webdataset


def lookup_sym(sym: str, modules: list[str]) -> Any:
    """Return attribute ``sym`` of the first module (relative names: this package) having it."""
    for name in modules:
        module = importlib.import_module(name, package="cloudshards.webdataset")
        result = getattr(module, sym, None)
        if result is not None:
            return result
    return None


def deprecated(arg: Any = None) -> Any:
    """Decorator (with or without a reason string) that warns with ``DeprecationWarning``."""
    reason = None if callable(arg) else arg

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def new_func(*args: Any, **kwargs: Any) -> Any:
            msg = f"Call to deprecated function {func.__name__}."
            if reason is not None:
                msg += " Reason: " + reason
            warnings.warn(msg, category=DeprecationWarning, stacklevel=2)
            return func(*args, **kwargs)

        return new_func

    return decorator(arg) if callable(arg) else decorator


class ObsoleteException(Exception):
    """Raised by functions marked :func:`obsolete` unless ``ALLOW_OBSOLETE=1``."""


def obsolete(func: Callable[..., Any] | None = None, *, reason: str | None = None) -> Any:
    """Decorator: calling the function raises :class:`ObsoleteException` unless the
    environment has ``ALLOW_OBSOLETE=1`` (webdataset's switch)."""
    if func is None:
        return functools.partial(obsolete, reason=reason)

    @functools.wraps(func)
    def new_func(*args: Any, **kwargs: Any) -> Any:
        if not int(config.webdataset_var("ALLOW_OBSOLETE", "0")):
            msg = f"Call to obsolete function {func.__name__}. Set env ALLOW_OBSOLETE=1 to permit."
            if reason is not None:
                msg += " Reason: " + reason
            raise ObsoleteException(msg)
        return func(*args, **kwargs)

    return new_func


def compute_sample_weights(n_w_pairs: Iterable[tuple[float, float]]) -> Any:
    """Normalised ``n * w`` for ``(n, w)`` pairs, the largest being 1."""
    pairs = list(n_w_pairs)
    weighted = np.array([p[0] for p in pairs]) * np.array([p[1] for p in pairs])
    return weighted / np.amax(weighted)


def repeatedly0(
    loader: Iterable[Any], nepochs: int = sys.maxsize, nbatches: int = sys.maxsize
) -> Iterator[Any]:
    """Iterate ``loader`` ``nepochs`` times, at most ``nbatches`` items each."""
    for _ in range(nepochs):
        yield from itertools.islice(loader, nbatches)
