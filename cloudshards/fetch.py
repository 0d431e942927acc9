"""Ranged reads from a store with verification and bounded, logged retries.

fsspec's HTTP filesystem retries nothing and no fsspec backend checks that a ranged answer is
really partial, so both live here, for every protocol: each part is fetched with a Range
request, its length is checked, and a reset connection, 5xx/429/SlowDown answer or timeout is
retried with exponential backoff and jitter, a bounded number of times.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec.asyn

from cloudshards import config
from cloudshards.errors import CloudShardsError, ConfigError, ShardOpenError
from cloudshards.io import OpenOptions, ShardStream, discard, map_backend_error, open_shard
from cloudshards.redact import RedactedError, raise_redacted, redact_text, redact_url
from cloudshards.types import ClosingStream

__all__ = [
    "FetchOptions",
    "IOStats",
    "RangeIgnoredError",
    "ResumableStream",
    "fetch_range",
    "is_retryable",
    "open_remote",
    "process_stats",
    "retry",
]

logger = logging.getLogger(__name__)

# Backoff jitter from the OS: never the global ``random`` module, whose sequence the user's
# augmentations own, and no seeded state that forked DataLoader workers would share.
_jitter = random.SystemRandom()

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchOptions:
    """How remote shards are fetched.

    Attributes:
        prefetch: Shards opened ahead of the one being read (0 turns prefetch off).
        part_bytes: Size of each ranged GET.
        concurrency: Ranged GETs in flight per shard.
        retries: Further attempts after a failed request (0: no retry).
        backoff_s: First retry delay; doubles each time, with full jitter.
        max_backoff_s: Cap on one retry delay.
        stall_timeout_s: A part that makes no progress for this long is an error.
    """

    # Defaults measured with benchmarks/bench_remote.py (30 ms before each request, 25 MB/s per
    # connection, 20 MiB shards), samples/s: 2 MiB x 16 11,882 (the simulator's link with 24
    # raw connections: 13,484), 2 MiB x 32 10,740, 2 MiB x 8 5,843, 4 MiB x 8 8,568, 1 MiB x
    # 16 7,461. What counts is the number of GETs in flight: a prefetched shard stops when its
    # window is full, so the window of the shard being read carries the link. Memory bound:
    # (2 + 1) x 16 x 2 MiB = 96 MiB.
    prefetch: int = 2
    part_bytes: int = 2 << 20
    concurrency: int = 16
    retries: int = 5
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    stall_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.part_bytes < 1 << 16:
            raise ConfigError(f"part_bytes must be >= 64 KiB, got {self.part_bytes}")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}")
        if self.stall_timeout_s <= 0:
            raise ConfigError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")

    @classmethod
    def from_env(cls, **overrides: Any) -> FetchOptions:
        """Defaults from ``CLOUDSHARDS_PREFETCH``, ``..._PART_BYTES``, ``..._CONCURRENCY``,
        ``..._RETRIES``, ``..._STALL_TIMEOUT_S``; explicit (non-None) overrides win."""
        defaults = cls()
        values: dict[str, Any] = {
            "prefetch": config.env_int("PREFETCH", defaults.prefetch),
            "part_bytes": config.env_int("PART_BYTES", defaults.part_bytes),
            "concurrency": config.env_int("CONCURRENCY", defaults.concurrency),
            "retries": config.env_int("RETRIES", defaults.retries),
            "stall_timeout_s": float(
                config.env_int("STALL_TIMEOUT_S", int(defaults.stall_timeout_s))
            ),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def max_buffered_bytes(self) -> int:
        """Upper bound on the bytes held in memory: (prefetch + 1) x concurrency x part."""
        return (self.prefetch + 1) * self.concurrency * self.part_bytes


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


_process_stats = IOStats()


def process_stats() -> IOStats:
    """This process's I/O counters (each DataLoader worker has its own)."""
    return _process_stats


def _reset_after_fork() -> None:
    global _process_stats
    _process_stats = IOStats()


os.register_at_fork(after_in_child=_reset_after_fork)


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


class RangeIgnoredError(CloudShardsError):
    """The server answered a ranged request with the whole object (it ignores Range)."""

    def __init__(self, body: bytes) -> None:
        super().__init__("server ignored the Range header")
        self.body = body


_NOT_RETRYABLE = (FileNotFoundError, IsADirectoryError, PermissionError, ConfigError)
_AUTH_OR_CLIENT = (
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoSuchKey",
    "NoSuchBucket",
    "NoCredentials",
    "Forbidden",
    "Unauthorized",
)


def is_retryable(exc: BaseException) -> bool:
    """True for transient failures: resets, timeouts, 5xx, 429/SlowDown, short bodies.

    A :class:`~cloudshards.redact.RedactedError` (a backend's error, kept redacted as the
    cause of ours) is judged by the kind of error it copies.
    """
    if isinstance(exc, ShardOpenError) and exc.__cause__ is not None:
        return is_retryable(exc.__cause__)  # ours, wrapping the backend's: judge the backend's
    kind = type(exc)
    if isinstance(exc, RedactedError):
        if exc.original_type is None:
            return False
        kind = exc.original_type
    if issubclass(kind, (*_NOT_RETRYABLE, RangeIgnoredError)):
        return False
    status = getattr(exc, "status", None) or getattr(exc, "code", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return False
    text = f"{kind.__name__} {exc}"
    return not any(marker in text for marker in _AUTH_OR_CLIENT)


def retry(
    call: Callable[[], T],
    *,
    url: str,
    offset: int,
    options: FetchOptions,
    stats: IOStats | None = None,
    what: str = "GET",
    cancel: threading.Event | None = None,
) -> T:
    """Run ``call``; retry transient failures with exponential backoff and full jitter.

    A set ``cancel`` event (the reader was closed) stops further attempts at once.

    Raises:
        ShardOpenError: After the last attempt (naming the URL and offset), or at once for a
            permanent failure (missing object, denied access).
    """
    attempt = 0
    while True:
        try:
            return call()
        except RangeIgnoredError:
            raise
        except Exception as exc:
            cancelled = cancel is not None and cancel.is_set()
            if cancelled or not is_retryable(exc) or attempt >= options.retries:
                if stats is not None:
                    stats.add(failures=1)
                error = map_backend_error(exc, url, action=f"{what} failed", offset=offset)
                if attempt and isinstance(error, ShardOpenError):
                    error = ShardOpenError(
                        f"{error.reason} (gave up after {attempt + 1} attempts)",
                        url=url,
                        offset=offset,
                    )
                raise_redacted(error, exc)
            delay = _jitter.uniform(0, min(options.max_backoff_s, options.backoff_s * 2**attempt))
            attempt += 1
            if stats is not None:
                stats.add(retries=1)
            logger.warning(
                "retry %d/%d of %s %s at offset %d in %.2fs after %s: %s",
                attempt,
                options.retries,
                what,
                redact_url(url),
                offset,
                delay,
                type(exc).__name__,
                redact_text(str(exc))[:200],
            )
            if cancel is not None:
                cancel.wait(delay)
            else:
                time.sleep(delay)


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
        if start:
            self._stream = self._open_at(start)
        else:
            stats.add(requests=1)
            self._stream = open_raw()
        raw = getattr(self._stream, "_raw", None)
        self.size = getattr(raw, "size", None)
        self.details = getattr(raw, "details", None)

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
            if not _seek(stream, offset) and discard(stream, offset) < offset:
                raise ConnectionError("object shorter than before while resuming")
        except BaseException:
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
