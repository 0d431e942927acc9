"""The bytes of one ranged GET kept from answers cut mid-body, for :mod:`.transport`.

A part's first try reads its answer whole (the fast path: obstore's buffer handed on without a
copy); its retries read streamed, through the transport's ``cat_range_salvage``, so that an
answer cut mid-body keeps what arrived and the next try asks for the rest only. When the range
fails for good, the bytes before the failure go to the reader with the error (nothing before
a failure is lost).

Bytes are joined only when they are sure to be one object's: every piece comes from a ranged
answer (206) that starts where the last one stopped, and every answer after the first piece
must name the object that piece's answer named (its strong ETag, or on GCS the pinned
generation), checked on the answer's headers before its body is read: a store that ignores
``If-Match`` cannot slip another version in. An answer without a strong ETag keeps nothing,
and an answer naming another object (the object changed, replicas with other ETags, a proxy
that rewrites ETags) makes the range start over, read whole as before, in the same try.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from cloudshards.errors import ShardOpenError
from cloudshards.source.options import FetchOptions
from cloudshards.source.retries import IOStats, PartialBodyError, retry
from cloudshards.source.stream import http_status, status_error

__all__ = ["KeptRange", "refuse_another_object"]

T = TypeVar("T")


def refuse_another_object(
    etag: str | None, expect_etag: str | None, *, missing_ok: bool = False
) -> None:
    """Refuse, as a 412, an answer (its headers) naming another object than ``expect_etag``:
    what a transport's reads check, before any body. ``missing_ok``: an answer naming no
    object at all (no ETag) passes (a whole part read; never bytes joined onto kept ones).

    Raises:
        OSError: ``etag`` is not ``expect_etag`` (HTTP status 412).
    """
    if etag is None and missing_ok:
        return
    if expect_etag is not None and etag != expect_etag:  # a store ignoring If-Match, too
        raise status_error(f"another object answered ({etag}, not {expect_etag})", 412)


class KeptRange:
    """Bytes ``[start, end)`` of one object, as far as they arrived, and where the next try
    starts (``at``).

    Attributes:
        at: The first byte not yet kept.
        salvage: The transport's streamed ranged read, None where it has none (s3fs, gcsfs)
            or once the range started over.
    """

    __slots__ = ("_etag", "_pieces", "_stats", "at", "end", "salvage", "start", "url")

    def __init__(self, source: Any, start: int, end: int, stats: IOStats) -> None:
        self.url: str = source.url
        self.salvage = getattr(source, "cat_range_salvage", None)
        self.start = self.at = start
        self.end = end
        self._stats = stats
        self._pieces: list[bytes] = []
        self._etag: str | None = None

    def hold_to(self, etag: Any) -> None:
        """Take answers of the object with this ETag only (the object the caller already
        read from), when it is a strong one."""
        if _strong(etag):
            self._etag = etag

    def fetch(self, condition: dict[str, str], timeout: float) -> bytes | None:
        """One streamed try for the rest (``b""`` once all of it has arrived), under the
        caller's ``condition`` (``if_match``); None when the range starts over (an answer
        named another object): the caller then reads it whole.

        Raises:
            ConnectionError: The answer was cut (what arrived is kept).
            RangeIgnoredError: The store answered with the whole object.
        """
        assert self.salvage is not None
        if self.at >= self.end:
            return b""
        given = dict(condition)  # the shard's ETag (sent as If-Match, or not) names it too
        shard_etag = given.pop("expect_etag", None) or given.get("if_match")
        expect = self._etag or shard_etag
        try:
            data: bytes = self.salvage(self.at, self.end, timeout, expect_etag=expect, **given)
            return data
        except PartialBodyError as cut:
            self._keep(cut)
            if self.at >= self.end:
                return b""  # all of it arrived before the answer broke off
            raise cut.cause from None
        except Exception as exc:
            if http_status(exc) != 412 or (self._etag is None and not self._pieces):
                raise  # the caller's own condition, before anything was kept: theirs to judge
            self._start_over()
            return None

    def _keep(self, cut: PartialBodyError) -> None:
        self._stats.add(bytes=len(cut.received))
        if cut.size is not None:
            self.end = min(self.end, cut.size)  # a range past the object's end
        if not _strong(cut.etag) or (self._etag is not None and cut.etag != self._etag):
            return  # nothing names the object these bytes are of: keep none of them
        self._etag = cut.etag
        self._pieces.append(cut.received)
        self.at += len(cut.received)

    def _start_over(self) -> None:
        self._pieces.clear()
        self.at, self._etag, self.salvage = self.start, None, None

    def joined(self, data: bytes | memoryview) -> bytes | memoryview:
        """The kept bytes, then ``data`` (the rest, from ``at``)."""
        return b"".join((*self._pieces, data)) if self._pieces else data

    def retried(
        self, call: Callable[[], T], options: FetchOptions, cancel: threading.Event | None
    ) -> T:
        """``call`` (one try at the range) under :func:`retry`, which names the byte the
        range failed at; when it fails for good, its error carries the bytes before that
        byte, for the reader to read before it raises."""
        try:
            return retry(
                call, url=self.url, offset=lambda: self.at, options=options, stats=self._stats,
                cancel=cancel,
            )  # fmt: skip
        except ShardOpenError as error:
            if self._pieces:
                error.received = b"".join(self._pieces)
            raise


def _strong(etag: Any) -> bool:
    return isinstance(etag, str) and bool(etag) and not etag.startswith("W/")
