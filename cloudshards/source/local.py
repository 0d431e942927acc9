"""Shards that are not in a store: local files, (opt-in) ``pipe:`` commands, and URLs whose
scheme the user gave an opener of their own (webdataset's ``gopen_schemes``).

:func:`is_local` is the one place that decides whether a URL is read from a store (and so is
prefetched, fetched in ranged parts, retried and cached) or opened where it is.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import weakref
from collections.abc import Callable
from typing import IO, Any
from urllib.parse import urlsplit

from cloudshards.errors import ConfigError, ShardOpenError
from cloudshards.redact import raise_redacted, redact_url
from cloudshards.source.options import OpenOptions, pipe_advice
from cloudshards.source.stream import map_backend_error
from cloudshards.urls import PIPE_PREFIX, protocol_of, resolve

__all__ = [
    "PipeWriter",
    "check_pipe",
    "is_local",
    "is_local_file",
    "local_path",
    "open_local",
    "open_local_fd",
    "pipe_program",
    "serve_user_openers",
    "user_opener",
    "user_output",
]

#: Finds the opener the user registered for a scheme (None: none); see serve_user_openers.
_user_openers: Callable[[str], Callable[..., Any] | None] | None = None


def serve_user_openers(lookup: Callable[[str], Callable[..., Any] | None]) -> None:
    """Open URLs through openers the user registered: ``lookup(scheme)`` gives the opener
    ``f(url, mode, bufsize)`` for a URL's scheme, or None. Set by
    :mod:`cloudshards.webdataset.gopen` for ``gopen_schemes``, as webdataset's readers and
    writers use it."""
    global _user_openers
    _user_openers = lookup


def user_opener(url: str) -> Callable[..., Any] | None:
    """The opener the user registered for ``url``'s scheme, if any (never for local paths)."""
    lookup = _user_openers
    if lookup is None:
        return None
    protocol = protocol_of(url)
    return None if protocol == "file" else lookup(protocol)


class _UserOutput:
    """A stream from the user's opener, written by a TarWriter: committing or aborting closes
    it (what it does with a partial shard is the opener's business)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, data: bytes) -> int:
        return int(self.stream.write(data))

    def commit(self) -> None:
        self.stream.close()

    abort = commit


def user_output(url: str) -> _UserOutput | None:
    """A writable stream from the user's opener for ``url``'s scheme (mode ``"wb"``), as
    webdataset's ``TarWriter`` opens it; None when there is no such opener."""
    opener = user_opener(url)
    return None if opener is None else _UserOutput(opener(url, "wb", 8192))


def is_local(url: str) -> bool:
    """True for local files, ``pipe:`` commands and URLs with an opener of the user's: opened
    directly, never fetched or cached."""
    return protocol_of(url) in ("file", "pipe") or user_opener(url) is not None


def is_local_file(url: str) -> bool:
    """True for a local file (a bare path or ``file://``)."""
    return protocol_of(url) == "file"


def local_path(url: str) -> str | None:
    """The path of a local file URL; None for anything else."""
    if protocol_of(url) != "file":
        return None
    return urlsplit(url).path if url.startswith("file:") else url


def open_local(url: str, options: OpenOptions, shard_index: int | None) -> IO[bytes]:
    """The raw stream of a local file (unbuffered), of a ``pipe:`` command's stdout, or the one
    the user's opener for the URL's scheme returns (see :func:`serve_user_openers`).

    Raises:
        ShardOpenError: The file is missing or cannot be read.
        ConfigError: ``pipe:`` is not allowed.
    """
    opener = user_opener(url)
    if opener is not None:
        try:
            stream: IO[bytes] = opener(url, "rb", 8192)  # webdataset's default bufsize
            return stream
        except Exception as exc:
            raise_redacted(map_backend_error(exc, url, shard_index=shard_index), exc)
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
        # A session of its own: close() stops the shell's children too (``curl ... | zcat``).
        self._proc = subprocess.Popen(  # noqa: S602 - opt-in pipe: URLs run a shell by design
            command, shell=True, stdout=subprocess.PIPE, bufsize=0, start_new_session=True
        )
        assert self._proc.stdout is not None
        self._stdout = self._proc.stdout
        _open_pipes.add(self)  # stopped at exit if still open (see _stop_open_pipes)

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
        # 141 = SIGPIPE when the reader stops early, as webdataset also tolerates.
        _check_exit(self.command, self._proc.wait(), tolerate=(141, -signal.SIGPIPE))

    def close(self) -> None:
        _open_pipes.discard(self)
        self._stdout.close()
        _stop_group(self._proc, signal.SIGTERM)  # the shell may be gone, not what it started
        self._proc.wait()


