"""The fsspec transport: the only module that asks an fsspec filesystem for a shard's bytes
or metadata (``open``, ``cat_file``, ``_cat_file``, ``info``), and the write side of the source.

:class:`FsspecObject` is one store object read through its fsspec filesystem; the obstore
transport (:mod:`cloudshards.source.objstore`) has the same methods, and
:mod:`cloudshards.source.transport` picks one of them for each URL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

import fsspec.asyn

from cloudshards.redact import raise_redacted
from cloudshards.source.stream import map_backend_error
from cloudshards.urls import protocol_of, resolve

__all__ = ["FsspecObject", "fsspec_object", "object_etag", "open_output", "open_write"]


class FsspecObject:
    """One store object read through its fsspec filesystem."""

    def __init__(self, fs: Any, path: str, url: str) -> None:
        self.fs = fs
        self.path = path
        self.url = url

    def info(self, timeout: float | None = None) -> dict[str, Any]:
        """One metadata request (size, ETag, ...); backend errors as raised. On async
        backends bounded by ``timeout`` (fsspec's HTTP filesystem waits up to aiohttp's 300 s
        default for a server that never answers, and tries HEAD, then GET)."""
        fs = self.fs
        details: dict[str, Any]
        if timeout is not None and getattr(fs, "async_impl", False) and fs.loop is not None:
            details = fsspec.asyn.sync(fs.loop, fs._info, self.path, timeout=timeout)
        else:
            details = fs.info(self.path)
        return details

    @property
    def conditional(self) -> bool:
        """Whether ranged GETs can be conditional on the ETag: over HTTP (fsspec's HTTP
        filesystem sends the request's headers); s3fs and gcsfs take no such argument."""
        return protocol_of(self.url) in ("http", "https")

    def cat_range(
        self, start: int, end: int, timeout: float | None = None, if_match: str | None = None
    ) -> bytes:
        """Bytes ``[start, end)`` (fewer when the object ends first) in one ranged GET; on
        async backends (s3fs, gcsfs, HTTP) bounded by ``timeout``, so a connection that stops
        delivering is abandoned instead of hanging. ``if_match`` (HTTP only, see
        :attr:`conditional`): only while the object's ETag is this one (else HTTP 412)."""
        fs = self.fs
        extra: dict[str, Any] = {"headers": {"If-Match": if_match}} if if_match else {}
        data: bytes
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            data = fsspec.asyn.sync(
                fs.loop, fs._cat_file, self.path, start=start, end=end, timeout=timeout, **extra
            )
        else:
            data = fs.cat_file(self.path, start=start, end=end, **extra)
        return data

    def cat(self) -> bytes:
        """The whole (small) object in one request."""
        data: bytes = self.fs.cat_file(self.path)
        return data

    def open(self, block_bytes: int) -> IO[bytes]:
        """One streaming read (a single GET where the backend allows)."""
        if protocol_of(self.url) in ("http", "https"):
            # block_size=0 gives one streaming GET instead of many small ranged ones.
            return self.fs.open(self.path, "rb", block_size=0)  # type: ignore[no-any-return]
        return self.fs.open(  # type: ignore[no-any-return]
            self.path, "rb", block_size=block_bytes, cache_type="none"
        )


def fsspec_object(
    url: str, storage_options: Mapping[str, Any] | None, stall_timeout_s: float | None = None
) -> FsspecObject:
    """The object at ``url`` on its fsspec filesystem (resolving needs no request); over
    HTTP(S) an :class:`~cloudshards.source.httpobj.HttpObject`, whose reads of one answer
    are bounded by ``stall_timeout_s``.

    Raises:
        ConfigError: The URL's protocol is unknown or its backend is missing.
    """
    fs, path = resolve(url, storage_options)
    if protocol_of(url) in ("http", "https") and hasattr(fs, "encode_url"):
        from cloudshards.source.httpobj import HttpObject

        return HttpObject(fs, path, url, stall_timeout_s=stall_timeout_s)
    return FsspecObject(fs, path, url)


def object_etag(details: Mapping[str, Any]) -> Any:
    """The ETag in an object's metadata as the backend spells it (s3fs ``ETag``, HTTP
    ``etag``), quotes included; None when there is none."""
    return details.get("ETag") or details.get("etag")


def open_write(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    """Open ``url`` for writing (closing the file commits it); backend errors as raised."""
    fs, path = resolve(url, storage_options)
    return fs.open(path, "wb")


def open_output(url: str, path: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Open ``path`` on the filesystem of ``url`` for writing: the write side of the source.

    Closing the returned fsspec file commits it; :mod:`cloudshards.writers` decides the
    temporary names and the discarding that make shard writes atomic.

    Raises:
        ShardOpenError: The store refused the write (missing bucket, access denied).
        ConfigError: The URL's protocol is unknown or its backend is missing.
    """
    fs, _ = resolve(url, storage_options)
    try:
        return fs.open(path, "wb")
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, action="cannot write"), exc)
