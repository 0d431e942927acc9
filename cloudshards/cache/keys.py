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
# Left out of every key: AWS's and Google's signing parameters, and bearer tokens.
_CREDENTIAL_PARAM = re.compile(r"^(x-amz-.*|x-goog-.*|token|access_token)$", re.IGNORECASE)
# A signature: then the parameters it signs are left out too (they change with each signing).
_SIGNATURE_PARAM = re.compile(r"^(x-amz-signature|x-goog-signature|signature|sig)$", re.IGNORECASE)
# Signed along (V2 query strings, CloudFront, Azure SAS); generic names, which on an unsigned
# URL may well pick the object ("?st=0"): they are kept there.
_SIGNED_ALONG = re.compile(
    r"^(signature|expires|awsaccesskeyid|googleaccessid|key-pair-id|policy|sig|sv|ss|srt|sp|"
    r"se|st|spr|sr|sip|si|skoid|sktid|skt|ske|sks|skv|sdd)$",
    re.IGNORECASE,
)
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def canonical_url(url: str, endpoint: str | None = None) -> str:
    """The URL an entry is keyed by: no user info, no signing parameters (those a signature
    covers only when the URL carries one: ``?st=0`` and ``?st=1`` of an unsigned URL are two
    objects), protocol aliases unified, so a re-signed URL for the same object hits the same
    entry; a custom endpoint
    (an S3-compatible store, an emulator) is part of the key, so equal bucket names on two
    stores never collide."""
    parts = urlsplit(url)
    scheme = _ALIASES.get(parts.scheme.lower(), parts.scheme.lower())
    netloc = parts.netloc.rsplit("@", 1)[-1]
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    signed = any(_SIGNATURE_PARAM.match(k) for k, _ in pairs)
    query = urlencode(
        [
            (k, v)
            for k, v in pairs
            if not (_CREDENTIAL_PARAM.match(k) or (signed and _SIGNED_ALONG.match(k)))
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
