"""obstore's GCS configuration as gcsfs reads the user's options: the endpoint gcsfs would
call, and gcsfs's own credentials object as obstore's token callback.

gcsfs is not re-implemented here. The filesystem fsspec builds from the user's options (the
same instance the fsspec fallback reads through) decides everything about credentials: a
``token`` of any form gcsfs takes (a service-account file, an authorized-user JSON, a dict,
a ``google.auth`` credentials object, a raw access token, ``"google_default"``, ``"cloud"``,
``"anon"``, or none: gcsfs's own chain), ``project`` and ``access``. obstore asks
:class:`GoogleToken` for a bearer token, which gcsfs refreshes as it would for itself. An
anonymous filesystem (``token="anon"``, or no credentials found) sends unsigned requests.
"""

from __future__ import annotations

import datetime
from typing import Any

from cloudshards.redact import redact_url
from cloudshards.source.endpoints import store_endpoint
from cloudshards.source.options import OpenOptions
from cloudshards.source.remote import fsspec_object
from cloudshards.source.s3config import Unsupported
from cloudshards.urls import resolve

__all__ = ["GoogleToken", "TokenUnavailable", "gcs_settings", "xml_api_missing"]

#: Where gcsfs sends requests when no endpoint, emulator or other universe is configured.
DEFAULT_BASE_URL = "https://storage.googleapis.com"


def gcs_settings(url: str, options: OpenOptions) -> dict[str, Any]:
    """obstore's GCS configuration for ``url`` as gcsfs reads the options (see the module
    doc); ``credentials`` holds the token callback, or is absent for unsigned requests.

    Raises:
        Unsupported: An option obstore cannot honour: ``requester_pays`` (obstore sends no
            ``userProject``), ``session_kwargs`` (aiohttp's own settings), or mutual TLS.
    """
    fs, _ = resolve(url, options.storage_options)
    if getattr(fs, "requester_pays", False):
        raise Unsupported("requester_pays (obstore sends no userProject)")
    if getattr(fs, "session_kwargs", None):
        raise Unsupported("session_kwargs (aiohttp settings) have no obstore equivalent")
    if getattr(fs, "_use_client_cert", False):
        raise Unsupported("mutual TLS (GOOGLE_API_USE_CLIENT_CERTIFICATE)")
    google = getattr(fs, "credentials", None)
    settings: dict[str, Any] = {"base_url": store_endpoint(url, options) or DEFAULT_BASE_URL}
    if google is None or getattr(google, "credentials", None) is None:
        settings["skip_signature"] = True  # gcsfs itself sends these requests unsigned
    else:
        settings["credentials"] = GoogleToken(google)
    return settings


def xml_api_missing(
    store: Any, key: str, url: str, options: OpenOptions, endpoint: str
) -> Unsupported | None:
    """Why a GCS endpoint other than Google's cannot be read through obstore: it does not
    serve the XML API (``GET /bucket/object``) obstore reads, as fake-gcs-server does not
    unless started with ``-public-host``; None where it does.

    Told by one HEAD of the object being opened: an answer says it does; a 404 for an
    object gcsfs (the JSON API) finds says it does not. The caller keeps either verdict.

    Raises:
        Unsupported: (``passing``) It cannot tell yet: the HEAD failed otherwise, or the
            object is missing for gcsfs too. This object is read through gcsfs (which names
            a missing object as such); the next one asks again.
    """
    import obstore

    try:
        obstore.head(store, key)
        return None
    except FileNotFoundError:
        pass
    except Exception as exc:
        raise Unsupported(f"cannot tell yet whether {redact_url(endpoint)} serves GCS's XML "
                          f"API ({type(exc).__name__})", passing=True) from None  # fmt: skip
    try:
        fsspec_object(url, options.storage_options).info()
    except Exception:
        raise Unsupported(f"cannot tell yet whether {redact_url(endpoint)} serves GCS's XML "
                          "API (the object is missing)", passing=True) from None  # fmt: skip
    return Unsupported(
        f"{redact_url(endpoint)} does not serve GCS's XML API (GET /bucket/object); a "
        "fake-gcs-server serves it when started with -public-host set to its host",
        fixable=True,
    )


class TokenUnavailable(ConnectionError):
    """The token endpoint could not be reached (a network failure, not a refusal): retried
    like any transient failure of the store (obstore carries the name in its error)."""


def _unreachable(exc: BaseException) -> bool:
    """Whether a refresh failed for want of an answer: google-auth's TransportError, or a
    connection error or timeout of the HTTP client under it."""
    names = {type(error).__name__ for error in (exc, exc.__cause__, exc.__context__) if error}
    return bool(names & {"TransportError", "ConnectionError", "Timeout", "ConnectTimeout",
                         "ReadTimeout", "TimeoutError", "ConnectionRefusedError"})  # fmt: skip


class GoogleToken:
    """obstore's GCS credential callback: the bearer token of gcsfs's credentials object,
    refreshed by gcsfs (``maybe_refresh``) as it refreshes it for its own requests.

    Never shown: its repr names no token.
    """

    def __init__(self, google: Any) -> None:
        self._google = google

    def __call__(self) -> dict[str, Any]:
        try:
            self._google.maybe_refresh()
        except Exception as exc:
            if not _unreachable(exc):
                raise  # a refused grant (gcsfs: HttpError 401): access denied, at once
            raise TokenUnavailable(f"{type(exc).__name__}: {exc}") from None
        credentials = self._google.credentials
        expiry = getattr(credentials, "expiry", None)  # google.auth: naive UTC, or None
        if isinstance(expiry, datetime.datetime) and expiry.tzinfo is None:
            expiry = expiry.replace(tzinfo=datetime.timezone.utc)
        return {"token": credentials.token, "expires_at": expiry}

    def __repr__(self) -> str:
        return f"GoogleToken(method={getattr(self._google, 'method', None)!r})"
