"""What the node cache knows about an object: its size and the checksum (if any) its download
is verified against, and the stores whose checksums proved untrustworthy."""

from __future__ import annotations

import base64
import binascii
import re
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from cloudshards.source import OpenOptions, object_etag, object_info
from cloudshards.urls import protocol_of

__all__ = ["distrust_checksums", "remote_facts", "trusted_md5"]

_S3 = ("s3", "s3a")
_GCS = ("gs", "gcs")
_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")


# --- size and checksum --------------------------------------------------------------------


def remote_facts(
    stream: Any, url: str, options: OpenOptions, endpoint: str | None
) -> tuple[int | None, str | None]:
    """The object's size and, when the store guarantees one, its MD5 (hex), for verification."""
    raw = getattr(stream, "_raw", stream)
    details = getattr(stream, "details", None) or getattr(raw, "details", None)
    size = getattr(stream, "size", None) or getattr(raw, "size", None)
    if not isinstance(details, dict) or details.get("size") is None:
        # Streaming HTTP files carry {"size": None}: ask the store, or nothing is verified.
        try:
            details = object_info(url, options)
        except Exception:
            details = {}
    if size is None:
        size = details.get("size")
    md5 = None if _distrusted(url, endpoint) else trusted_md5(url, details, endpoint)
    return (int(size) if size is not None else None), md5


def trusted_md5(url: str, details: Mapping[str, Any], endpoint: str | None) -> str | None:
    """The MD5 (hex) of the object's bytes, only where the store guarantees that is what a
    field holds; None otherwise (the download is then verified by its length only).

    - GCS (``gs://``, JSON API): ``md5Hash`` is the MD5 of the stored bytes; composite
      objects have none. Not trusted when ``contentEncoding`` is set: the bytes served may
      be decompressed (transcoding), so they are not the stored ones.
    - S3 (``s3://`` on AWS itself): the ETag is the body's MD5 only for a single-part upload
      (no ``-N`` suffix) stored unencrypted or with SSE-S3; not with SSE-KMS, DSSE-KMS or
      SSE-C. So it is trusted only when the metadata says ``ServerSideEncryption: AES256``
      and no ``SSECustomerAlgorithm``. s3fs's ``info()`` reports neither field (it keeps
      only ETag, size, dates, storage class, version and content type), so with s3fs as it
      is, S3 ETags are never trusted. With a custom endpoint (MinIO, Ceph, R2, ...) the
      same metadata proves nothing: their ETags of encrypted or otherwise stored objects are
      opaque.
    - Everything else, HTTP(S) above all: an ETag is an opaque version tag (a CDN in front
      of an SSE-KMS bucket serves 32 hex digits that are no MD5).
    """
    protocol = protocol_of(url)
    if protocol in _GCS:
        return _gcs_md5(details)
    if protocol in _S3 and _is_aws(endpoint):
        return _s3_md5(details)
    return None


def _gcs_md5(details: Mapping[str, Any]) -> str | None:
    if details.get("contentEncoding") not in (None, "", "identity"):
        return None
    value = details.get("md5Hash")
    if not isinstance(value, str):
        return None
    try:
        digest = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return digest.hex() if len(digest) == 16 else None


def _s3_md5(details: Mapping[str, Any]) -> str | None:
    etag = str(object_etag(details) or "").strip().strip('"').lower()
    if not _MD5_HEX.match(etag):
        return None  # a multipart upload ("<hex>-<parts>"), or not an MD5 at all
    if details.get("ServerSideEncryption") != "AES256" or details.get("SSECustomerAlgorithm"):
        return None
    return etag


def _is_aws(endpoint: str | None) -> bool:
    if endpoint is None:
        return True
    host = (urlsplit(endpoint).hostname or "").lower()
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


# Stores whose "guaranteed" checksum turned out not to be the MD5 of their bytes (two
# downloads agreed with each other, not with it): this process stops using their checksums,
# so one such store costs one extra download per process, not one per shard.
_DISTRUSTED: set[tuple[str, str | None, str]] = set()
_DISTRUSTED_LOCK = threading.Lock()


def _store_key(url: str, endpoint: str | None) -> tuple[str, str | None, str]:
    protocol = protocol_of(url)
    protocol = "s3" if protocol in _S3 else "gs" if protocol in _GCS else protocol
    return protocol, endpoint, urlsplit(url).netloc.rsplit("@", 1)[-1].lower()


def distrust_checksums(url: str, endpoint: str | None) -> None:
    """Stop verifying downloads from the store (and bucket) of ``url`` by its checksums."""
    with _DISTRUSTED_LOCK:
        _DISTRUSTED.add(_store_key(url, endpoint))


def _distrusted(url: str, endpoint: str | None) -> bool:
    with _DISTRUSTED_LOCK:
        return _store_key(url, endpoint) in _DISTRUSTED
