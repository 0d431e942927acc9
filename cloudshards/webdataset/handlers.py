"""webdataset 1.0.2's ``webdataset.handlers``: the exception-handler policies.

Same semantics, except that the warning handlers do not sleep half a second.
"""

from __future__ import annotations

from cloudshards.handlers import (
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)

__all__ = [
    "ignore_and_continue",
    "ignore_and_stop",
    "reraise_exception",
    "warn_and_continue",
    "warn_and_stop",
]
