"""Redaction of credentials and signed-URL query strings from anything we print or log."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

__all__ = ["redact_text", "redact_url"]

_URL_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """Return ``url`` without user info (``user:secret@``) and with any query string masked.

    Signed URLs (S3 presigned, GCS signed) carry their secrets in the query string, so the
    whole query is replaced by ``?<redacted>``; the fragment is dropped for the same reason.
    """
    if _URL_START.match(url) is None:
        # Not a URL itself (a local path or a pipe: command): redact URLs embedded in it.
        return redact_text(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "<redacted>@" + netloc.rsplit("@", 1)[1]
    query = "<redacted>" if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def redact_text(text: str) -> str:
    """Redact every URL that appears inside free text (e.g. a backend's error message)."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
