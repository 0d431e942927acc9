"""The fsspec transport: the only module that asks an fsspec filesystem for a shard's bytes
or metadata (``open``, ``cat_file``, ``_cat_file``, ``info``, ``size``).

A different transport (another client library for S3, say) plugs in here: everything above
it (streams, ranged parts, retries, the prefetcher, the cache) reads through these functions.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import IO, Any

import fsspec.asyn

from cloudshards.redact import raise_redacted
from cloudshards.source.options import FetchOptions, OpenOptions
from cloudshards.source.retries import IOStats, RangeIgnoredError, retry
from cloudshards.source.stream import map_backend_error
from cloudshards.urls import protocol_of, resolve

__all__ = [
    "fetch_range",
    "info",
    "object_etag",
    "object_info",
    "object_size",
    "open_output",
    "open_stream",
    "open_write",
    "read_object",
    "read_range",
]


def open_stream(url: str, options: OpenOptions, shard_index: int | None) -> IO[bytes]:
    """One streaming read of a store object (a single GET where the backend allows).

    Raises:
        ShardOpenError: The object is missing, access is denied, or the store failed.
        ConfigError: The URL's protocol is unknown or its backend is missing.
    """
    protocol = protocol_of(url)
    fs, path = resolve(url, options.storage_options)
    try:
        if protocol in ("http", "https"):
            # block_size=0 gives one streaming GET instead of many small ranged ones.
            return fs.open(path, "rb", block_size=0)  # type: ignore[no-any-return]
        return fs.open(  # type: ignore[no-any-return]
            path, "rb", block_size=options.block_bytes, cache_type="none"
        )
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, shard_index=shard_index), exc)


def object_size(url: str, options: OpenOptions) -> int | None:
    """The object's size in bytes (None when the store does not say).

    Raises:
        ShardOpenError: The object is missing or cannot be reached.
    """
    fs, path = resolve(url, options.storage_options)
    try:
        size = fs.size(path)
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, action="cannot stat"), exc)
    return None if size is None else int(size)


def info(fs: Any, path: str) -> dict[str, Any]:
    """One metadata request (size, ETag, ...) to ``fs`` for ``path``; backend errors as raised."""
    details: dict[str, Any] = fs.info(path)
    return details


def object_etag(details: Mapping[str, Any]) -> Any:
    """The ETag in an object's metadata as the backend spells it (s3fs ``ETag``, HTTP
    ``etag``), quotes included; None when there is none."""
    return details.get("ETag") or details.get("etag")


def object_info(url: str, options: OpenOptions) -> dict[str, Any]:
    """One metadata request for ``url`` (no retry); backend errors as raised."""
    fs, path = resolve(url, options.storage_options)
    return info(fs, path)


def read_object(url: str, storage_options: Mapping[str, Any] | None) -> bytes:
    """The whole (small) object at ``url`` in one request; backend errors as raised."""
    fs, path = resolve(url, storage_options)
    data: bytes = fs.cat_file(path)
    return data


def fetch_range(
    fs: Any,
    path: str,
    start: int,
    end: int,
    *,
    url: str,
    size: int | None,
    options: FetchOptions,
    stats: IOStats,
    cancel: threading.Event | None = None,
) -> bytes:
    """Fetch bytes ``[start, end)`` of an object of ``size`` bytes, verified and retried.

    On async backends (s3fs, gcsfs, HTTP) each attempt is bounded by ``stall_timeout_s``, so a
    connection that stops delivering is abandoned (and retried) instead of hanging.

    Raises:
        RangeIgnoredError: The server sent the whole object instead of the range.
        ShardOpenError: The range could not be fetched (after retries), or came back short.
    """
    expected = end - start

    def call() -> bytes:
        stats.add(requests=1)
        data: bytes
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            data = fsspec.asyn.sync(
                fs.loop, fs._cat_file, path, start=start, end=end, timeout=options.stall_timeout_s
            )
        else:
            data = fs.cat_file(path, start=start, end=end)
        stats.add(bytes=len(data))
        if len(data) == expected:
            return data
        if size is None and len(data) < expected:
            return data  # the object ends inside the range; the caller checks its size
        if (size is None and len(data) > expected) or (len(data) == size and size > expected):
            raise RangeIgnoredError(data)
        # A short or long body that is not the whole object: a cut connection or a broken
        # server. Never hand it on; retrying asks again for exactly this range.
        raise ConnectionError(f"ranged GET returned {len(data)} bytes, expected {expected}")

    return retry(call, url=url, offset=start, options=options, stats=stats, cancel=cancel)


def open_write(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    """Open ``url`` for writing (closing the file commits it); backend errors as raised."""
    fs, path = resolve(url, storage_options)
    return fs.open(path, "wb")


def read_range(
    url: str,
    options: OpenOptions,
    start: int,
    end: int,
    *,
    fetch: FetchOptions,
    stats: IOStats,
    size: int | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of the object at ``url``: :func:`fetch_range` by URL."""
    fs, path = resolve(url, options.storage_options)
    return fetch_range(fs, path, start, end, url=url, size=size, options=fetch, stats=stats)


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
