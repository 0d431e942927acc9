"""How a cache entry is named: a hash of the URL (credentials and signing parameters removed)
and of the store's endpoint, as the backend itself would pick it."""

from __future__ import annotations

import hashlib
import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from cloudshards.source.endpoints import store_endpoint

__all__ = ["canonical_url", "entry_name", "store_endpoint"]


# --- entry names --------------------------------------------------------------------------

_ALIASES = {"gcs": "gs", "s3a": "s3", "local": "file"}
_SIGNING_PARAM = re.compile(
    r"^(x-amz-.*|x-goog-.*|signature|expires|awsaccesskeyid|googleaccessid|sig|se|sp|sv|sr|"
    r"st|spr|skoid|sktid|skt|ske|sks|skv|token|access_token|key-pair-id|policy)$",
    re.IGNORECASE,
)
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def canonical_url(url: str, endpoint: str | None = None) -> str:
    """The URL an entry is keyed by: no user info, no signing parameters, protocol aliases
    unified, so a re-signed URL for the same object hits the same entry; a custom endpoint
    (an S3-compatible store, an emulator) is part of the key, so equal bucket names on two
    stores never collide."""
    parts = urlsplit(url)
    scheme = _ALIASES.get(parts.scheme.lower(), parts.scheme.lower())
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode(
        [
            (k, v)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
            if not _SIGNING_PARAM.match(k)
        ]
    )
    canonical = urlunsplit((scheme, netloc, parts.path, query, ""))
    return f"{canonical} @{endpoint}" if endpoint else canonical


def entry_name(url: str, endpoint: str | None = None) -> str:
    """``<sha256 prefix>-<sanitised basename>``: unique per object, readable, path-safe."""
    canonical = canonical_url(url, endpoint)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:32]
    basename = urlsplit(url).path.rsplit("/", 1)[-1]
    suffix = _UNSAFE_CHARS.sub("_", basename).strip("._")[-80:]
    return f"{digest}-{suffix}" if suffix else digest
