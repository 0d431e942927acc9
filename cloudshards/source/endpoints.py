"""Which endpoint a store URL resolves against, as the backend itself would pick it: for the
cache's entry names and for choosing and configuring a transport."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import fsspec.config

from cloudshards.source.options import OpenOptions
from cloudshards.urls import options_for, protocol_of

__all__ = ["store_endpoint", "with_fsspec_config"]

_S3 = ("s3", "s3a")
_GCS = ("gs", "gcs")
_TRUE = ("true", "1", "yes")


def store_endpoint(url: str, options: OpenOptions) -> str | None:
    """The endpoint ``url`` resolves against when it is not the provider's default, as the
    backend itself would pick it, without user info, query or fragment (never a credential).

    Every form s3fs and gcsfs accept counts, with their precedence: ``endpoint_url`` (also
    for gcsfs), then s3fs's ``client_kwargs={"endpoint_url": ...}``, each also from fsspec's
    config (``FSSPEC_S3_ENDPOINT_URL``, ``FSSPEC_S3='{"client_kwargs": ...}'``, config
    files), which fsspec applies to every filesystem it creates; then for S3 botocore's
    ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` and the AWS config file (the profile's
    ``endpoint_url``, or its ``services`` section), unless ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``
    or the profile's ``ignore_configured_endpoint_urls`` says not to; for GCS gcsfs's
    ``STORAGE_EMULATOR_HOST`` and ``GOOGLE_CLOUD_UNIVERSE_DOMAIN``.
    """
    protocol = protocol_of(url)
    group = _S3 if protocol in _S3 else _GCS if protocol in _GCS else (protocol,)
    kwargs = with_fsspec_config(group, options_for(protocol, options.storage_options))
    client_kwargs = kwargs.get("client_kwargs")
    endpoint = kwargs.get("endpoint_url") or (
        client_kwargs.get("endpoint_url") if isinstance(client_kwargs, Mapping) else None
    )
    if not endpoint and protocol in _S3:
        profile = kwargs.get("profile")
        endpoint = _aws_endpoint(profile if isinstance(profile, str) else None)
    if not endpoint and protocol in _GCS:
        endpoint = _gcs_endpoint()
    return _without_secrets(str(endpoint)) if endpoint else None


def with_fsspec_config(protocols: tuple[str, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` as fsspec passes them to the filesystem (``fsspec.config.apply_config``):
    the config's values for the class's protocols, then the explicit ones over them."""
    merged: dict[str, Any] = {}
    for protocol in protocols:
        conf = fsspec.config.conf.get(protocol)
        if isinstance(conf, Mapping):
            merged.update(conf)
    merged.update(kwargs)
    return merged


def _aws_endpoint(profile: str | None) -> str | None:
    profile = profile or os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
    config = _aws_config(profile)
    ignore = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
    if (ignore.strip().lower() in _TRUE) if ignore is not None else config.ignore:
        return None
    return (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or config.service_endpoint
        or config.endpoint
    )


class _AwsConfig(NamedTuple):
    ignore: bool = False
    service_endpoint: str | None = None
    endpoint: str | None = None


def _aws_config(profile: str | None) -> _AwsConfig:
    path = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")
    try:
        st = os.stat(path)
    except OSError:
        return _AwsConfig()
    return _parse_aws_config(path, st.st_mtime_ns, st.st_size, profile)


@functools.lru_cache(maxsize=32)
def _parse_aws_config(path: str, mtime_ns: int, size: int, profile: str | None) -> _AwsConfig:
    """The endpoint settings of ``profile`` in the AWS config file at ``path``, read with
    botocore (s3fs's own dependency) as it reads them; the file's identity keys the cache."""
    del mtime_ns, size  # cache keys only
    try:
        import botocore.exceptions  # type: ignore[import-untyped]
        import botocore.session  # type: ignore[import-untyped]
    except ImportError:  # no botocore, no s3fs: nothing can open s3:// anyway
        return _AwsConfig()
    try:
        session = botocore.session.Session(profile=profile)
        session.set_config_variable("config_file", path)
        scoped = session.get_scoped_config()
        services = session.full_config.get("services", {})
    except (botocore.exceptions.BotoCoreError, OSError, ValueError):
        return _AwsConfig()
    ignore = str(scoped.get("ignore_configured_endpoint_urls", "")).strip().lower() in _TRUE
    service_endpoint = None
    section = services.get(scoped.get("services")) if isinstance(services, dict) else None
    if isinstance(section, dict) and isinstance(section.get("s3"), dict):
        service_endpoint = section["s3"].get("endpoint_url")
    endpoint = scoped.get("endpoint_url")
    return _AwsConfig(
        ignore=ignore,
        service_endpoint=str(service_endpoint) if service_endpoint else None,
        endpoint=str(endpoint) if endpoint else None,
    )


def _gcs_endpoint() -> str | None:
    """gcsfs's own fallbacks (``gcsfs.core._location``): an emulator, or another universe."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator not in ("", "default"):
        return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
    universe = os.environ.get("GOOGLE_CLOUD_UNIVERSE_DOMAIN", "googleapis.com")
    return None if universe == "googleapis.com" else f"https://storage.{universe}"


def _without_secrets(endpoint: str) -> str | None:
    """Scheme, host, port and path only: an endpoint URL may carry ``user:secret@`` or a
    signed query string, which must reach neither the key nor anything else."""
    text = endpoint.strip()
    if not text:
        return None
    if "://" not in text:
        text = f"http://{text}"
    parts = urlsplit(text)
    host = parts.netloc.rsplit("@", 1)[-1].lower()
    return urlunsplit((parts.scheme.lower(), host, parts.path.rstrip("/"), "", ""))
