"""URL specs to shard lists, and shard URLs to fsspec filesystems.

Owns brace/``::``/``${VAR}`` expansion, globbing on any filesystem, per-protocol storage
options, and the mapping of backend failures (unknown protocol, missing package) to clear errors.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import braceexpand
import fsspec
import fsspec.core
from fsspec.registry import known_implementations

from cloudshards import config
from cloudshards.backends import gcs_options, new_filesystem, started, url_options
from cloudshards.errors import ConfigError
from cloudshards.listing import shared_listing
from cloudshards.process import PerProcess
from cloudshards.redact import install_log_redaction, raise_redacted, redact_text, redact_url

__all__ = [
    "PIPE_PREFIX",
    "expand_urls",
    "options_for",
    "protocol_of",
    "resolve",
]

logger = logging.getLogger(__name__)

PIPE_PREFIX = "pipe:"

#: Protocol aliases that share one set of storage options.
_OPTION_ALIASES = {"gcs": "gs", "s3a": "s3", "https": "http", "local": "file"}

_ENV_REF = re.compile(r"\$\{(\w+)\}")
_GLOB_CHARS = re.compile(r"[*?\[]")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def protocol_of(url: str) -> str:
    """Return the URL's protocol (``"file"`` for bare paths, ``"pipe"`` for ``pipe:`` URLs)."""
    if url.startswith(PIPE_PREFIX):
        return "pipe"
    match = _SCHEME.match(url)
    if match is None:
        # An fsspec chain ("simplecache::s3://...") is named by its outermost protocol: never
        # a local path (a path relative to the working directory, outside any index's).
        return url.partition("::")[0].lower() if _is_fsspec_chain(url) else "file"
    return match.group(1).lower()


#: Object stores whose URLs name a bucket, never credentials: ``s3://key:secret@bucket`` is
#: refused instead of handed to a backend that would put the secret in its errors and logs.
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})


def _refuse_userinfo(url: str) -> None:
    """Raise a ConfigError for an ``s3://`` or ``gs://`` URL with ``user:secret@`` in it
    (the target of an fsspec chain too), and for a port that is not a number: a password
    holding a ``/``, ``?`` or ``#`` ends the authority there, and its start became the port,
    which the backends' parse errors then quote."""
    if _is_fsspec_chain(url):
        _refuse_userinfo(url.partition("::")[2])
        return
    if url.startswith(PIPE_PREFIX):
        return  # a shell command, not a URL
    host = re.split(r"[/?#]", url.partition("://")[2], maxsplit=1)[0].rpartition("@")[2]
    port = host.rpartition("]")[2].partition(":")[2]  # after an IPv6 literal's brackets
    if not re.fullmatch(r"[\d{}.,]*", port):  # digits, or braces that expand to ports
        raise ConfigError(
            f"{redact_url(url)}: the URL's port is not a number; a password with '/', '?' or "
            "'#' in it must be percent-encoded (%2F, %3F, %23)"
        )
    if "@" in url and protocol_of(url) in _BUCKET_PROTOCOLS:
        authority = url.split("://", 1)[1].split("/", 1)[0]
        if "@" in authority:
            raise ConfigError(
                f"{redact_url(url)}: {protocol_of(url)}:// URLs name a bucket, not credentials "
                "(user:secret@); give credentials in storage_options or the environment"
            )


def secure() -> bool:
    """webdataset's ``enforce_security``: see :func:`cloudshards.config.webdataset_secure`."""
    return config.webdataset_secure()


def rewrite_url(url: str) -> str:
    """``url`` after webdataset's ``GOPEN_REWRITE`` rules (``pattern=replacement;...``, each
    pattern a regular expression matched at the start, the first that matches applied), as
    webdataset applies them to every shard it opens: a mirror for a bucket, say.

    Raises:
        ConfigError: Rules are set under :func:`secure`, as webdataset refuses them.
    """
    rules = config.webdataset_var("GOPEN_REWRITE")
    if rules is None:
        return url
    if secure():
        raise ConfigError("GOPEN_REWRITE is not applied under WDS_SECURE (enforce_security)")
    for rule in rules.split(";"):
        pattern, replacement = rule.split("=", 1)
        rewritten = re.sub("^" + pattern, replacement, url)
        if rewritten != url:
            logger.debug("GOPEN_REWRITE: %s -> %s", redact_url(url), redact_url(rewritten))
            return rewritten
    return url


