"""Which transport reads a store object, and the reads everything above builds on.

:func:`object_at` gives a :class:`StoreObject`: read through obstore
(:mod:`cloudshards.source.objstore`) for ``s3://`` and ``gs://`` where it can, through fsspec
(:mod:`cloudshards.source.remote`) otherwise. Ranged parts, resumable streams, the cache's
metadata and index reads all go through the functions here; nothing above them knows which
transport carried the bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any, Protocol

from cloudshards.redact import raise_redacted, redact_url
from cloudshards.source import adapt
from cloudshards.source.budget import node_budget
from cloudshards.source.kept import KeptRange
from cloudshards.source.objstore import store_object
from cloudshards.source.options import FetchOptions, OpenOptions
from cloudshards.source.remote import fsspec_object, object_etag
from cloudshards.source.retries import IOStats, RangeIgnoredError
from cloudshards.source.stream import http_status, map_backend_error

__all__ = [
    "StoreObject",
    "fetch_first",
    "fetch_range",
    "object_at",
    "object_info",
    "object_size",
    "open_stream",
    "read_object",
    "read_range",
]

#: The stall timeout of reads that are not given fetch options (metadata, small objects).
_DEFAULT_STALL_S = FetchOptions().stall_timeout_s


class StoreObject(Protocol):
    """One object in a store, as a transport reads it; backend errors as raised."""

    url: str

    def info(self, timeout: float | None = None) -> dict[str, Any]: ...

    def cat_range(self, start: int, end: int, timeout: float | None = None) -> bytes: ...

    # Transports that can make a ranged GET conditional on the object's ETag (``If-Match``)
    # also have ``conditional = True`` and take ``if_match=`` (sent, and checked on the
    # answer) or ``expect_etag=`` (checked only) in cat_range(_view).

    def cat(self) -> bytes: ...

    def open(self, block_bytes: int) -> IO[bytes]: ...


def object_at(
    url: str, options: OpenOptions, *, stall_timeout_s: float = _DEFAULT_STALL_S
) -> StoreObject:
    """The object at ``url``, with the transport that reads it (no request is made).

    Raises:
        ConfigError: The URL's protocol is unknown, its backend is missing, or
            ``CLOUDSHARDS_TRANSPORT=obstore`` cannot be honoured.
    """
    fast = store_object(url, options, stall_timeout_s=stall_timeout_s)
    if fast is not None:
        return fast
    return fsspec_object(url, options.storage_options, stall_timeout_s)


def open_stream(url: str, options: OpenOptions, shard_index: int | None) -> IO[bytes]:
    """One streaming read of a store object (a single GET where the backend allows).

    Raises:
        ShardOpenError: The object is missing, access is denied, or the store failed.
        ConfigError: The URL's protocol is unknown or its backend is missing.
    """
    source = object_at(url, options)
    try:
        return source.open(options.block_bytes)
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, shard_index=shard_index), exc)


def object_size(url: str, options: OpenOptions) -> int | None:
    """The object's size in bytes (None when the store does not say).

    Raises:
        ShardOpenError: The object is missing or cannot be reached.
    """
    source = fsspec_object(url, options.storage_options)
    try:
        size = source.info().get("size")
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, action="cannot stat"), exc)
    return None if size is None else int(size)


def object_info(url: str, options: OpenOptions) -> dict[str, Any]:
    """One metadata request for ``url`` (no retry); backend errors as raised.

    Through fsspec: metadata is small, and a main process that only looks up sizes and reads
    indexes stays free of obstore's runtime, which its forked workers could not use.
    """
    return fsspec_object(url, options.storage_options).info()


def read_object(url: str, storage_options: Mapping[str, Any] | None) -> bytes:
    """The whole (small) object at ``url`` in one request (an index; through fsspec, as
    :func:`object_info`); backend errors as raised."""
    return fsspec_object(url, storage_options).cat()


def _answered(source: StoreObject, stats: IOStats, nbytes: int, ticket: adapt.Ticket) -> None:
    """One GET answered: its bytes in the counters, its duration in the link's estimate."""
    adapt.record(source.url, nbytes, ticket.done(), ticket.crowd)
    stats.add(bytes=nbytes)


