"""Error-handler policies, with webdataset's handler names and semantics.

A handler receives an exception and either raises it, returns True (skip the item and
continue) or returns False (stop the stream). ``on_error="raise"|"warn"|"skip"`` strings map to
the three common policies. Unlike webdataset 1.0.2, the warning handlers do not sleep.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

from cloudshards.errors import ConfigError
from cloudshards.types import ExceptionHandler

__all__ = [
    "OnError",
    "as_handler",
    "ignore_and_continue",
    "ignore_and_stop",
    "reraise_exception",
    "warn_and_continue",
    "warn_and_stop",
]

logger = logging.getLogger(__name__)

OnError = Literal["raise", "warn", "skip"]


def reraise_exception(exn: BaseException) -> bool:
    """Re-raise the exception (the default policy)."""
    raise exn


def ignore_and_continue(exn: BaseException) -> bool:
    """Skip the failing item silently and continue."""
    return True


def warn_and_continue(exn: BaseException) -> bool:
    """Warn (``warnings`` and the log), skip the failing item, continue."""
    logger.warning("skipping after error: %s", exn)
    warnings.warn(repr(exn), stacklevel=2)
    return True


def ignore_and_stop(exn: BaseException) -> bool:
    """Stop the stream silently."""
    return False


def warn_and_stop(exn: BaseException) -> bool:
    """Warn, then stop the stream."""
    logger.warning("stopping after error: %s", exn)
    warnings.warn(repr(exn), stacklevel=2)
    return False


def _log_and_continue(exn: BaseException) -> bool:
    logger.warning("skipping after error: %s", exn)
    return True


_POLICIES: dict[str, ExceptionHandler] = {
    "raise": reraise_exception,
    "warn": _log_and_continue,
    "skip": ignore_and_continue,
}


def as_handler(handler: ExceptionHandler | str | None) -> ExceptionHandler:
    """Turn ``"raise"``/``"warn"``/``"skip"``, a handler function, or None into a handler."""
    if handler is None:
        return reraise_exception
    if isinstance(handler, str):
        try:
            return _POLICIES[handler]
        except KeyError:
            raise ConfigError(
                f"unknown error policy {handler!r}; use 'raise', 'warn' or 'skip' or a function"
            ) from None
    if not callable(handler):
        raise ConfigError(f"handler must be callable or a policy name, got {handler!r}")
    return handler
