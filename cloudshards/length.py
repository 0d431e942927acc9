"""``len()`` of a pipeline: there once a length was set, absent (to ``hasattr``) before, as
in webdataset, whose pipelines get a ``__len__`` only from ``with_length``."""

from __future__ import annotations

from typing import Any

__all__ = ["Length", "NoLengthError"]


class NoLengthError(AttributeError, TypeError):
    """``len()`` of a pipeline without ``with_length(n)``: a TypeError, as
    ``len()`` of any object without one, and an AttributeError, so that
    ``hasattr(pipeline, "__len__")`` is False, as it is in webdataset (programs ask it before
    calling ``len()``: LAVIS's runner, for one)."""


class Length:
    """``DataPipeline.__len__``: there only once a length was set (see :class:`NoLengthError`)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        length = obj._length
        if length is None:
            raise NoLengthError(
                f"{type(obj).__name__} has no length (it streams); use .with_length(n) if a "
                "framework needs one"
            )
        return lambda: length