logger = logging.getLogger("cloudshards.fetch")


class IfMatch:
    """The ETag one shard's later parts ask for (``If-Match``) and whose answers must name it,
    shared by its parts; ``send`` is cleared when the store refuses the ETag it still reports
    (see :func:`fetch_range`): the parts then only check their answers' ETags."""

    __slots__ = ("etag", "send")

    def __init__(self, etag: str | None) -> None:
        self.etag = etag
        self.send = True


def _unchanged(source: StoreObject, etag: str | None) -> bool:
    """Whether the object's ETag, asked again, is still ``etag`` (False if the lookup fails)."""
    try:
        return bool(object_etag(source.info()) == etag)
    except Exception:
        return False


def _conditioned(
    get: Callable[[], bytes | memoryview],
    source: StoreObject,
    condition: dict[str, str],
    if_match: IfMatch | None,
    etag: str | None,
) -> bytes | memoryview:
    """``get()``, once more without ``condition`` when the store refuses the ETag it still
    reports (a proxy or CDN that rewrites ETags): the object has not changed, and the shard's
    later parts go unconditioned too."""
    try:
        return get()
    except Exception as exc:
        gone = getattr(exc, "generation_gone", False)  # pinned (GCS): it changed
        if gone or not (condition.get("if_match") and http_status(exc) == 412):
            raise
        if not _unchanged(source, etag):
            raise  # a 412 for an object whose ETag is no longer the first part's
    logger.info(
        "%s refuses If-Match with the ETag it reports; reading it without (each answer's ETag "
        "is still checked)",
        redact_url(source.url),
    )
    if if_match is not None:
        if_match.send = False
    condition["expect_etag"] = condition.pop("if_match")
    return get()


def fetch_range(
    source: StoreObject,
    start: int,
    end: int,
    *,
    size: int | None,
    options: FetchOptions,
    stats: IOStats,
    cancel: threading.Event | None = None,
    view: bool = False,
    if_match: IfMatch | None = None,
) -> bytes | memoryview:
    """Fetch bytes ``[start, end)`` of an object of ``size`` bytes, verified and retried;
    with ``view``, as a read-only memoryview where the transport has one (no copy).

    With ``if_match`` (the object's ETag, from its first part) and a transport that can, the
    GET is conditional on it: parts of an object replaced while it is read are never stitched
    together; the store answers 412 and the read fails, naming the change. A store that
    refuses the ETag it still reports (a proxy or CDN that rewrites ETags) gets the part again
    without the condition, as do the shard's later parts.

    Each attempt is bounded by ``stall_timeout_s``, so a connection that stops delivering is
    abandoned (and retried) instead of hanging.

    Raises:
        RangeIgnoredError: The server sent the whole object instead of the range.
        ShardOpenError: The range could not be fetched (after retries), or came back short.
    """
    fetch = getattr(source, "cat_range_view", None) if view else None
    etag = if_match.etag if if_match is not None else None
    # Sent as If-Match, and checked on the answer's headers; or only checked (see IfMatch).
    key = "if_match" if if_match is None or if_match.send else "expect_etag"
    condition = {key: etag} if etag and getattr(source, "conditional", False) else {}
    kept = KeptRange(source, start, end, stats)
    attempts = 0

    def get() -> bytes | memoryview:
        if attempts > 1 and kept.salvage is not None:
            rest = kept.fetch(condition, options.stall_timeout_s)  # a retry: see .kept
            if rest is not None:
                return rest
        if fetch is not None:
            return fetch(start, end, **condition)  # type: ignore[no-any-return]
        return source.cat_range(start, end, timeout=options.stall_timeout_s, **condition)

    def call() -> bytes | memoryview:
        nonlocal attempts
        attempts += 1
        with node_budget().slot():  # one of the node's requests in flight
            stats.add(requests=1)
            ticket = adapt.started(source.url, end - kept.at)
            data: bytes | memoryview
            try:
                data = _conditioned(get, source, condition, if_match, etag)
            except RangeIgnoredError as whole:  # a streamed retry's whole-object answer
                stats.add(bytes=len(whole.body))
                raise
            finally:
                ticket.done()
        _answered(source, stats, len(data), ticket)
        expected = end - kept.at  # what this answer should carry (after what was kept)
        if len(data) == expected or (size is None and len(data) < expected):
            # All of it, or the object ends inside the range (the caller checks its size).
            return kept.joined(data)
        if (size is None and len(data) > expected) or (len(data) == size and size > expected):
            raise RangeIgnoredError(bytes(data))
        # A short or long body that is not the whole object: a cut connection or a broken
        # server. Never hand it on; retrying asks again for exactly this range.
        raise ConnectionError(f"ranged GET returned {len(data)} bytes, expected {expected}")

    return kept.retried(call, options, cancel)


