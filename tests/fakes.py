"""Fake object stores at the fsspec seam.

``slowfile:///abs/path/x.tar`` serves the local file ``/abs/path/x.tar`` through a real fsspec
filesystem, so every process on the machine (DataLoader workers, subprocesses) sees the same
"store". Its knobs are environment variables, read on every call, so a subprocess or a worker
sees the values its environment had:

- ``SLOWFILE_DELAY_S``: seconds to sleep before every read (a slow network).
- ``SLOWFILE_CHUNK_BYTES``: most bytes one read returns (0 or unset: no limit).
- ``SLOWFILE_OPEN_DELAY_S``: seconds to sleep in every open and ranged read (time to first
  byte).
- ``SLOWFILE_OPEN_LOG``: a file that gets one line ``<path>`` per fetch of an object, appended
  with ``O_APPEND`` (atomic across processes): every open for reading, and every ranged read
  that starts at offset 0 (the later parts of a ranged download are not new fetches).
- ``SLOWFILE_ETAG``: ``info()`` returns only the size unless this is set; ``md5`` gives the
  file's real MD5 as its ``ETag``, any other value is returned as the ``ETag`` verbatim.

Call :func:`register` in every process that opens ``slowfile://`` URLs (it is also a valid
``worker_init_fn`` for spawned DataLoader workers).

Also here: reading a stream to its end or by a count (:func:`read_all`, :func:`read_exactly`),
which the cache's tests do with every kind of stream, and a small complete member table
(:func:`member_table`).
"""

from __future__ import annotations

import collections
import hashlib
import io
import os
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

PROTOCOL = "slowfile"
DELAY_ENV = "SLOWFILE_DELAY_S"
CHUNK_ENV = "SLOWFILE_CHUNK_BYTES"
OPEN_DELAY_ENV = "SLOWFILE_OPEN_DELAY_S"
OPEN_LOG_ENV = "SLOWFILE_OPEN_LOG"
ETAG_ENV = "SLOWFILE_ETAG"
ENV_KNOBS = (DELAY_ENV, CHUNK_ENV, OPEN_DELAY_ENV, OPEN_LOG_ENV, ETAG_ENV)


def _sleep(knob: str) -> None:
    delay = float(os.environ.get(knob) or 0)
    if delay > 0:
        time.sleep(delay)


class SlowFile(io.RawIOBase):
    """A local file whose reads sleep first and return at most the configured chunk."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer: Any) -> int:
        _sleep(DELAY_ENV)
        view = memoryview(buffer).cast("B")
        chunk = int(os.environ.get(CHUNK_ENV) or 0)
        if chunk > 0:
            view = view[:chunk]
        return self._file.readinto(view) or 0

    def close(self) -> None:
        self._file.close()
        super().close()


class SlowFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """Local files as a remote store: ``slowfile:///abs/path``."""

    protocol = PROTOCOL
    root_marker = "/"

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        st = os.stat(path)
        kind = "directory" if os.path.isdir(path) else "file"
        details: dict[str, Any] = {"name": path, "size": st.st_size, "type": kind}
        etag = os.environ.get(ETAG_ENV)
        if etag and kind == "file":
            if etag == "md5":
                etag = hashlib.md5(Path(path).read_bytes(), usedforsecurity=False).hexdigest()
            details["ETag"] = f'"{etag}"'
        return details

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        names = [os.path.join(path, n) for n in sorted(os.listdir(path))]
        return [self.info(n) for n in names] if detail else names

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        """One ranged GET, read until ``end`` (or the end); logged when it starts at 0."""
        _sleep(OPEN_DELAY_ENV)
        path = self._strip_protocol(path)
        with SlowFile(path) as f:
            if not start:
                _log_open(path)
            f.seek(start or 0)
            left = -1 if end is None else max(0, end - (start or 0))
            parts: list[bytes] = []
            while left:
                data = f.read(left if left > 0 else 1 << 20)
                if not data:
                    break
                parts.append(data)
                left = left - len(data) if left > 0 else left
        return b"".join(parts)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> SlowFile:
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL}:// is read-only")
        _sleep(OPEN_DELAY_ENV)
        path = self._strip_protocol(path)
        file = SlowFile(path)
        _log_open(path)
        return file


def _log_open(path: str) -> None:
    log = os.environ.get(OPEN_LOG_ENV)
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{path}\n".encode())  # one write: atomic with O_APPEND
        finally:
            os.close(fd)


def register(_worker_id: int | None = None) -> None:
    """Make ``slowfile://`` known to fsspec in this process (usable as ``worker_init_fn``)."""
    fsspec.register_implementation(PROTOCOL, SlowFileSystem, clobber=True)


def url_of(path: str | os.PathLike[str]) -> str:
    """The ``slowfile://`` URL of a local file."""
    return f"{PROTOCOL}://{os.path.abspath(path)}"


def opens(log: str | os.PathLike[str]) -> collections.Counter[str]:
    """How many times each path was opened, from an open log (empty if none yet)."""
    try:
        lines = Path(log).read_text().splitlines()
    except FileNotFoundError:
        return collections.Counter()
    return collections.Counter(lines)


def read_all(stream: Any, size: int = 1 << 16) -> bytes:
    """What is left in ``stream``, read ``size`` bytes at a time."""
    chunks = []
    while chunk := stream.read(size):
        chunks.append(chunk)
    return b"".join(chunks)


def read_exactly(stream: Any, count: int, size: int = 1 << 16) -> bytes:
    """The next ``count`` bytes of ``stream``, read at most ``size`` at a time; none of the
    reads may come back empty."""
    chunks = []
    got = 0
    while got < count:
        chunk = stream.read(min(size, count - got))
        assert chunk, f"the stream ended after {got} of {count} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def member_table(*rows: tuple[str, int, int]) -> Any:
    """A complete :class:`~cloudshards.cache.membertable.MemberTable` of ``(name, offset,
    size)`` rows (one ``a.cls`` member when none are given)."""
    from cloudshards.cache.membertable import MemberTable

    table = MemberTable()
    for name, offset, size in rows or (("a.cls", 512, 3),):
        table.names.append(name)
        table.offsets.append(offset)
        table.sizes.append(size)
    table.complete = True
    return table


def ends_soon(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended, or ends within ``timeout_s`` (a zombie nobody reaps,
    as in a container, counts as ended)."""
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
