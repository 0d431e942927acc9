"""Where an index's shard entries point: resolving them against the index's URL, and the rule
that they stay inside the index's own location unless the user allows otherwise.

Part of :mod:`cloudshards.indexed`; the rule is documented in ``docs/indexed.md``.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import unquote, urlsplit

from cloudshards.errors import ConfigError
from cloudshards.redact import redact_url
from cloudshards.urls import PIPE_PREFIX, protocol_of

__all__ = [
    "check_entry",
    "entry_outside",
    "parent_url",
    "relative_entry",
    "resolve_entry",
    "strip_query",
]

logger = logging.getLogger(__name__)

_DEFAULT_PORTS = {"http": 80, "https": 443}
#: Percent-decoding rounds before an entry is refused as too deeply encoded.
_MAX_DECODES = 4


def strip_query(url: str) -> str:
    """The URL without an HTTP query string (other protocols keep ``?`` in names)."""
    return url.split("?", 1)[0] if protocol_of(url) in ("http", "https") else url


def parent_url(url: str) -> str:
    """The directory part of a URL or path (the working directory for a bare file name)."""
    base = strip_query(url)
    if "/" not in base:
        return os.getcwd() if protocol_of(url) == "file" else "."
    parent = base.rsplit("/", 1)[0]
    return parent or "/"


def relative_entry(shard_url: str, index_url: str) -> str:
    """How an index at ``index_url`` stores ``shard_url``: relative when below its directory.

    Local paths are compared absolute (a relative index path and the absolute shard paths
    :func:`~cloudshards.indexed.build_index` stores, or ``file://`` URLs, name one directory).
    """
    if protocol_of(shard_url) == "file" and protocol_of(index_url) == "file":
        parent = _location(_directory(index_url), "file").rstrip("/") + "/"
        target = _location(shard_url, "file")
    else:
        parent, target = parent_url(index_url).rstrip("/") + "/", shard_url
    if target.startswith(parent) and len(target) > len(parent):
        return target[len(parent) :]
    return shard_url


def resolve_entry(stored: str, index_url: str) -> str:
    """The absolute URL of a stored shard entry of the index at ``index_url``."""
    if "://" in stored or stored.startswith(("/", PIPE_PREFIX)):
        return stored
    return f"{_directory(index_url).rstrip('/')}/{stored}"


def _directory(index_url: str) -> str:
    parent = parent_url(index_url)
    if protocol_of(index_url) == "file" and "://" not in index_url:
        parent = os.path.abspath(parent)
    return parent


def check_entry(stored: str, index_url: str, position: int, *, allow_external_shards: bool) -> None:
    """Refuse a shard entry outside the index's location (unless allowed) or a ``pipe:`` one.

    Raises:
        ConfigError: Naming the (redacted) index URL, the entry and why, and how to opt in.
    """
    where = f"index {redact_url(index_url)}: shard entry {position} {redact_url(stored)!r}"
    if stored.startswith(PIPE_PREFIX):
        raise ConfigError(f"{where} is a pipe: command; an index never runs commands")
    if allow_external_shards:
        return
    reason = entry_outside(stored, index_url)
    if reason is not None:
        raise ConfigError(
            f"{where} {reason}: an index may only list shards under its own directory "
            f"({redact_url(_directory(index_url))}/, same protocol and host or bucket). "
            "If you trust this index, pass allow_external_shards=True"
        )


def entry_outside(stored: str, index_url: str) -> str | None:
    """Why shard entry ``stored`` is not inside the location of the index at ``index_url``, or
    None when it is.

    Inside means: the index's protocol, its host (and port) or bucket, under its directory,
    with no ``..`` segment and no backslash, percent-encoded or not (servers decode ``%2e%2e``
    and some treat ``\\`` as ``/``), and no control character.
    """
    problem = _path_trick(stored)
    if problem is not None:
        return problem
    resolved = resolve_entry(stored, index_url)
    protocol, target_protocol = protocol_of(index_url), protocol_of(resolved)
    if target_protocol != protocol:
        return f"is a {target_protocol} URL and the index a {protocol} one"
    try:
        base = _location(_directory(index_url), protocol)
        target = _location(resolved, protocol)
    except ValueError:  # a malformed host or port
        return "is not a valid URL"
    if not target.startswith(base.rstrip("/") + "/"):
        return "lies outside the index's directory"
    return None


def _path_trick(stored: str) -> str | None:
    text = stored
    for _ in range(_MAX_DECODES):
        if "\\" in text:
            return "contains a backslash"
        if any(ord(c) < 32 or c == "\x7f" for c in text):
            return "contains a control character"
        if ".." in text.split("/"):
            return "climbs out of the index's directory with '..'"
        decoded = unquote(text)
        if decoded == text:
            return None
        text = decoded
    return "is percent-encoded too many times"


def _location(url: str, protocol: str) -> str:
    """A comparable form: local paths absolute, HTTP hosts lower-cased with their port."""
    if protocol == "file":
        path = url[len("file://") :] if url.startswith("file://") else url
        return os.path.abspath(path)
    if protocol in _DEFAULT_PORTS:
        parts = strip_query(url).split("#", 1)[0]
        split = urlsplit(parts)
        port = split.port or _DEFAULT_PORTS[protocol]  # user info is not part of the place
        return f"{protocol}://{(split.hostname or '').lower()}:{port}{split.path}"
    return f"{protocol}://{url.split('://', 1)[1]}" if "://" in url else url