#: Readers of pipe: commands not closed yet. A reader left open when the interpreter exits is
#: not closed while its modules are torn down (see cloudshards.finalize), and its command runs
#: in a session of its own, which a terminal's Ctrl-C or hang-up does not reach: these are
#: stopped at exit instead.
_open_pipes: weakref.WeakSet[_PipeReader] = weakref.WeakSet()
os.register_at_fork(after_in_child=_open_pipes.clear)  # a child's exit stops none of ours


@atexit.register
def _stop_open_pipes() -> None:
    for reader in list(_open_pipes):
        with contextlib.suppress(Exception):
            reader.close()


def _check_exit(command: str, status: int, tolerate: tuple[int, ...] = ()) -> None:
    """Raise ``OSError`` naming the command's program (not its arguments, which may hold a
    secret) when its exit ``status`` is neither 0 nor tolerated."""
    if status != 0 and status not in tolerate:
        raise OSError(f"pipe command {pipe_program(command)!r} exited with status {status}")


def _stop_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Send ``signum`` to the command's process group (its shell and everything it started)."""
    with contextlib.suppress(ProcessLookupError):  # ended already
        os.killpg(proc.pid, signum)


_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def pipe_program(command: str) -> str:
    """A shell command's program, for messages: the first word that is not a variable
    assignment (``HF_TOKEN=... curl ...``); the rest of a command line may hold a token or a
    password."""
    words = [word for word in command.split() if not _ASSIGNMENT.match(word)][:1]
    return redact_url(words[0])[:80] if words else ""


def check_pipe(url: str, options: OpenOptions) -> str:
    """The command of ``pipe:`` URL ``url``, once the pipe opt-in allows it to run.

    Raises:
        ConfigError: ``pipe:`` commands may not run; the message says how to allow them.
    """
    command = url[len(PIPE_PREFIX) :]
    if not options.pipe_allowed():
        raise ConfigError(
            f"'pipe:{pipe_program(command)[:40]} ...': pipe: URLs run shell commands and are "
            + pipe_advice()
        )
    return command


def _open_pipe(url: str, options: OpenOptions) -> IO[bytes]:
    return _PipeReader(check_pipe(url, options))  # type: ignore[return-value]


class PipeWriter:
    """The stdin of ``pipe:`` URL ``url``'s shell command, for writers (``pipe:aws s3 cp -
    s3://b/x.tar``), as webdataset writes to one. :meth:`close` waits for the command and
    raises ``OSError`` on a non-zero exit; :meth:`kill` stops it before its input ends, so
    that an aborted shard is not completed by the command (an upload, say) as if whole.

    Raises:
        ConfigError: ``pipe:`` commands may not run (see :func:`check_pipe`).
    """

    def __init__(self, url: str, options: OpenOptions) -> None:
        self.command = check_pipe(url, options)
        # A session of its own: kill() stops the shell's children too (``cat > f && ...``).
        self._proc = subprocess.Popen(  # noqa: S602 - opt-in pipe: URLs run a shell by design
            self.command, shell=True, stdin=subprocess.PIPE, start_new_session=True
        )
        assert self._proc.stdin is not None
        self._stdin = self._proc.stdin
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._stdin.write(data)

    def flush(self) -> None:
        self._stdin.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._stdin.close()
        finally:
            status = self._proc.wait()
        _check_exit(self.command, status)

    def kill(self) -> None:
        self.closed = True
        _stop_group(self._proc, signal.SIGKILL)
        with contextlib.suppress(OSError):  # the command is gone: its pipe may be broken
            self._stdin.close()
        self._proc.wait()
