"""Bounded, logged retries of store requests, and this process's I/O counters.

fsspec's HTTP filesystem retries nothing, so retries live here, for every protocol: a reset
connection, 5xx/429/SlowDown answer or timeout is retried with exponential backoff and full
jitter, a bounded number of times; a missing object or denied access is not.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cloudshards.errors import CloudShardsError, ConfigError, ShardOpenError
from cloudshards.process import PerProcess
from cloudshards.redact import RedactedError, raise_redacted, redact_text, redact_url
from cloudshards.source.options import FetchOptions
from cloudshards.source.stream import (
    hidden_failure,
    http_status,
    map_backend_error,
    without_paths,
)

__all__ = [
    "IOStats",
    "LinkedEvent",
    "PartialBodyError",
    "RangeIgnoredError",
    "is_retryable",
    "is_throttled",
    "process_stats",
    "retry",
]

# The logger's name from before the module moved: logging configurations name it.
logger = logging.getLogger("cloudshards.fetch")

# Backoff jitter from the OS: never the global ``random`` module, whose sequence the user's
# augmentations own, and no seeded state that forked DataLoader workers would share.
_jitter = random.SystemRandom()

T = TypeVar("T")


@dataclass
class IOStats:
    """I/O counters of this process (thread-safe increments).

    Attributes:
        shards: Shards opened.
        requests: Ranged GETs and streaming opens sent.
        retries: Requests repeated after a transient failure.
        bytes: Bytes received from stores.
        wait_s: Time the consumer spent blocked waiting for bytes.
        failures: Shards given up on after retries.
    """

    shards: int = 0
    requests: int = 0
    retries: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    failures: int = 0
    parent: IOStats | None = field(default=None, repr=False)
    per_shard: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=1000))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        """Add to counters atomically (and to the parent's, for per-shard counters)."""
        with self._lock:
            for key, value in counts.items():
                setattr(self, key, getattr(self, key) + value)
        if self.parent is not None:
            self.parent.add(**counts)

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (without the per-shard records)."""
        return {
            k: v
            for k, v in self.__dict__.items()
            if not k.startswith("_") and k not in ("parent", "per_shard")
        }


_process_stats: PerProcess[IOStats] = PerProcess(IOStats)


def process_stats() -> IOStats:
    """This process's I/O counters (each DataLoader worker has its own)."""
    return _process_stats.get()


class RangeIgnoredError(CloudShardsError):
    """The server answered a ranged request with the whole object (it ignores Range)."""

    def __init__(self, body: bytes) -> None:
        super().__init__("server ignored the Range header")
        self.body = body


class PartialBodyError(CloudShardsError):
    """An answer cut mid-body (a transient failure, ``cause``) after ``received`` bytes of
    the range had arrived, from the object whose ETag the answer gave (``etag``) and of the
    size it gave (``size``, None if it did not): the retry asks for the rest only, of that
    object, and the bytes are not lost."""

    def __init__(
        self, received: bytes, cause: BaseException, etag: str | None, size: int | None
    ) -> None:
        super().__init__(f"cut after {len(received)} bytes: {type(cause).__name__}")
        self.received = received
        self.cause = cause
        self.etag = etag
        self.size = size


_NOT_RETRYABLE = (FileNotFoundError, IsADirectoryError, PermissionError, ConfigError)
# A bug (ours, a backend's or a user's hook), not the store: asking again only repeats it, and
# six tries logged as "transient" hide it behind minutes of backoff. (Not AttributeError,
# TypeError or AssertionError: aiohttp and botocore have raised them in connection races.)
_PROGRAMMING_ERRORS = (NameError, ImportError, NotImplementedError, RecursionError)
_AUTH_OR_CLIENT = (
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoSuchKey",
    "NoSuchBucket",
    "NoCredentials",
    "Forbidden",
    "Unauthorized",
    "InvalidToken",
    "ExpiredToken",
    # s3fs turns those two codes into OSError(EINVAL) carrying only S3's message:
    "The provided token",
)


def is_retryable(exc: BaseException) -> bool:
    """True for transient failures: resets, timeouts, 5xx, 429/SlowDown, short bodies.

    A :class:`~cloudshards.redact.RedactedError` (a backend's error, kept redacted as the
    cause of ours) is judged by the kind of error it copies.
    """
    if isinstance(exc, ShardOpenError) and exc.__cause__ is not None:
        return is_retryable(exc.__cause__)  # ours, wrapping the backend's: judge the backend's
    hidden = hidden_failure(exc)
    if hidden is not None:  # fsspec's "not found" for a 503 or a refused connection
        return is_retryable(hidden)
    kind = type(exc)
    if isinstance(exc, RedactedError):
        if exc.original_type is None:
            return False
        kind = exc.original_type
    if issubclass(kind, (*_NOT_RETRYABLE, *_PROGRAMMING_ERRORS, RangeIgnoredError)):
        return False
    status = http_status(exc)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return False
    text = f"{kind.__name__} {exc}"
    return not any(marker in text for marker in _AUTH_OR_CLIENT)


_THROTTLED = (
    "SlowDown",
    "Slow Down",
    "Throttl",
    "TooManyRequests",
    "Too Many Requests",
    "RequestLimitExceeded",
    "ServiceUnavailable",
    "Service Unavailable",
    "educe your request rate",  # S3's SlowDown and ServiceUnavailable messages
)
#: 429 or 503 where a message gives an HTTP status: "(503)", "503, message=", "HTTP 503",
#: "HTTP/1.1 503", "status 503", "status_code=503", "Error 503", "503 Server Error"; not any
#: number 503 (bytes read, an offset, "decode 429", a key "http_503.tar"), which would slow the
#: whole node down for a failure of its own. Paths and URLs are taken out of the text first.
_STATUS_TEXT = re.compile(
    r"\((?:429|503)\)|\b(?:429|503),\s*message=|\b(?:429|503) (?:Server|Client) Error\b"
    r"|(?<![A-Za-z])(?i:status|http|error|code)(?:/\d(?:\.\d)?|[\s:=]|_?code){0,6}(?:429|503)\b"
)


def is_throttled(exc: BaseException) -> bool:
    """True for a store asking to slow down: 429, 503, SlowDown, throttling."""
    cause = exc.__cause__ if isinstance(exc, ShardOpenError) else None
    if cause is not None:
        return is_throttled(cause)
    hidden = hidden_failure(exc)
    if hidden is not None:  # fsspec's "not found" for a 503 or 429
        return is_throttled(hidden)
    status = http_status(exc)
    if status in (429, 503):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
        return True  # s3fs's translation of exactly 503, SlowDown and ServiceUnavailable
    text = f"{type(exc).__name__} {exc}"
    if any(marker in text for marker in _THROTTLED):
        return True
    return _STATUS_TEXT.search(without_paths(str(exc))) is not None


class LinkedEvent(threading.Event):
    """An event of its own (one shard's reading is over: it failed, fell back or closed) that
    also counts as set once ``parent`` (the reader's) is: a retry waiting on it stops for
    either, so the parts of a shard given up on stop retrying with it."""

    def __init__(self, parent: threading.Event | None) -> None:
        super().__init__()
        self._parent = parent

    def is_set(self) -> bool:
        return super().is_set() or (self._parent is not None and self._parent.is_set())

    def why(self) -> str:
        """What set it, for an error: the reader's close, or this shard's own end."""
        if self._parent is not None and self._parent.is_set():
            return "the reader was closed"
        return "the shard's reading was given up (a part failed, or the reader closed it)"

    def wait(self, timeout: float | None = None) -> bool:
        if self._parent is None:
            return super().wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():  # the parent's setting is seen within a slice
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)
        return True