def substitute_env(url: str) -> str:
    # webdataset 1.0.2 semantics: ${name} is replaced by the environment variable WDS_name.
    def lookup(match: re.Match[str]) -> str:
        name = "WDS_" + match.group(1)
        value = config.webdataset_var(name)
        if value is None:
            raise ConfigError(
                f"{redact_url(url)}: ${{{match.group(1)}}} needs the environment variable {name}"
            )
        return value

    for _ in range(10):
        substituted = _ENV_REF.sub(lookup, url)
        if substituted == url:
            break
        url = substituted
    return url


def _has_glob(url: str) -> bool:
    protocol = protocol_of(url)
    if protocol == "pipe":
        return False
    if protocol in ("http", "https"):
        # '?' starts a query string in HTTP URLs; only '*' means a glob there.
        path = url.split("?", 1)[0]
        return "*" in path
    return _GLOB_CHARS.search(url) is not None


def _glob(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    return shared_listing(url, storage_options, lambda: _list(url, storage_options))


def _list(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    fs, path = resolve(url, storage_options)
    try:
        if fs.isfile(path):
            # A shard whose name holds [, ], * or ? (data[1].tar): webdataset opens it as
            # named, and a glob would read data1.tar instead. One lookup per glob spec.
            return [url]
        matches = sorted(fs.glob(path))
    except FileNotFoundError:
        matches = []
    except Exception as exc:
        raise_redacted(
            ConfigError(f"cannot expand glob {redact_url(url)}: {redact_text(str(exc))}"), exc
        )
    protocol = protocol_of(url)
    if protocol == "file":
        return [str(m) for m in matches]
    return [fs.unstrip_protocol(m) for m in matches]


def expand_urls(
    urls: str | Iterable[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    glob: bool = True,
) -> list[str]:
    """Expand a shard spec into the list of shard URLs, in order.

    Accepts a string with ``{000..999}`` / ``{a,b}`` braces (nested too), several specs joined
    by ``::`` (webdataset's list syntax), ``${VAR}`` (read from ``WDS_VAR``), and globs
    (``*``, ``?``, ``[...]``) expanded through the URL's own filesystem; or an iterable of such
    strings.

    Args:
        urls: The spec.
        storage_options: Per-protocol fsspec options, used to list the store for globs.
        glob: Expand glob characters (turn off for names that really contain ``*``/``[``).

    Returns:
        The expanded URLs.

    Raises:
        ConfigError: The spec expands to nothing, a glob matches nothing, or a variable is unset.
    """
    specs: list[str]
    if isinstance(urls, str):
        specs = _LIST_SEPARATOR.split(urls) if not _is_fsspec_chain(urls) else [urls]
    else:
        specs = list(urls)
        if not all(isinstance(u, str) for u in specs):
            raise ConfigError("shard URLs must be strings")
    result: list[str] = []
    for spec in specs:
        spec = substitute_env(_clean(spec))
        _refuse_userinfo(spec)
        if not (glob and _has_glob(spec)):
            # Brace expansion only rearranges the spec's text: no glob in it, none in its URLs
            # (10^6 shards: no per-URL check).
            result.extend(_expanded(spec, len(result)))
            continue
        for url in _expanded(spec, len(result)):
            if _has_glob(url):
                matches = _glob(url, storage_options)
                if not matches:
                    raise ConfigError(f"glob {redact_url(url)} matched no shards")
                result.extend(matches)
            else:
                result.append(url)
    if not result:
        raise ConfigError(f"shard spec {_describe(urls)} expanded to no URLs")
    return result


#: webdataset's list separator, but not the ``::`` of an IPv6 host (``http://[::1]:8000/``).
_LIST_SEPARATOR = re.compile(r"::(?![^\[]*\])")


def _expanded(spec: str, before: int) -> list[str]:
    """The URLs of ``spec``'s braces, refused past :func:`~cloudshards.config.max_shards` in
    all (``{0..99999999}`` is a few bytes of spec and gigabytes of URLs)."""
    limit = config.max_shards()
    urls = list(itertools.islice(braceexpand.braceexpand(spec), limit - before + 1))
    if before + len(urls) > limit:
        raise ConfigError(
            f"shard spec {redact_url(spec)!r} expands to over {limit:,} URLs "
            "(CLOUDSHARDS_MAX_SHARDS raises the limit)"
        )
    return urls


#: What Python's URL parser drops, as webdataset opened its shards through it: C0 controls
#: and spaces before a URL, tabs and line breaks anywhere (a list read with readlines()).
_LEADING = "".join(map(chr, range(0x21)))
_DROPPED = str.maketrans("", "", "\t\r\n")


def _clean(spec: str) -> str:
    spec = spec.lstrip(_LEADING)
    if spec.startswith(PIPE_PREFIX):  # a shell command, run as written: its tabs and line
        return spec.rstrip("\r\n")  # breaks are the shell's (webdataset ran it unparsed)
    return spec.translate(_DROPPED)


def _is_fsspec_chain(url: str) -> bool:
    # "simplecache::s3://b/k" is an fsspec chained URL, not a list of two specs.
    first, _, rest = url.partition("::")
    return "://" not in first and _SCHEME.match(rest) is not None and first.isidentifier()


def _describe(urls: str | Iterable[str]) -> str:
    if isinstance(urls, str):
        return repr(redact_url(urls))
    return "(empty list)"


def options_for(protocol: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Pick the fsspec options for ``protocol`` from a user mapping.

    ``storage_options`` is either per-protocol (``{"s3": {...}, "gs": {...}}``; ``gcs``/``gs``,
    ``s3``/``s3a`` and ``http``/``https`` share options) or flat (no key is a protocol name), in
    which case it applies to every protocol.
    """
    if not storage_options:
        return {}
    canonical = _OPTION_ALIASES.get(protocol, protocol)
    per_protocol = {_OPTION_ALIASES.get(k, k): v for k, v in storage_options.items()}
    if any(k in known_implementations or k == "file" for k in per_protocol):
        value = per_protocol.get(canonical, per_protocol.get(protocol))
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"storage_options[{protocol!r}] must be a mapping of fsspec options")
        return dict(value)
    return dict(storage_options)


#: This process's filesystems by protocol and options (a forked worker makes its own: they
#: hold sessions, event loops and threads). Tests replace ``_fs_cache`` for fresh instances.
_fs_lock: PerProcess[threading.Lock] = PerProcess(threading.Lock)
_fs_cache: PerProcess[dict[tuple[str, str], fsspec.AbstractFileSystem]] = PerProcess(dict)


def _make_key(protocol: str, options: Mapping[str, Any]) -> str:
    # Options can hold unhashable values (dicts, credentials objects); repr is a stable-enough key
    # within one process, and it never leaves memory.
    return repr(sorted(options.items(), key=lambda kv: kv[0]))


def _filesystem(protocol: str, url: str, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    if protocol in ("gs", "gcs"):
        options = gcs_options(options)
    if protocol not in _BUCKET_PROTOCOLS:
        # What the URL names (an FTP server's host and port), as fsspec's url_to_fs takes it;
        # storage_options win. A bucket URL gives its backend nothing needed here.
        options = {**url_options(protocol, url), **options}
    key = (protocol, _make_key(protocol, options))
    with _fs_lock.get():
        filesystems = _fs_cache.get()
        fs = filesystems.get(key)
        if fs is None:
            fs = new_filesystem(protocol, url, options)
            filesystems[key] = fs
            # The backend's modules, and so its loggers, exist now: redact what they log.
            install_log_redaction()
        return fs


def _chain_options(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Options for an fsspec chain: per-protocol ones as fsspec routes them (each link takes
    the options under its protocol's name); flat ones go to the outermost link."""
    return dict(storage_options or {})


def resolve(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a shard URL to ``(filesystem, path)``.

    One filesystem instance is kept per protocol and options per process (and rebuilt after a
    fork, since async backends cannot cross one); the options include what the URL names for
    its backend, as fsspec takes it (an ``ftp://`` or ``sftp://`` server's host, port, user).

    Raises:
        ConfigError: Unknown protocol, missing backend package, or invalid options.
        ShardOpenError: The backend failed to start (``ftp://`` connects when built, ``zip://``
            opens its archive).
    """
    protocol = protocol_of(url)
    if protocol == "pipe":
        raise ConfigError("pipe: URLs are not filesystem URLs; open them with open_shard")
    if "::" in url:
        # fsspec URL chains carry their own option routing; leave them to fsspec entirely.
        options = _chain_options(storage_options)
        chained = started(protocol, url, lambda: fsspec.core.url_to_fs(url, **options))
        install_log_redaction()
        return chained  # type: ignore[no-any-return]
    _refuse_userinfo(url)
    fs = _filesystem(protocol, url, options_for(protocol, storage_options))
    path = fs._strip_protocol(url)
    return fs, path
