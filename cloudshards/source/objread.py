"""obstore's answers as cloudshards reads them: its errors as the builtin errors retries and
error mapping judge, its metadata under s3fs's names, and a streaming GET as a file.

Split from :mod:`cloudshards.source.objstore`, which builds the stores and reads objects.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cloudshards.source import adapt
from cloudshards.source.stream import drop_prefix, status_error

if TYPE_CHECKING:
    from cloudshards.source.objstore import ObstoreObject

__all__ = ["ObstoreReader", "object_details", "obstore_call", "translate_error"]

#: obstore's refusal of a whole-object answer to a ranged GET (the store ignores Range).
NON_PARTIAL = "non-partial response"
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")


def translate_error(exc: BaseException) -> BaseException:
    """obstore's error as the builtin error cloudshards' retry and error mapping judge: not
    found, access denied, another client error (with ``status``), or a transient failure."""
    text, _, debug = str(exc).partition("\n\nDebug")
    status_match = _STATUS.search(text)
    status = int(status_match.group(1)) if status_match else None
    code_match = _CODE.search(text)
    code = code_match.group(1) if code_match else None
    name = type(exc).__name__
    summary = (f"{code} (HTTP {status})" if code else f"HTTP {status}") if status else text[:300]
    if "TokenUnavailable: " in text:  # gcsconfig's: the token endpoint did not answer
        return ConnectionError(f"no access token: {text.split('TokenUnavailable: ', 1)[1][:300]}")
    if status is None and ("kind: Timeout" in debug or "TimedOut" in debug):
        # Its read timeout, which cloudshards sets to stall_timeout_s: no byte came for that long.
        return TimeoutError(f"stalled: no answer within stall_timeout_s ({name}: {text[:300]})")
    if isinstance(exc, FileNotFoundError) or name == "NotFoundError" or status == 404:
        return FileNotFoundError(summary)
    if name in ("PermissionDeniedError", "UnauthenticatedError") or status in (401, 403):
        return PermissionError(summary)
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return status_error(summary, status)
    if status is not None:  # a 429 or 5xx: read by the retries (throttling), whatever the text
        return status_error(f"{name}: {text[:300]}", status, ConnectionError)
    return ConnectionError(f"{name}: {text[:300]}")


def obstore_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        raise translate_error(exc) from None


def object_details(meta: Mapping[str, Any]) -> dict[str, Any]:
    """obstore's object metadata under s3fs's ``info()`` names."""
    return {
        "size": meta.get("size"),
        "ETag": meta.get("e_tag"),
        "LastModified": meta.get("last_modified"),
        "VersionId": meta.get("version"),
        "type": "file",
    }


class ObstoreReader:
    """A file-like streaming GET of an :class:`ObstoreObject` (``read``, ``seek`` before the
    first read, ``size`` and ``details`` from the response).

    The answer's pieces are taken as they arrive and gathered here: obstore's own gathering
    (``min_chunk_size``) loses what it gathered when the answer is cut, so a read that could
    not get past a cut would have handed on nothing of the bytes before it. A failure after
    some bytes of a sized read ends that read with them, and is raised by the next one (where
    the caller's retries resume), and by every read after it. A sized read returns at most
    ``block_bytes``, as soon as it has them (followers of a download see it grow in steps
    of that). A store that ignores Range is read from the start when a read resumes, the
    bytes before the position dropped.
    """

    def __init__(self, source: ObstoreObject, block_bytes: int) -> None:
        self._source = source
        self._block_bytes = max(1, block_bytes)
        self._position = 0
        self._chunks: Any = None
        self._buffer = memoryview(b"")
        self._failure: Exception | None = None
        self._details: dict[str, Any] | None = None
        self.closed = False

    def _start(self) -> None:
        import obstore

        store, key, url = self._source.store, self._source.key, self._source.url
        # A resumed read of a store that ignores Range: the object from its start, the bytes
        # before the position dropped (the answer to a ranged GET would be refused).
        skip = self._position if adapt.host_key(url) in adapt.UNRANGED_HOSTS else 0
        options = {"range": {"offset": self._position}} if self._position and not skip else None
        try:
            result = obstore_call(obstore.get, store, key, options=options)
        except ConnectionError as exc:
            if options is None or NON_PARTIAL not in str(exc):
                raise
            adapt.mark_unranged(url)
            result, skip = obstore_call(obstore.get, store, key), self._position
        self._details = object_details(result.meta)
        self._chunks = iter(result.stream(min_chunk_size=1))
        if skip:  # read from byte 0 again
            self._position = 0
            drop_prefix(self, skip)

    @property
    def details(self) -> dict[str, Any]:
        if self._details is None:
            self._start()
        assert self._details is not None
        return self._details

    @property
    def size(self) -> int | None:
        size = self.details.get("size")
        return None if size is None else int(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        if self._chunks is not None or whence != 0:
            raise OSError("an obstore stream seeks only before its first read")
        self._position = offset
        return offset

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that are left when ``size`` < 0); b"" at the end."""
        if self._chunks is None:
            self._start()
        whole = size is None or size < 0
        want = sys.maxsize if whole else min(size, self._block_bytes)
        pieces: list[memoryview] = []
        while want > 0:
            if not self._buffer:
                if self._failure is not None:  # after the bytes that came before it
                    raise self._failure
                try:
                    chunk = self._next_chunk()
                except Exception as exc:
                    self._failure = exc
                    if not pieces or whole:  # a short "all" would be taken for the end:
                        raise  # the caller's retry reads those bytes again
                    break
                if chunk is None:
                    break
                self._buffer = memoryview(chunk)
            pieces.append(self._buffer[:want])
            self._buffer = self._buffer[want:]
            want -= len(pieces[-1])
        data = b"".join(pieces)
        self._position += len(data)
        return data

    def _next_chunk(self) -> Any:
        try:
            return next(self._chunks)
        except StopIteration:
            return None
        except Exception as exc:
            raise translate_error(exc) from None

    def close(self) -> None:
        self.closed = True
        self._chunks = None
        self._buffer = memoryview(b"")