def retry(
    call: Callable[[], T],
    *,
    url: str,
    offset: int | Callable[[], int],
    options: FetchOptions,
    stats: IOStats | None = None,
    what: str = "GET",
    cancel: threading.Event | None = None,
) -> T:
    """Run ``call``; retry transient failures with exponential backoff and full jitter.

    A set ``cancel`` event (the reader was closed) stops further attempts at once.
    ``offset`` (or what it returns, for a call that resumes where the last one was cut) is
    the offset that logs and errors name.

    Raises:
        ShardOpenError: After the last attempt (naming the URL and offset), or at once for a
            permanent failure (missing object, denied access).
    """
    attempt = throttles = 0
    began = time.monotonic()
    while True:
        try:
            return call()
        except RangeIgnoredError:
            raise
        except Exception as exc:
            at = offset() if callable(offset) else offset
            cancelled = cancel is not None and cancel.is_set()
            throttled = is_throttled(exc)
            throttles += throttled
            # Up to throttle_retries tries for throttling come on top of the retries, as long
            # as one more try still ends within give_up_s (the reader's wait for it).
            spent = attempt - min(throttles, options.throttle_retries)
            delay = _jitter.uniform(0, min(options.max_backoff_s, options.backoff_s * 2**attempt))
            left = options.give_up_s - (time.monotonic() - began)
            late = throttled and attempt >= options.retries
            late = late and delay + options.stall_timeout_s + 1.0 >= left
            limit = options.retries + (options.throttle_retries if throttled else 0)
            if cancelled or not is_retryable(exc) or spent >= options.retries or late:
                if stats is not None:
                    stats.add(failures=1)
                error = map_backend_error(exc, url, action=f"{what} failed", offset=at)
                if attempt and isinstance(error, ShardOpenError):
                    error = ShardOpenError(
                        f"{error.reason} (gave up after {attempt + 1} attempts)",
                        url=url,
                        offset=at,
                    )
                raise_redacted(error, exc)
            if throttled:  # the whole node slows down, not just this request
                from cloudshards.source.budget import node_budget

                node_budget().back_off(delay)
            attempt += 1
            if stats is not None:
                stats.add(retries=1)
            logger.warning(
                "retry %d/%d of %s %s at offset %d in %.2fs after %s: %s",
                attempt,
                limit,
                what,
                redact_url(url),
                at,
                delay,
                type(exc).__name__,
                redact_text(str(exc))[:200],
            )
            if cancel is not None:
                cancel.wait(delay)
            else:
                time.sleep(delay)
