"""What an open shard is (:class:`ShardSource`), the stream over a file or a store object that
most sources are, and the mapping of backend errors.

Every backend failure (missing object, denied access, network errors, a failing ``pipe:``
command) becomes :class:`~cloudshards.errors.ShardOpenError` naming the redacted URL and offset.
"""

from __future__ import annotations

import re
from typing import IO, TYPE_CHECKING, Any, Protocol

from cloudshards.errors import CloudShardsError, ShardNotFoundError, ShardOpenError
from cloudshards.redact import raise_redacted, redact_text

if TYPE_CHECKING:
    from cloudshards.cache.membertable import MemberTable

__all__ = [
    "EntrySource",
    "ShardSource",
    "ShardStream",
    "discard",
    "drop_prefix",
    "map_backend_error",
    "status_error",
    "without_paths",
]


class ShardSource(Protocol):
    """An open shard: sequential reads from its start, the byte offset reached, and close.

    Every opener returns one (:class:`~cloudshards.source.stream.ShardStream`,
    :class:`~cloudshards.source.parts.PartStream`,
    :class:`~cloudshards.source.resumable.ResumableStream`, the cache's streams); closing
    twice is safe. Backend failures surface as :class:`~cloudshards.errors.ShardOpenError`.
    """

    url: str
    offset: int

    def read(self, size: int = -1) -> bytes: ...

    def close(self) -> None: ...


class EntrySource(ShardSource, Protocol):
    """A source over a whole local file (a complete cache entry): its descriptor, for
    ``mmap``/``pread``, and its saved member table, for reading members by offset."""

    def fileno(self) -> int: ...

    def member_table(self) -> MemberTable | None: ...

    def save_member_table(self, table: MemberTable) -> None: ...

    def count_bytes(self, nbytes: int) -> None: ...


class ShardStream:
    """A read-only byte stream over one shard that tracks its offset and maps errors.

    Every exception from the backend becomes a :class:`ShardOpenError` carrying the redacted
    URL and the byte offset reached, so callers never see a raw botocore/aiohttp error.
    """

    def __init__(self, raw: IO[bytes], url: str, *, shard_index: int | None = None) -> None:
        self._raw = raw
        self.url = url
        self.shard_index = shard_index
        self.offset = 0
        self.closed = False
        self._readinto = getattr(raw, "readinto", None)

    def read(self, size: int = -1) -> bytes:
        """Read up to ``size`` bytes (all remaining when negative); ``b""`` at the end."""
        try:
            data = self._raw.read(size)
        except CloudShardsError:
            raise
        except Exception as exc:
            raise_redacted(self._error(exc), exc)
        self.offset += len(data)
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:
        """Read into ``buffer``; returns the number of bytes read (0 at the end)."""
        if self._readinto is None:
            data = self.read(len(buffer))
            buffer[: len(data)] = data
            return len(data)
        try:
            count: int = self._readinto(buffer) or 0
        except CloudShardsError:
            raise
        except Exception as exc:
            raise_redacted(self._error(exc), exc)
        self.offset += count
        return count

    def response_facts(self) -> tuple[int | None, dict[str, Any] | None]:
        """The object's size and metadata as the open stream knows them (None where it does
        not). A stream that sends its request lazily (obstore's) sends it now; its failure is
        mapped like a read's."""
        try:
            size = getattr(self._raw, "size", None)
            details = getattr(self._raw, "details", None)
        except CloudShardsError:
            raise
        except Exception as exc:
            raise_redacted(self._error(exc), exc)
        return (None if size is None else int(size)), details

    def _error(self, exc: BaseException) -> CloudShardsError:
        return map_backend_error(
            exc, self.url, action="read failed", shard_index=self.shard_index, offset=self.offset
        )

    def close(self) -> None:
        """Close the underlying stream; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            self._raw.close()
        except Exception as exc:
            # A close failure (e.g. a pipe command's exit status) after a full read is an error.
            raise_redacted(self._error(exc), exc)

    def __enter__(self) -> ShardStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {redact_text(text)}"


#: Backend error names and codes that mean "your credentials are missing, wrong or expired".
_AUTH_MARKERS = (
    "NoCredentials",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "AccessDenied",
    "InvalidToken",
    "Unauthorized",
    "RefreshError",
    "DefaultCredentialsError",
    "The provided token",  # S3's InvalidToken/ExpiredToken as s3fs raises them (no code)
)
#: An HTTP 401 or 403 in a backend's message, outside the URLs and paths it quotes (a shard
#: named ``train-000403.tar``, a signed URL dated 2024-01-01, would match as substrings).
_AUTH_STATUS = re.compile(r"(?<![\w.-])40[13](?![\w-]|\.\w)")
#: A path or URL in an error's text (not an "HTTP/1.1" before a status).
_PATH_IN_TEXT = re.compile(r"(?<!\S)(?!HTTP/\d)\S*/\S*")


def without_paths(text: str) -> str:
    """``text`` with its paths and URLs taken out, so that a number in a key or a bucket
    (``.../http_503.tar``) is not read as a status."""
    return _PATH_IN_TEXT.sub(" ", text)


def _names_denial(exc: BaseException) -> bool:
    """Whether ``exc``'s type, status or message says the credentials were refused."""
    text = f"{type(exc).__name__} {exc}"
    if any(marker in text for marker in _AUTH_MARKERS):
        return True
    status = http_status(exc)
    if isinstance(status, int):
        return status in (401, 403)
    return _AUTH_STATUS.search(without_paths(text)) is not None


