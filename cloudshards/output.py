"""The output of a writer (:mod:`cloudshards.writers`): a shard appears under its name only
when its writer closes without error. Local files go to a hidden temporary name in the same
directory, then ``os.replace``; S3 and GCS objects stream as multipart/resumable uploads that
only a successful close completes. What is not a file cannot be renamed over: ``-`` (standard
output), a FIFO or a device is written straight into, as webdataset does.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import sys
from collections.abc import Mapping
from typing import Any

from cloudshards.errors import CloudShardsError
from cloudshards.redact import raise_redacted, redact_text, redact_url
from cloudshards.source import OpenOptions, PipeWriter, map_backend_error, open_output
from cloudshards.urls import PIPE_PREFIX, protocol_of, resolve

__all__ = ["AtomicOutput", "discard_upload"]

logger = logging.getLogger("cloudshards.writers")

#: Protocols whose files commit on close (multipart or resumable uploads) and can be discarded.
_UPLOADS = frozenset({"s3", "s3a", "gs", "gcs"})


class AtomicOutput:
    """A write-only stream that makes ``url`` appear only on :meth:`commit`.

    Local files: a hidden ``.NAME.RANDOM.partial`` sibling, renamed over ``url`` on commit (over
    a symlink's target: the link stays). S3 and GCS: the upload itself, which fsspec completes
    on close, discarded on abort. Other fsspec filesystems: a sibling temporary name, moved
    into place on commit. ``-``, a FIFO or a device: written straight into (see the module).
    ``pipe:CMD`` (with the pipe opt-in, ``allow_pipe``): ``CMD``'s stdin; commit waits for it
    (a non-zero exit raises), abort kills it before its input ends.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None,
        *,
        allow_pipe: bool | None = None,
    ) -> None:
        self.url = url
        self.done = True  # nothing to clean up until the stream exists
        self._stream: Any = None  # standard output, a FIFO, a device or a command: written into
        self._file: Any
        self._temp: str | None
        if url.startswith(PIPE_PREFIX):
            self._stream = self._file = PipeWriter(url, OpenOptions(allow_pipe=allow_pipe))
            self._protocol, self._temp, self.done = "pipe", None, False
            return
        self._fs, self._path = resolve(url, storage_options)
        self._protocol = protocol_of(url)
        if self._protocol == "file":
            self._path = os.path.realpath(self._path)  # a symlink: its target is replaced
            self._stream = _stream_at(url, self._path)
        if self._stream is not None:
            self._temp, self._file, self.done = None, self._stream, False
            return
        directory, _, base = self._path.rpartition("/")
        temp = self._temp = f"{directory}/.{base}.{secrets.token_hex(6)}.partial"
        if self._protocol == "file":
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
            try:
                os.makedirs(directory or ".", exist_ok=True)
                fd = os.open(temp, flags, 0o666)
            except OSError as exc:
                raise_redacted(map_backend_error(exc, url, action="cannot write"), exc)
            self._file = os.fdopen(fd, "wb", buffering=1 << 20)
        elif self._protocol in _UPLOADS:
            self._temp = None
            self._file = open_output(url, self._path, storage_options)
        else:
            self._file = open_output(url, temp, storage_options)
        self.done = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            return int(self._file.write(data))
        except Exception as exc:
            raise_redacted(map_backend_error(exc, self.url, action="write failed"), exc)

    def flush(self) -> None:
        """Nothing to do: data reaches the store as the buffers fill, and on commit."""

    def commit(self) -> None:
        """Close the stream and publish it under its final name."""
        if self.done:
            return
        try:
            if self._stream is not None:
                self._close_stream()
                self.done = True
                return
            self._file.close()
            if self._temp is not None and self._protocol == "file":
                os.replace(self._temp, self._path)
            elif self._temp is not None:
                self._fs.mv(self._temp, self._path)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, Exception) and not isinstance(exc, CloudShardsError):
                raise_redacted(map_backend_error(exc, self.url, action="cannot commit"), exc)
            raise
        self.done = True
        logger.debug("committed %s", redact_url(self.url))

    def abort(self) -> None:
        """Throw the partial output away; the final name is never created. Idempotent."""
        if self.done:
            return
        self.done = True
        try:
            if isinstance(self._stream, PipeWriter):
                self._stream.kill()  # before its input ends: the command never sees a whole
            elif self._stream is not None:
                self._close_stream()  # what was written is out: a stream cannot take it back
            elif self._temp is None:
                discard_upload(self._file)
            else:
                try:
                    self._file.close()
                except Exception as exc:
                    # Its buffer's flush failed again (the disk that failed the write is still
                    # full): the file is closed all the same, and is deleted below.
                    logger.debug("closing %s: %s", redact_url(self.url), redact_text(str(exc)))
                if self._protocol == "file":
                    os.unlink(self._temp)
                else:
                    self._fs.rm(self._temp)
        except Exception as exc:
            reason = redact_text(str(exc))  # a backend's text may hold a signed upload URL
            logger.warning("could not clean up %s: %s", redact_url(self.url), reason)
        logger.debug("aborted %s", redact_url(self.url))

    def _close_stream(self) -> None:
        if self._stream is sys.stdout.buffer:
            self._stream.flush()  # never closed: it is the process's
        else:
            self._stream.close()

    def __del__(self) -> None:
        # An unclosed writer dropped by the garbage collector must not publish: fsspec's own
        # __del__ would commit the partial upload (fsspec/s3fs#154).
        if not getattr(self, "done", True):
            self.abort()


def _stream_at(url: str, path: str) -> Any:
    """``-`` as standard output, or the FIFO or device at ``path`` opened for writing; None
    for a regular file or a new name (written to a temporary name and renamed)."""
    if url == "-":
        return sys.stdout.buffer
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None  # a directory: the rename names the error
    return open(path, "wb")  # closed by commit or abort


def discard_upload(file: Any) -> None:
    """Abandon an fsspec upload without committing it, even later from ``__del__``."""
    try:
        discard = getattr(file, "discard", None)
        if callable(discard):
            discard()  # s3fs aborts its multipart upload; gcsfs cancels its resumable one
    finally:
        # closed=True stops close()/__del__ from committing what is buffered.
        file.closed = True
        file.buffer = None
