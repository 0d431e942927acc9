"""An object over HTTP(S), read through fsspec's aiohttp session with requests of our own.

fsspec's ``_cat_file`` hands on a body without its headers, so nothing could tell which object
answered. Here every answer's headers are checked before its body is read: a ranged answer
must start where it was asked to, and must name the ETag the shard's first answer named (a
server may ignore ``If-Match``: Python's ``http.server`` does). The first part brings the size
and ETag with it (:meth:`HttpObject.cat_first`, no HEAD beside it), so every part of a shard is
of the object its first part is of, even when the object is replaced between two requests.
Retries read streamed (:meth:`HttpObject.cat_range_salvage`), keeping what arrived before a
cut or a stall.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import fsspec.asyn

from cloudshards.source.kept import refuse_another_object
from cloudshards.source.remote import FsspecObject
from cloudshards.source.retries import PartialBodyError, RangeIgnoredError
from cloudshards.source.stream import http_status

__all__ = ["HttpObject"]

#: The bridge's own bound beyond a read's, for an answer whose headers never come.
_BACKSTOP_S = 1.0


class HttpObject(FsspecObject):
    """One object on an HTTP(S) server, through its fsspec filesystem's session."""

    #: Ranged GETs can be conditional on the ETag (``if_match=``), and are checked on it.
    conditional = True

    def __init__(self, fs: Any, path: str, url: str, *, stall_timeout_s: float | None) -> None:
        super().__init__(fs, path, url)
        self.stall_timeout_s = stall_timeout_s

    def _run(
        self,
        coroutine: Callable[..., Coroutine[Any, Any, Any]],
        *args: Any,
        timeout: float | None,
    ) -> Any:
        """``coroutine(fs, path, *args)`` on fsspec's event loop, bounded by ``timeout`` (the
        read's own bound) and a second more: an answer whose headers never come."""
        backstop = None if timeout is None else timeout + _BACKSTOP_S
        fs = self.fs
        return fsspec.asyn.sync(fs.loop, coroutine, fs, self.path, *args, timeout=backstop)

    def cat_range(
        self,
        start: int,
        end: int,
        timeout: float | None = None,
        if_match: str | None = None,
        expect_etag: str | None = None,
    ) -> bytes:
        """Bytes ``[start, end)`` in one ranged GET (the whole object, when the server ignores
        Range: the caller tells by its length); with ``if_match``, only from the object with
        that ETag (HTTP 412 otherwise, whether or not the server honours ``If-Match``);
        ``expect_etag``: the same, without sending ``If-Match``."""
        headers = _range(start, end, if_match)
        data: bytes = self._run(_get, headers, if_match or expect_etag, None, timeout=timeout)
        return data

    def cat_first(
        self, end: int, on_details: Callable[[dict[str, Any]], None]
    ) -> tuple[bytes, dict[str, Any]]:
        """Bytes ``[0, end)`` (all of a shorter object) and the object's size and ETag from
        the same answer's headers, handed to ``on_details`` (also when the body is then cut,
        so that the retry asks for the rest of that object)."""
        seen: list[dict[str, Any]] = []
        try:
            data: bytes = self._run(
                _get, _range(0, end), None, seen.append, timeout=self.stall_timeout_s
            )
        except Exception as exc:
            if seen:
                on_details(seen[0])
                raise
            if http_status(exc) != 416:
                raise
            details = self.info(timeout=self.stall_timeout_s)  # an empty object has no byte 0
            if details.get("size") != 0:
                raise
            on_details(details)
            return b"", details
        on_details(seen[0])
        return data, seen[0]

    def cat_range_salvage(
        self,
        start: int,
        end: int,
        timeout: float | None = None,
        if_match: str | None = None,
        expect_etag: str | None = None,
    ) -> bytes:
        """:meth:`cat_range`, streamed: an answer cut mid-body, or stalled past ``timeout``,
        raises :class:`~cloudshards.source.retries.PartialBodyError` with the bytes that
        arrived. With ``expect_etag``, an answer with another ETag is refused before its body,
        as a 412.

        Raises:
            RangeIgnoredError: The server answered with the whole object.
        """
        headers = _range(start, end, if_match)
        data: bytes = self._run(_salvage, headers, expect_etag, timeout, timeout=timeout)
        return data


