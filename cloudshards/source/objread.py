"""obstore's answers as cloudshards reads them: its errors as the builtin errors retries and
error mapping judge, its metadata under s3fs's names, and a streaming GET as a file.

Split from :mod:`cloudshards.source.objstore`, which builds the stores and reads objects.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cloudshards.source.stream import status_error

if TYPE_CHECKING:
    from cloudshards.source.objstore import ObstoreObject

__all__ = ["ObstoreReader", "object_details", "obstore_call", "translate_error"]

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
    first read, ``size`` and ``details`` from the response)."""

    def __init__(self, source: ObstoreObject, block_bytes: int) -> None:
        self._source = source
        self._block_bytes = block_bytes
        self._position = 0
        self._chunks: Any = None
        self._buffer = memoryview(b"")
        self._details: dict[str, Any] | None = None
        self.closed = False

    def _start(self) -> None:
        import obstore

        options = {"range": {"offset": self._position}} if self._position else None
        result = obstore_call(obstore.get, self._source.store, self._source.key, options=options)
        self._details = object_details(result.meta)
        self._chunks = iter(result.stream(min_chunk_size=self._block_bytes))

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
        if self._chunks is None:
            self._start()
        if size is None or size < 0:
            pieces = [bytes(self._buffer)]
            self._buffer = memoryview(b"")
            while chunk := self._next_chunk():
                pieces.append(bytes(chunk))
            data = b"".join(pieces)
        else:
            if not self._buffer:
                chunk = self._next_chunk()
                if chunk is None:
                    return b""
                self._buffer = memoryview(chunk)
            data = bytes(self._buffer[:size])
            self._buffer = self._buffer[size:]
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
