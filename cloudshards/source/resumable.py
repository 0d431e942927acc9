"""One streaming GET that resumes after transient failures, for whole-shard sequential reads
(the cache's downloads and rechecks, balancing counts, index building, hosts that ignore Range)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from cloudshards.source.options import FetchOptions, OpenOptions
from cloudshards.source.plain import open_shard
from cloudshards.source.remote import object_etag
from cloudshards.source.retries import IOStats, is_retryable, process_stats, retry
from cloudshards.source.stream import ShardStream, drop_prefix, status_error
from cloudshards.types import ClosingStream

__all__ = ["ResumableStream", "open_remote"]


def open_remote(
    url: str,
    options: OpenOptions,
    *,
    fetch: FetchOptions | None = None,
    stats: IOStats | None = None,
    shard_index: int | None = None,
    start: int = 0,
) -> ResumableStream:
    """Open a remote shard as one streaming GET that resumes after transient failures,
    positioned at byte ``start``."""
    return ResumableStream(
        url,
        lambda: open_shard(url, options, shard_index=shard_index),
        options=fetch or FetchOptions.from_env(),
        stats=stats if stats is not None else process_stats(),
        shard_index=shard_index,
        start=start,
    )


class ResumableStream(ClosingStream):
    """One streaming GET that survives resets: a failed read reopens the object and continues
    at the current offset (seeking where the backend can, else re-reading and dropping the
    prefix, which also works with servers that ignore Range), with bounded retries.
    """

    def __init__(
        self,
        url: str,
        open_raw: Callable[[], ShardStream],
        *,
        options: FetchOptions,
        stats: IOStats,
        shard_index: int | None = None,
        start: int = 0,
    ) -> None:
        self.url = url
        self.shard_index = shard_index
        self._open_raw = open_raw
        self._options = options
        self._stats = stats
        self.offset = start
        self.closed = False
        self.size: int | None = None
        self.details: dict[str, Any] | None = None
        # The first request is retried like every later one (a 503 on it is as transient).
        self._stream = retry(
            lambda: self._open_at(start), url=url, offset=start, options=options, stats=stats
        )

    def read(self, size: int = -1) -> bytes:
        """Read up to ``size`` bytes, resuming after transient failures."""

        def attempt() -> bytes:
            try:
                return self._stream.read(size)
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                self._reopen()
                raise

        data = retry(
            attempt, url=self.url, offset=self.offset, options=self._options, stats=self._stats
        )
        self.offset += len(data)
        self._stats.add(bytes=len(data))
        return data

    def _reopen(self) -> None:
        # Called after a failure; the next attempt reads from a fresh stream at our offset.
        with contextlib.suppress(Exception):
            self._stream.close()
        self._stream = self._open_at(self.offset)

    def _open_at(self, offset: int) -> ShardStream:
        self._stats.add(requests=1)
        stream = self._open_raw()
        try:
            if offset and not _seek(stream, offset):
                drop_prefix(stream, offset)
            # The response's size and metadata (an obstore stream sends its GET for them);
            # those of the first response are kept.
            size, details = stream.response_facts()
            if self.size is None and self.details is None:
                self.size, self.details = size, details
            elif _another_version(self.details, details):
                # Resuming would stitch the new object's rest onto the old one's start.
                raise status_error("the object changed while it was read (HTTP 412)", 412)
        except BaseException:
            with contextlib.suppress(Exception):
                stream.close()
            raise
        return stream

    def close(self) -> None:
        """Close the underlying stream."""
        if not self.closed:
            self.closed = True
            self._stream.close()


def _seek(stream: ShardStream, offset: int) -> bool:
    """Position a freshly opened stream at ``offset`` if its file can seek; False otherwise.

    fsspec's streaming HTTP file says it is seekable but refuses any real seek: try, and let
    the caller re-read the prefix instead.
    """
    raw = getattr(stream, "_raw", None)
    seek = getattr(raw, "seek", None)
    if not callable(seek):
        return False
    try:
        seek(offset)
    except (ValueError, OSError):
        return False
    return True


def _another_version(details: Any, now_details: Any) -> bool:
    """Whether a resumed response describes another version of the object than the first
    did: another ETag or generation, where both say."""
    if not isinstance(details, dict) or not isinstance(now_details, dict):
        return False
    pairs = zip(_version(details), _version(now_details), strict=True)
    return any(first is not None and then is not None and first != then for first, then in pairs)


def _version(details: dict[str, Any]) -> tuple[Any, Any]:
    """The ETag (:func:`object_etag`) and generation (obstore's ``VersionId``, gcsfs's
    ``generation``) an answer names, None where it does not."""
    return object_etag(details), details.get("VersionId") or details.get("generation")