def _range(start: int, end: int, if_match: str | None = None) -> dict[str, str]:
    """The headers asking for bytes ``[start, end)``, only of ``if_match``'s object if given."""
    headers = {"Range": f"bytes={start}-{end - 1}"}
    if if_match:
        headers["If-Match"] = if_match
    return headers


def _prepared(fs: Any, headers: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """The headers and options of a request, as fsspec's HTTPFileSystem._cat_file sends it."""
    kw = fs.kwargs.copy()
    return {**kw.pop("headers", {}), **headers}, kw


def _checked(
    response: Any, headers: dict[str, str], expect_etag: str | None, *, missing_ok: bool = False
) -> str | None:
    """The answer's ETag, once its headers are found to be of the range and object asked for
    (``missing_ok``: see :func:`~cloudshards.source.kept.refuse_another_object`).

    Raises:
        ConnectionError: A ranged answer (206) that starts at another byte.
        OSError: The answer names another object than ``expect_etag`` (HTTP status 412).
    """
    if response.status == 206:
        start = headers["Range"][len("bytes=") :].split("-", 1)[0]
        if not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
            raise ConnectionError(f"a 206 answer for {headers['Range']} from another byte")
    etag: str | None = response.headers.get("ETag")
    refuse_another_object(etag, expect_etag, missing_ok=missing_ok)
    return etag


def _size(response: Any) -> int | None:
    """The object's size an answer gives: a 206's Content-Range total, a 200's length."""
    if response.status == 206:
        total = response.headers.get("Content-Range", "").rsplit("/", 1)[-1]
        return int(total) if total.isdigit() else None
    length: int | None = response.content_length
    return length


async def _get(
    fs: Any,
    url: str,
    headers: dict[str, str],
    expect_etag: str | None,
    on_details: Callable[[dict[str, Any]], None] | None,
) -> bytes:
    # No bound of its own: the bridge (HttpObject._run) bounds the whole request.
    headers, kw = _prepared(fs, headers)
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kw) as response:
        fs._raise_not_found_for_status(response, url)
        etag = _checked(response, headers, expect_etag, missing_ok=True)
        details = {"name": url, "size": _size(response), "type": "file", "ETag": etag}
        if response.status == 206:
            if on_details is not None:  # fsspec's HTTP info() names, before the body: a
                on_details(details)  # retry asks for the rest of this object
            data: bytes = await response.read()
            return data
        # The whole object (Range ignored): no part after it asks again. Its size is its body's
        # length (gzip, chunked: no Content-Length), or unknown when it is too large to hold.
        whole = await _whole_body(response)
        if on_details is not None:
            size = None if whole is None else len(whole)
            on_details({**details, "size": size, "range_ignored": True})
        if whole is None:
            raise RangeIgnoredError(b"")  # the reader streams the object instead
        return whole


#: A whole-object answer to a ranged GET is held in memory up to this size; a larger one (or
#: an endless one) is left, and the object streamed with one GET.
WHOLE_BODY_MAX = 64 << 20


async def _whole_body(response: Any) -> bytes | None:
    """A whole-object answer's body, or None past :data:`WHOLE_BODY_MAX` bytes."""
    if (response.content_length or 0) > WHOLE_BODY_MAX:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 20):
        body += chunk
        if len(body) > WHOLE_BODY_MAX:
            return None
    return bytes(body)


async def _salvage(
    fs: Any, url: str, headers: dict[str, str], expect_etag: str | None, timeout: float | None
) -> bytes:
    # The body in chunks, each kept as it arrives: fsspec has no ranged read that keeps what
    # arrived before a cut or a stall. The read ends itself at ``timeout``.
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    headers, kw = _prepared(fs, headers)
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kw) as response:
        fs._raise_not_found_for_status(response, url)
        etag = _checked(response, headers, expect_etag)  # a 200 of another object too
        if response.status != 206:  # the whole object (Range ignored): never joined onto kept
            raise RangeIgnoredError(await _whole_body(response) or b"")
        size = _size(response)
        received = bytearray()
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    chunk = await asyncio.wait_for(response.content.read(1 << 20), left)
                except TimeoutError:
                    raise TimeoutError(f"stalled: the answer took over {timeout:g} s") from None
                if not chunk:
                    break
                received += chunk
        except Exception as exc:
            raise PartialBodyError(bytes(received), exc, etag, size) from None
    return bytes(received)
