"""Opening shards as byte streams: the only caller of ``fs.open`` in cloudshards.

Maps every backend failure (missing object, denied access, network errors, a failing ``pipe:``
command) to :class:`~cloudshards.errors.ShardOpenError` naming the redacted URL and offset.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from cloudshards import config
from cloudshards.errors import CloudShardsError, ConfigError, ShardOpenError
from cloudshards.redact import raise_redacted, redact_text, redact_url
from cloudshards.urls import PIPE_PREFIX, protocol_of, resolve

__all__ = [
    "OpenOptions",
    "ShardStream",
    "discard",
    "gopen",
    "map_backend_error",
    "open_output",
    "open_shard",
    "shard_size",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenOptions:
    """How shards are opened.

    Attributes:
        storage_options: Per-protocol fsspec options (``{"s3": {...}}``) or one flat mapping.
        allow_pipe: Allow ``pipe:CMD`` URLs, which run ``CMD`` in a shell. Off by default;
            ``CLOUDSHARDS_ALLOW_PIPE=1`` turns it on when this is None.
        block_bytes: Size of each read from the store.
        max_member_bytes: Largest tar member read into memory (a guard against hostile or
            corrupt headers); None means ``CLOUDSHARDS_MAX_MEMBER_BYTES`` or 1 GiB.
    """

    # Never in the repr: it holds credentials.
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    allow_pipe: bool | None = None
    block_bytes: int = config.DEFAULT_BLOCK_BYTES
    max_member_bytes: int | None = None

    def member_limit(self) -> int:
        """The member size limit, after the environment default."""
        if self.max_member_bytes is not None:
            return self.max_member_bytes
        return config.env_int("MAX_MEMBER_BYTES", config.DEFAULT_MAX_MEMBER_BYTES)

    def pipe_allowed(self) -> bool:
        """Whether ``pipe:`` URLs may run, after the environment default."""
        if self.allow_pipe is not None:
            return self.allow_pipe
        return config.env_bool("ALLOW_PIPE", False)


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
    "401",
    "403",
)


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
    if isinstance(exc, FileNotFoundError):
        reason = "object not found"
    elif isinstance(exc, IsADirectoryError):
        reason = "is a directory, not a shard"
    elif isinstance(exc, PermissionError) or any(
        marker in f"{type(exc).__name__} {exc}" for marker in _AUTH_MARKERS
    ):
        reason = f"access denied (check credentials and permissions): {_describe(exc)}"
    else:
        reason = f"{action}: {_describe(exc)}"
    return ShardOpenError(reason, url=url, shard_index=shard_index, offset=offset)


def shard_size(url: str, options: OpenOptions | None = None) -> int | None:
    """Return a shard's size in bytes (None when the store does not say).

    Raises:
        ShardOpenError: The object is missing or cannot be reached.
    """
    options = options or OpenOptions()
    if url.startswith(PIPE_PREFIX):
        return None
    fs, path = resolve(url, options.storage_options)
    try:
        size = fs.size(path)
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, action="cannot stat"), exc)
    return None if size is None else int(size)


def open_shard(
    url: str, options: OpenOptions | None = None, *, shard_index: int | None = None
) -> ShardStream:
    """Open a shard URL for streaming reads.

    Args:
        url: A local path, ``file://``, any fsspec URL, or (opt-in) ``pipe:CMD``.
        options: Storage options and switches; defaults when None.
        shard_index: Position of the shard in the epoch, for error messages.

    Returns:
        A :class:`ShardStream`; close it when done.

    Raises:
        ShardOpenError: The object is missing, access is denied, or the store failed.
        ConfigError: The URL's protocol is unknown, its backend is missing, or ``pipe:`` is
            not allowed.
    """
    options = options or OpenOptions()
    start = time.perf_counter()
    if url.startswith(PIPE_PREFIX):
        raw = _open_pipe(url, options)
    else:
        raw = _open_fsspec(url, options, shard_index)
    logger.debug("opened %s in %.3fs", redact_url(url), time.perf_counter() - start)
    return ShardStream(raw, url, shard_index=shard_index)


def _open_fsspec(url: str, options: OpenOptions, shard_index: int | None) -> IO[bytes]:
    protocol = protocol_of(url)
    fs, path = resolve(url, options.storage_options)
    try:
        if protocol == "file":
            # Unbuffered: the tar reader already reads in large blocks.
            return open(path, "rb", buffering=0)
        if protocol in ("http", "https"):
            # block_size=0 gives one streaming GET instead of many small ranged ones.
            return fs.open(path, "rb", block_size=0)  # type: ignore[no-any-return]
        return fs.open(  # type: ignore[no-any-return]
            path, "rb", block_size=options.block_bytes, cache_type="none"
        )
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, shard_index=shard_index), exc)


class _PipeReader:
    """stdout of a shell command, raising on a non-zero exit when closed or exhausted."""

    def __init__(self, command: str) -> None:
        self.command = command
        self._proc = subprocess.Popen(  # noqa: S602 - opt-in pipe: URLs run a shell by design
            command, shell=True, stdout=subprocess.PIPE, bufsize=0
        )
        assert self._proc.stdout is not None
        self._stdout = self._proc.stdout

    def read(self, size: int = -1) -> bytes:
        data = self._stdout.read(size)
        if not data:
            self._check()
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:
        count: int = self._stdout.readinto(buffer)  # type: ignore[attr-defined]
        if not count:
            self._check()
        return count

    def _check(self) -> None:
        status = self._proc.wait()
        # 141 = SIGPIPE when the reader stops early, as webdataset also tolerates.
        if status not in (0, 141, -13):
            raise OSError(f"pipe command exited with status {status}")

    def close(self) -> None:
        self._stdout.close()
        if self._proc.poll() is None:
            self._proc.terminate()
        self._proc.wait()


def _open_pipe(url: str, options: OpenOptions) -> IO[bytes]:
    if not options.pipe_allowed():
        # Only the program's name: the rest of a command line may hold a token or a password.
        program = url[len(PIPE_PREFIX) :].split(maxsplit=1)[:1] or [""]
        raise ConfigError(
            f"'pipe:{redact_url(program[0])[:40]} ...': pipe: URLs run shell commands and are "
            "off by default; "
            "pass allow_pipe=True or set CLOUDSHARDS_ALLOW_PIPE=1 to allow them"
        )
    return _PipeReader(url[len(PIPE_PREFIX) :])  # type: ignore[return-value]


def gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """Open a URL for reading or writing, like webdataset's ``gopen`` (through fsspec).

    ``"rb"`` returns a :class:`ShardStream`; ``"wb"`` an fsspec file (closing it commits the
    object). ``"-"`` is stdin or stdout. ``pipe:`` URLs need ``allow_pipe=True``.
    """
    import sys

    if mode not in ("rb", "wb"):
        raise ConfigError(f"gopen: mode must be 'rb' or 'wb', got {mode!r}")
    if url == "-":
        return sys.stdin.buffer if mode == "rb" else sys.stdout.buffer
    options = OpenOptions(
        storage_options=kw.get("storage_options"), allow_pipe=kw.get("allow_pipe")
    )
    if mode == "rb":
        return open_shard(url, options)
    if url.startswith(PIPE_PREFIX):
        raise ConfigError("gopen: writing to pipe: URLs is not supported")
    fs, path = resolve(url, options.storage_options)
    return fs.open(path, "wb")


def open_output(url: str, path: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """Open ``path`` on the filesystem of ``url`` for writing: the write side of :func:`open_shard`.

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


def discard(stream: Any, count: int) -> int:
    """Read and drop ``count`` bytes (fewer at the end of the stream); returns bytes dropped."""
    dropped = 0
    while dropped < count:
        data = stream.read(min(count - dropped, 1 << 22))
        if not data:
            break
        dropped += len(data)
    return dropped