def fetch_first(
    source: StoreObject,
    end: int,
    on_details: Callable[[dict[str, Any]], None],
    *,
    options: FetchOptions,
    stats: IOStats,
    cancel: threading.Event | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """Bytes ``[0, end)`` of an object and its metadata, from one GET (a source with
    ``cat_first``: the metadata comes with the ranged answer, no HEAD), retried. The
    metadata goes to ``on_details`` as soon as the answer's headers are in (again on a retry).

    The bytes are the whole object when it is shorter than ``end``, or when the server
    ignored the range (then longer than ``end``: the caller streams from them).

    Raises:
        ShardOpenError: The object is missing, or the GET failed after retries.
    """
    cat_first = getattr(source, "cat_first")  # noqa: B009 - a member of some transports only
    seen: list[dict[str, Any]] = []  # the metadata of the first answer that brought it
    kept = KeptRange(source, 0, end, stats)

    def noted(details: dict[str, Any]) -> None:
        if not seen:
            seen.append(details)
            if details.get("size") is not None:
                kept.end = min(end, int(details["size"]))
                kept.hold_to(object_etag(details))  # retries: the rest of this object only
        on_details(details)

    def get() -> tuple[bytes | memoryview, dict[str, Any]]:
        if not seen or seen[0].get("size") is None or kept.salvage is None:
            return cat_first(end, noted)  # type: ignore[no-any-return]
        # A retry once the size is known: see .kept (GCS pins its generation).
        try:
            rest = kept.fetch({}, options.stall_timeout_s)
        except RangeIgnoredError as whole:
            return whole.body, seen[0]  # the whole object: the caller streams from it
        return (rest, seen[0]) if rest is not None else cat_first(end, noted)

    def call() -> tuple[bytes, dict[str, Any]]:
        with node_budget().slot():
            stats.add(requests=1)
            ticket = adapt.started(source.url, end - kept.at)
            try:
                data, details = get()
            finally:
                ticket.done()
        _answered(source, stats, len(data), ticket)
        size = details.get("size")
        if size is None or len(data) == int(size):
            return bytes(data), details  # unknown size, or the whole object (Range ignored)
        expected = kept.end - kept.at  # the range's end is min(end, size) once size is known
        if len(data) == expected:
            return bytes(kept.joined(data)), details
        # A cut connection or a broken server: never hand it on; ask again.
        raise ConnectionError(f"ranged GET returned {len(data)} bytes, expected {expected}")

    return kept.retried(call, options, cancel)


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
    source = object_at(url, options, stall_timeout_s=fetch.stall_timeout_s)
    return bytes(fetch_range(source, start, end, size=size, options=fetch, stats=stats))
