"""Stand-ins for the webdataset names cloudshards leaves out: using one raises a clear error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from cloudshards.errors import UnsupportedError

__all__ = ["unsupported_class", "unsupported_function"]


def _message(name: str, instead: str) -> str:
    return f"webdataset's {name} is not supported by cloudshards; {instead} (docs/migrating.md)"


def unsupported_function(name: str, instead: str) -> Callable[..., NoReturn]:
    """A function named ``name`` that raises :class:`UnsupportedError` saying ``instead``."""

    def stub(*args: Any, **kw: Any) -> NoReturn:
        raise UnsupportedError(_message(name, instead))

    stub.__name__ = stub.__qualname__ = name
    stub.__doc__ = f"Not supported by cloudshards: {instead}."
    return stub


def unsupported_class(name: str, instead: str) -> type[Any]:
    """A class named ``name`` whose construction raises :class:`UnsupportedError`."""

    def __init__(self: Any, *args: Any, **kw: Any) -> NoReturn:
        raise UnsupportedError(_message(name, instead))

    return type(name, (), {"__init__": __init__, "__doc__": f"Not supported: {instead}."})
