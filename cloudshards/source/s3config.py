"""obstore's S3 configuration as s3fs and botocore would read the user's options: which
options translate (:func:`s3_settings`), and the credentials callback (:class:`Credentials`)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from cloudshards.source.endpoints import store_endpoint, with_fsspec_config
from cloudshards.source.options import OpenOptions
from cloudshards.urls import options_for, protocol_of

__all__ = ["Credentials", "Unsupported", "s3_settings"]

_S3 = ("s3", "s3a")
#: s3fs options that change nothing about reading one object's bytes.
_IGNORED = frozenset(
    {
        "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
        "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions",
        "asynchronous", "loop", "max_concurrency", "fixed_upload_size", "version_aware",
        "s3_additional_kwargs", "session_kwargs", "use_ssl", "username", "password",
    }
)  # fmt: skip
_HANDLED = frozenset(
    {"key", "secret", "token", "anon", "profile", "endpoint_url", "client_kwargs",
     "config_kwargs", "requester_pays"}
)  # fmt: skip
_CLIENT_KWARGS = frozenset({"endpoint_url", "region_name", "verify"})
_CONFIG_KWARGS = frozenset(
    {"s3", "max_pool_connections", "connect_timeout", "read_timeout", "retries",
     "signature_version", "user_agent_extra", "tcp_keepalive"}
)  # fmt: skip
#: How long credentials from a refreshing botocore provider are used before asking again.
_CREDENTIAL_TTL = datetime.timedelta(minutes=5)


class Unsupported(Exception):
    """Why a shard cannot be read through obstore (it is then read through fsspec)."""

    def __init__(self, why: str, *, fixable: bool = False, passing: bool = False) -> None:
        super().__init__(why)
        #: The user can remove the reason (not a choice of theirs, such as an option).
        self.fixable = fixable
        #: Only this object goes through fsspec: the next one asks again.
        self.passing = passing


def s3_settings(url: str, options: OpenOptions) -> dict[str, Any]:
    """obstore's S3 configuration for ``url`` as s3fs would read it (see the module doc)."""
    kwargs = with_fsspec_config(_S3, options_for(protocol_of(url), options.storage_options))
    unknown = set(kwargs) - _HANDLED - _IGNORED
    if unknown:
        raise Unsupported(f"storage option {sorted(unknown)[0]!r} has no obstore equivalent")
    client = kwargs.get("client_kwargs") or {}
    conf = kwargs.get("config_kwargs") or {}
    if not isinstance(client, Mapping) or set(client) - _CLIENT_KWARGS:
        raise Unsupported("client_kwargs other than endpoint_url, region_name, verify")
    if not isinstance(conf, Mapping) or set(conf) - _CONFIG_KWARGS:
        raise Unsupported("config_kwargs other than addressing style, pools and timeouts")
    if conf.get("signature_version") not in (None, "s3v4"):
        raise Unsupported(f"signature_version {conf.get('signature_version')!r}")
    verify = client.get("verify", True)
    if verify not in (True, False, None):
        raise Unsupported("client_kwargs verify= a CA bundle path")
    settings: dict[str, Any] = {"_insecure": verify is False}
    endpoint = store_endpoint(url, options)
    profile = kwargs.get("profile") if isinstance(kwargs.get("profile"), str) else None
    region = client.get("region_name") or _profile_region(profile)
    if endpoint is None:
        if not region:
            raise Unsupported("no region configured (AWS_DEFAULT_REGION or region_name)")
        bucket = urlsplit(url).netloc
        settings["virtual_hosted_style_request"] = "." not in bucket
    else:
        settings["endpoint"] = endpoint
        settings["virtual_hosted_style_request"] = False
    s3_conf = conf.get("s3")
    if isinstance(s3_conf, Mapping) and s3_conf.get("addressing_style") in ("virtual", "path"):
        settings["virtual_hosted_style_request"] = s3_conf["addressing_style"] == "virtual"
    settings["region"] = region or "us-east-1"
    settings["request_payer"] = bool(kwargs.get("requester_pays", False))
    if kwargs.get("anon"):
        settings["skip_signature"] = True
    else:
        settings["skip_signature"] = False
        settings["credentials"] = Credentials(kwargs, profile)
    return settings


def _profile_region(profile: str | None) -> str | None:
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        return region
    import botocore.session  # type: ignore[import-untyped]

    try:
        value = botocore.session.Session(profile=profile).get_config_variable("region")
    except Exception:  # a broken config file: s3fs would fail the same way, later
        return None
    return str(value) if value else None


def _environment_keys(profile: str | None) -> tuple[str, str, str | None] | None:
    """The keys botocore's chain would take from the environment, read without botocore.

    botocore's first provider reads ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (and the
    session token) unless a profile is named explicitly; importing botocore and building its
    session costs ~0.3 s of CPU in every process (each DataLoader worker) that opens a shard.
    Keys with an expiry (``AWS_CREDENTIAL_EXPIRATION``) are left to botocore, which refreshes.
    """
    environ = os.environ
    key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if profile is not None or not (key and secret) or environ.get("AWS_CREDENTIAL_EXPIRATION"):
        return None
    token = environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN") or None
    return key, secret, token


class Credentials:
    """obstore's credential callback: the given keys, or botocore's chain as s3fs uses it.

    Never shown: its repr names no secret.
    """

    def __init__(self, kwargs: Mapping[str, Any], profile: str | None) -> None:
        self._given = (kwargs.get("key"), kwargs.get("secret"), kwargs.get("token"))
        self._profile = profile
        self._chain: Any = None
        if not (self._given[0] and self._given[1]):
            self._given = _environment_keys(profile) or self._given
        if not (self._given[0] and self._given[1]):
            import botocore.session

            self._chain = botocore.session.Session(profile=profile).get_credentials()
            if self._chain is None:
                raise Unsupported("no credentials found (s3fs reports the error)")

    def __call__(self) -> dict[str, Any]:
        if self._chain is None:
            key, secret, token = self._given
            return {"access_key_id": key, "secret_access_key": secret, "token": token,
                    "expires_at": None}  # fmt: skip
        frozen = self._chain.get_frozen_credentials()
        refreshing = hasattr(self._chain, "refresh_needed")
        expires = datetime.datetime.now(datetime.UTC) + _CREDENTIAL_TTL if refreshing else None
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expires}  # fmt: skip

    def __repr__(self) -> str:
        return f"Credentials(profile={self._profile!r}, given={self._given[0] is not None})"
