"""Shards that are not in a store: local files and (opt-in) ``pipe:`` commands.

:func:`is_local` is the one place that decides whether a URL is read from a store (and so is
prefetched, fetched in ranged parts, retried and cached) or opened where it is.
"""

from __future__ import annotations

import os
import subprocess
from typing import IO
from urllib.parse import urlsplit

from cloudshards.errors import ConfigError, ShardOpenError
from cloudshards.redact import raise_redacted, redact_url
from cloudshards.source.options import OpenOptions
from cloudshards.source.stream import map_backend_error
from cloudshards.urls import PIPE_PREFIX, protocol_of, resolve

__all__ = [
    "is_local",
    "is_local_file",
    "local_path",
    "open_local",
    "open_local_fd",
]


def is_local(url: str) -> bool:
    """True for local files and ``pipe:`` commands: opened directly, never fetched or cached."""
    return protocol_of(url) in ("file", "pipe")


def is_local_file(url: str) -> bool:
    """True for a local file (a bare path or ``file://``)."""
    return protocol_of(url) == "file"


def local_path(url: str) -> str | None:
    """The path of a local file URL; None for anything else."""
    if protocol_of(url) != "file":
        return None
    return urlsplit(url).path if url.startswith("file:") else url


def open_local(url: str, options: OpenOptions, shard_index: int | None) -> IO[bytes]:
    """The raw stream of a local file (unbuffered) or of a ``pipe:`` command's stdout.

    Raises:
        ShardOpenError: The file is missing or cannot be read.
        ConfigError: ``pipe:`` is not allowed.
    """
    if url.startswith(PIPE_PREFIX):
        return _open_pipe(url, options)
    _, path = resolve(url, options.storage_options)
    try:
        # Unbuffered: the tar reader already reads in large blocks.
        return open(path, "rb", buffering=0)
    except Exception as exc:
        raise_redacted(map_backend_error(exc, url, shard_index=shard_index), exc)


def open_local_fd(url: str, options: OpenOptions, shard_index: int | None) -> int:
    """A read-only descriptor of a local file (for ``pread``); the caller closes it.

    Raises:
        ShardOpenError: The file is missing or cannot be opened.
    """
    _, path = resolve(url, options.storage_options)
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ShardOpenError(
            "object not found" if isinstance(exc, FileNotFoundError) else str(exc),
            url=url,
            shard_index=shard_index,
        ) from exc


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
