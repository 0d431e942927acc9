"""What the node cache knows about an object: its size and the checksum (if any) its download
is verified against, and the stores whose checksums proved untrustworthy."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from cloudshards.source import OpenOptions, object_etag, object_info
from cloudshards.urls import protocol_of

__all__ = [
    "Checksum",
    "Hasher",
    "distrust_checksums",
    "remote_facts",
    "trusted_checksum",
    "trusted_md5",
]


class Hasher(Protocol):
    """A running checksum, as :mod:`hashlib`'s objects are."""

    def update(self, data: bytes | memoryview, /) -> None: ...
    def copy(self) -> Hasher: ...
    def digest(self) -> bytes: ...
    def hexdigest(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Checksum:
    """A checksum the store guarantees for an object's bytes: ``algorithm`` (``"md5"`` or
    ``"crc32c"``) and its value in hex."""

    algorithm: str
    hexdigest: str

    def hasher(self) -> Hasher:
        """A new running checksum of the same algorithm."""
        if self.algorithm == "crc32c":
            return _Crc32c()
        return hashlib.md5(usedforsecurity=False)

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.hexdigest}"


class _Crc32c:
    """CRC32C in :mod:`hashlib`'s interface, on google-crc32c (its C extension computes it in
    hardware, about 30x faster than MD5 here: the verification costs a cold epoch through the
    cache next to nothing). Written here because google-crc32c's own ``Checksum`` takes only
    ``bytes``, and parts come as views: those are fed in small copied pieces."""

    __slots__ = ("_value",)
    _PIECE = 256 << 10

    def __init__(self, value: int = 0) -> None:
        self._value = value

    def update(self, data: bytes | memoryview, /) -> None:
        import google_crc32c

        if isinstance(data, bytes):
            self._value = google_crc32c.extend(self._value, data)
            return
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._PIECE):
            piece = bytes(view[start : start + self._PIECE])
            self._value = google_crc32c.extend(self._value, piece)

    def copy(self) -> _Crc32c:
        return _Crc32c(self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(4, "big")

    def hexdigest(self) -> str:
        return self.digest().hex()


@functools.cache
def _fast_crc32c() -> bool:
    """google-crc32c is installed (gcsfs brings it) with its C extension, not the pure Python
    fallback, which would cost more than the MD5 it replaces."""
    try:
        import google_crc32c
    except ImportError:
        return False
    return getattr(google_crc32c, "implementation", None) == "c"


_S3 = ("s3", "s3a")
_GCS = ("gs", "gcs")
_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")


# --- size and checksum --------------------------------------------------------------------


def remote_facts(
    stream: Any, url: str, options: OpenOptions, endpoint: str | None
) -> tuple[int | None, Checksum | None]:
    """The object's size and, when the store guarantees one, its checksum, for verification."""
    raw = getattr(stream, "_raw", stream)
    details = getattr(stream, "details", None) or getattr(raw, "details", None)
    size = getattr(stream, "size", None) or getattr(raw, "size", None)
    if not isinstance(details, dict) or details.get("size") is None:
        # Streaming HTTP files carry {"size": None}: ask the store, or nothing is verified.
        details = _metadata(url, options)
    elif protocol_of(url) in _GCS and not {"crc32c", "md5Hash"} & set(details):
        # GCS read through obstore (its XML API answers carry no checksum fields): one JSON
        # metadata request, as gcsfs makes at every open, and only if it describes the very
        # generation being downloaded.
        described = _metadata(url, options)
        generation, version = described.get("generation"), details.get("VersionId")
        same = generation is not None and version is not None and str(generation) == str(version)
        details = {**details, **described} if same else details
    if size is None:
        size = details.get("size")
    checksum = None if _distrusted(url, endpoint) else trusted_checksum(url, details, endpoint)
    return (int(size) if size is not None else None), checksum


def _metadata(url: str, options: OpenOptions) -> dict[str, Any]:
    try:
        return object_info(url, options)
    except Exception:
        return {}


def trusted_checksum(url: str, details: Mapping[str, Any], endpoint: str | None) -> Checksum | None:
    """The checksum a download of the object is verified against: on GCS its ``crc32c``
    (which every object has, composite ones included, and which costs next to nothing to
    compute) where google-crc32c's C extension is installed, else the MD5 of
    :func:`trusted_md5`; None when the store guarantees neither."""
    if protocol_of(url) in _GCS and _fast_crc32c():
        crc = _gcs_field(details, "crc32c", 4)
        if crc is not None:
            return Checksum("crc32c", crc)
    md5 = trusted_md5(url, details, endpoint)
    return None if md5 is None else Checksum("md5", md5)


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
    return _gcs_field(details, "md5Hash", 16)


def _gcs_field(details: Mapping[str, Any], name: str, length: int) -> str | None:
    """A GCS checksum field (strict base64 of ``length`` bytes) in hex; None where it is
    missing or malformed, or where the bytes served may not be the stored ones (a
    ``contentEncoding`` other than identity: decompressive transcoding)."""
    if details.get("contentEncoding") not in (None, "", "identity"):
        return None
    value = details.get(name)
    if not isinstance(value, str):
        return None
    try:
        digest = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return digest.hex() if len(digest) == length else None


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
