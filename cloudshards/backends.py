"""Building fsspec filesystems: the backend for a protocol, the options a URL carries (an FTP
server's host and port), and a backend that cannot start as a cloudshards error naming the URL.

Used by :mod:`cloudshards.urls`, which keeps one filesystem per protocol and options.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.registry import known_implementations

from cloudshards.errors import CloudShardsError, ConfigError, ShardOpenError
from cloudshards.redact import raise_redacted, redact_text, redact_url

__all__ = ["gcs_options", "missing_backend", "new_filesystem", "started", "url_options"]

T = TypeVar("T")

#: Which ``pip install "cloudshards[EXTRA]"`` brings a protocol's fsspec backend.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}


def url_options(protocol: str, url: str) -> dict[str, Any]:
    """The constructor options ``url`` itself carries, as fsspec's ``url_to_fs`` takes them:
    an ``ftp://`` or ``sftp://`` server's host, port and user, say (none for most protocols).

    Raises:
        ConfigError: The backend cannot read the URL.
    """
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return {}  # new_filesystem reports an unknown protocol or a missing backend
    try:
        return dict(cls._get_kwargs_from_urls(url))
    except Exception as exc:
        raise_redacted(
            ConfigError(f"{redact_url(url)}: not a valid {protocol}:// URL: {_describe(exc)}"), exc
        )


def new_filesystem(protocol: str, url: str, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """A new filesystem for ``protocol`` with ``options`` (``url`` names it in errors).

    Raises:
        ConfigError: Unknown protocol, missing backend package, or invalid options.
        ShardOpenError: The backend failed to start (it connects, or opens an archive, when
            built): a shard on it cannot be read.
    """
    if protocol in ("gs", "gcs") and (
        options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")
    ):
        # gcsfs's default class (ExtendedGcsFileSystem) probes every bucket over gRPC for
        # zonal/HNS features; emulators do not answer and each probe stalls ~60 s. Custom
        # endpoints are emulators or S3-like gateways, so use the plain HTTP implementation.
        try:
            from gcsfs.core import GCSFileSystem
        except ImportError as exc:
            raise missing_backend(protocol, exc) from exc
        cls: type[fsspec.AbstractFileSystem] = GCSFileSystem
    else:
        cls = started(protocol, url, lambda: fsspec.get_filesystem_class(protocol))
    hint = ""
    if "fo" in _check_arguments(cls, protocol, url, options) and "fo" not in options:
        # An archive's filesystem (zip://, tar://) opens its archive, by default "" (the
        # working directory), when built.
        hint = (
            f"; a {protocol}:// URL names a file inside an archive: give the archive as "
            f"storage_options={{{protocol!r}: {{'fo': URL}}}}"
        )
    return started(protocol, url, lambda: cls(**options), hint=hint)


def started(protocol: str, url: str, make: Callable[[], T], *, hint: str = "") -> T:
    """``make()``, which builds a filesystem for ``url``, with its failures as cloudshards
    errors naming the (redacted) URL and chained to a redacted copy of the backend's error.

    Raises:
        ConfigError: Unknown protocol, missing backend package, or invalid options.
        ShardOpenError: Any other failure: the backend could not start (connect, log in, open
            its archive), said with ``hint`` after it.
    """
    try:
        return make()
    except CloudShardsError:
        raise
    except ImportError as exc:
        raise missing_backend(protocol, exc) from exc
    except ValueError as exc:
        if "Protocol not known" in str(exc):
            raise ConfigError(
                f"unknown protocol {protocol!r}; fsspec knows "
                f"{', '.join(sorted(set(known_implementations) | {'file'}))}"
            ) from exc
        raise_redacted(
            ConfigError(f"cannot set up {protocol}:// filesystem: {redact_text(str(exc))}"), exc
        )
    except TypeError as exc:
        raise_redacted(
            ConfigError(f"bad storage_options for {protocol}://: {redact_text(str(exc))}"), exc
        )
    except Exception as exc:
        # An OSError (a refused connection, an archive that is not there) or the backend's
        # own type (ftplib's error_perm for a refused login): the store failed, not the config.
        raise_redacted(
            ShardOpenError(
                f"cannot set up the {protocol}:// filesystem: {_describe(exc)}{hint}", url=url
            ),
            exc,
        )


def missing_backend(protocol: str, exc: ImportError) -> ConfigError:
    """The error for a protocol whose fsspec backend package is not installed."""
    extra = _EXTRAS.get(protocol)
    if extra is not None:
        return ConfigError(
            f'{protocol}:// URLs need an optional package: pip install "cloudshards[{extra}]" '
            f"({exc})"
        )
    return ConfigError(f"{protocol}:// URLs need an fsspec backend package that is missing: {exc}")


def gcs_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for gcsfs, with anonymous access to a ``STORAGE_EMULATOR_HOST``."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator and "token" not in options:
        # An emulator needs no credentials; without this gcsfs probes the GCE metadata server.
        options = {**options, "token": "anon"}
    return options


def _check_arguments(
    cls: type, protocol: str, url: str, options: dict[str, Any]
) -> Mapping[str, inspect.Parameter]:
    """The constructor's parameters; options it cannot take are refused before an instance
    exists (a half-built one can fail again when collected: fsspec's FTPFileSystem.__del__)."""
    try:
        # __init__'s, not the class's: fsspec's metaclass __call__ takes (*args, **kwargs).
        signature = inspect.signature(cls.__init__)  # type: ignore[misc]
    except (TypeError, ValueError):  # no signature to read: let the constructor judge
        return {}
    try:
        signature.bind(None, **options)
    except TypeError as exc:
        reason = redact_text(str(exc))
        if "missing" in reason:
            raise ConfigError(
                f"{redact_url(url)}: the {protocol}:// filesystem needs an argument the URL "
                f"does not give ({reason}): name it in the URL (such as its host) or in "
                "storage_options"
            ) from None
        raise ConfigError(f"bad storage_options for {protocol}://: {reason}") from None
    return signature.parameters


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {redact_text(str(exc) or type(exc).__name__)}"
