"""Logging helpers of the package: a warning given once per owner (a process's state, a cache
directory's counters), however often its cause recurs."""

from __future__ import annotations

import logging

__all__ = ["warn_once"]


def warn_once(
    log: logging.Logger, warned: set[str], message: str, *args: object, key: str | None = None
) -> None:
    """Log ``message % args`` as a WARNING on ``log`` unless ``key`` is in ``warned``.

    Args:
        log: The logger of the module that warns (its name is what users filter on).
        warned: The owner's set of warnings given; ``key`` is added to it.
        message: The message, with lazy %-args.
        args: The message's arguments.
        key: What makes two warnings the same (default: ``message``).
    """
    key = message if key is None else key
    if key not in warned:
        warned.add(key)
        log.warning(message, *args)
