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

__all__ = ["GoogleToken", "gcs_settings", "xml_api_missing"]

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
    unless started with ``-public-host``; None where it does, or where this cannot tell.

    Told by one HEAD of the object being opened: a 404 there, for an object gcsfs (the JSON
    API) finds, is an endpoint without the XML API. The caller asks once per endpoint.
    """
    import obstore

    try:
        obstore.head(store, key)
        return None
    except FileNotFoundError:
        pass
    except Exception:
        return None  # the reads will say what is wrong, with retries
    try:
        fsspec_object(url, options.storage_options).info()
    except Exception:
        return None  # missing for gcsfs too: a missing object, named by the read
    return Unsupported(
        f"{redact_url(endpoint)} does not serve GCS's XML API (GET /bucket/object); a "
        "fake-gcs-server serves it when started with -public-host set to its host",
        fixable=True,
    )


class GoogleToken:
    """obstore's GCS credential callback: the bearer token of gcsfs's credentials object,
    refreshed by gcsfs (``maybe_refresh``) as it refreshes it for its own requests.

    Never shown: its repr names no token.
    """

    def __init__(self, google: Any) -> None:
        self._google = google

    def __call__(self) -> dict[str, Any]:
        self._google.maybe_refresh()
        credentials = self._google.credentials
        expiry = getattr(credentials, "expiry", None)  # google.auth: naive UTC, or None
        if isinstance(expiry, datetime.datetime) and expiry.tzinfo is None:
            expiry = expiry.replace(tzinfo=datetime.timezone.utc)
        return {"token": credentials.token, "expires_at": expiry}

    def __repr__(self) -> str:
        return f"GoogleToken(method={getattr(self._google, 'method', None)!r})"