def map_backend_error(
    exc: BaseException,
    url: str,
    *,
    action: str = "cannot open",
    shard_index: int | None = None,
    offset: int | None = None,
) -> CloudShardsError:
    """Translate any backend exception into a cloudshards error naming the (redacted) URL."""
    if isinstance(exc, CloudShardsError):
        return exc
    denied = http_status(exc.__cause__) in (401, 403)
    hidden = hidden_failure(exc)
    if hidden is not None:  # a server error or a lost connection, not a missing object
        return ShardOpenError(
            f"{action}: {_describe(hidden)}", url=url, shard_index=shard_index, offset=offset
        )
    if isinstance(exc, FileNotFoundError) and not denied:
        # fsspec's HTTP info() turns every failure into FileNotFoundError: a 401 or 403 under
        # it is a credentials problem, not a missing object.
        return ShardNotFoundError(
            "object not found", url=url, shard_index=shard_index, offset=offset
        )
    if isinstance(exc, IsADirectoryError):
        reason = "is a directory, not a shard"
    elif http_status(exc) == 412:
        # A later part's If-Match or generation, or a resumed stream's ETag, is not the
        # first answer's: the object changed, and is never stitched.
        reason = (
            "the object changed while it was read (its ETag or generation is not the first part's)"
        )
    elif denied or isinstance(exc, PermissionError) or _names_denial(exc):
        reason = f"access denied (check credentials and permissions): {_describe(exc)}"
    else:
        reason = f"{action}: {_describe(exc)}"
    return ShardOpenError(reason, url=url, shard_index=shard_index, offset=offset)


def hidden_failure(exc: BaseException) -> BaseException | None:
    """The transient failure under a ``FileNotFoundError`` (fsspec's HTTP ``info()`` turns
    every failure into one): an HTTP 5xx, 408 or 429, or a connection refused, reset or
    timed out; None for anything else (a 404 is a missing object)."""
    cause = exc.__cause__
    if not isinstance(exc, FileNotFoundError) or cause is None:
        return None
    status = http_status(cause)
    if isinstance(status, int):
        return cause if status >= 500 or status in (408, 429) else None
    name = type(cause).__name__
    transient = ("Connection", "Connector", "Disconnected", "Timeout", "Reset")
    if isinstance(cause, (ConnectionError, TimeoutError)) or any(w in name for w in transient):
        return cause
    return None


def http_status(exc: BaseException | None) -> Any:
    """A backend exception's HTTP status (aiohttp's ``status``, urllib's ``code``), or None."""
    return getattr(exc, "status", None) or getattr(exc, "code", None)


def status_error(message: str, status: int, kind: type[OSError] = OSError) -> OSError:
    """An ``OSError`` (or ``kind``) carrying an HTTP ``status`` (as :func:`http_status` reads
    it), judged by the retries and the error mapping as the store's own answer with that status
    would be."""
    error = kind(message)
    error.status = status  # type: ignore[attr-defined]
    return error


def discard(stream: Any, count: int) -> int:
    """Read and drop ``count`` bytes (fewer at the end of the stream); returns bytes dropped."""
    dropped = 0
    while dropped < count:
        data = stream.read(min(count - dropped, 1 << 22))
        if not data:
            break
        dropped += len(data)
    return dropped


def drop_prefix(stream: Any, count: int) -> None:
    """Read and drop the first ``count`` bytes of a resumed read of an object (one that
    cannot seek there).

    Raises:
        ConnectionError: The object ends before: it is not the one read before.
    """
    if discard(stream, count) < count:
        raise ConnectionError("object shorter than before while resuming")
