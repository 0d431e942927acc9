"""Defaults and the only reader of ``CLOUDSHARDS_*`` environment variables, and of the ones
webdataset reads (``WDS_*``, ``GOPEN_*``, ``ALLOW_OBSOLETE``).

Explicit arguments always win over the environment; the environment wins over the defaults.
A variable is read only when no argument gives its value, so a bad value in the environment
cannot fail a call that does not need it.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import overload

from cloudshards.errors import ConfigError

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_MAX_DECODED_BYTES",
    "DEFAULT_MAX_MEMBER_BYTES",
    "cache_defaults",
    "cache_dir_default",
    "cache_size_default",
    "env_bool",
    "env_int",
    "env_seed",
    "env_str",
    "max_decoded_bytes",
    "webdataset_var",
]

#: Read size for streaming shards; large blocks amortise Python overhead per read.
DEFAULT_BLOCK_BYTES = 4 << 20

#: Largest single tar member accepted; guards memory against hostile or corrupt headers.
DEFAULT_MAX_MEMBER_BYTES = 1 << 30

#: Largest size a decoder inflates one field to (gzip, .npz, .npy): a decompression-bomb guard.
DEFAULT_MAX_DECODED_BYTES = DEFAULT_MAX_MEMBER_BYTES


def env_str(name: str) -> str | None:
    """Return ``CLOUDSHARDS_<name>`` or None when unset or empty."""
    value = os.environ.get("CLOUDSHARDS_" + name)
    return value if value else None


def env_int(name: str, default: int) -> int:
    """Return ``CLOUDSHARDS_<name>`` as an int, else ``default``."""
    value = env_str(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"CLOUDSHARDS_{name}={value!r} is not an integer") from None


def env_bool(name: str, default: bool = False) -> bool:
    """Return ``CLOUDSHARDS_<name>`` as a boolean (1/true/yes/on), else ``default``."""
    value = env_str(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"CLOUDSHARDS_{name}={value!r} is not a boolean (use 1 or 0)")


def max_decoded_bytes() -> int:
    """The decode limit when neither the decoder nor the pipeline sets one.

    ``CLOUDSHARDS_MAX_DECODED_BYTES``, else ``CLOUDSHARDS_MAX_MEMBER_BYTES`` (a decoded field
    is bounded like a raw member), else :data:`DEFAULT_MAX_DECODED_BYTES` (1 GiB).
    """
    return env_int("MAX_DECODED_BYTES", env_int("MAX_MEMBER_BYTES", DEFAULT_MAX_DECODED_BYTES))


#: Shard URLs one spec may expand to (4 Mi: about 400 MB of URL strings).
DEFAULT_MAX_SHARDS = 1 << 22


def max_shards() -> int:
    """The most shard URLs a spec's braces may expand to: ``CLOUDSHARDS_MAX_SHARDS``, else
    :data:`DEFAULT_MAX_SHARDS`. A short spec (``{0..99999999}``) cannot fill memory."""
    return env_int("MAX_SHARDS", DEFAULT_MAX_SHARDS)


def cache_defaults() -> tuple[str | None, int | None]:
    """Cache directory and byte budget from the environment (see :func:`cache_dir_default`
    and :func:`cache_size_default`)."""
    return cache_dir_default(), cache_size_default()


def cache_dir_default() -> str | None:
    """``CLOUDSHARDS_CACHE_DIR``, else webdataset's ``WDS_CACHE`` (so migrated jobs keep
    their settings), else None."""
    return env_str("CACHE_DIR") or os.environ.get("WDS_CACHE") or None


def cache_size_default() -> int | None:
    """``CLOUDSHARDS_CACHE_SIZE``, else webdataset's ``WDS_CACHE_SIZE``, in bytes; else None.

    Raises:
        ConfigError: The value is not a whole number of bytes (``1e18`` is one).
    """
    size_text = env_str("CACHE_SIZE") or os.environ.get("WDS_CACHE_SIZE") or None
    if size_text is None:
        return None
    try:
        return int(size_text)
    except ValueError:
        pass
    try:
        # webdataset writes its default as a float ("1e18"); accept whole numbers of bytes.
        value = float(size_text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not value.is_integer():
        raise ConfigError(f"cache size {size_text!r} is not a whole number of bytes")
    return int(value)


def env_seed() -> int | None:
    """``CLOUDSHARDS_SEED``, else webdataset's ``WDS_SEED``, else None.

    Raises:
        ValueError: The value is not an integer.
    """
    value = env_str("SEED") or os.environ.get("WDS_SEED")
    return int(value) if value else None


#: Variables webdataset 1.0.2 reads without its ``WDS_`` prefix.
_WEBDATASET_VARS = frozenset({"ALLOW_OBSOLETE", "GOPEN_BUFFER", "GOPEN_REWRITE"})


@overload
def webdataset_var(name: str) -> str | None: ...
@overload
def webdataset_var(name: str, default: str) -> str: ...


def webdataset_var(name: str, default: str | None = None) -> str | None:
    """webdataset's environment variable ``name`` as set (an empty value too), else ``default``.

    ``name`` is a ``WDS_*`` variable (``${x}`` in a URL reads ``WDS_x``) or one of
    ``ALLOW_OBSOLETE``, ``GOPEN_BUFFER``, ``GOPEN_REWRITE``; the webdataset layer parses
    them as webdataset does.
    """
    if not name.startswith("WDS_") and name not in _WEBDATASET_VARS:
        raise ValueError(f"{name} is not an environment variable of webdataset's")
    return os.environ.get(name, default)


def webdataset_secure() -> bool:
    """webdataset's ``enforce_security`` (``WDS_SECURE=1``, or set on
    ``cloudshards.webdataset.utils``): local files are not opened, URLs not rewritten, and no
    pickle, full ``torch.load`` or ``pipe:`` command runs, whatever cloudshards' opt-ins say."""
    compat = sys.modules.get("cloudshards.webdataset.utils")
    if getattr(compat, "enforce_security", False):
        return True
    return webdataset_var("WDS_SECURE", "0") not in ("", "0")


def counts_dir() -> Path:
    """Where a node keeps what its processes share (sample counts, listings):
    ``CLOUDSHARDS_COUNTS_DIR``, else ``~/.cache/cloudshards/counts``."""
    configured = env_str("COUNTS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "cloudshards" / "counts"
