"""webdataset 1.0.2's ``webdataset.gopen``: open any URL for reading or writing.

Remote URLs open through fsspec (``s3://``, ``gs://``, ``http(s)://``, ``hf://`` and any other
fsspec protocol) with retries, instead of webdataset's ``curl``/``gsutil``/``ais`` commands,
which cloudshards never runs. ``pipe:`` URLs and :class:`Pipe` run shell commands only when
allowed (``allow_pipe=True`` or ``CLOUDSHARDS_ALLOW_PIPE=1``). Handlers registered in
:data:`gopen_schemes` are used, as in webdataset; unknown schemes go to fsspec.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Callable
from subprocess import PIPE
from typing import Any
from urllib.parse import urlparse

from cloudshards import config
from cloudshards import source as _io
from cloudshards.errors import ConfigError
from cloudshards.process import in_dataloader_worker
from cloudshards.redact import redact_url
from cloudshards.source import OpenOptions, open_remote, pipe_advice
from cloudshards.urls import rewrite_url, secure
from cloudshards.webdataset._unsupported import unsupported_function

__all__ = [
    "PIPE",
    "Pipe",
    "gopen",
    "gopen_ais",
    "gopen_curl",
    "gopen_error",
    "gopen_file",
    "gopen_fsspec",
    "gopen_gsutil",
    "gopen_hf",
    "gopen_htgs",
    "gopen_pipe",
    "gopen_schemes",
    "info",
    "reader",
    "rewrite_url",
    "set_options",
]

#: Extra information webdataset prints with pipe errors.
info: dict[str, Any] = {}


def _check_pipe_allowed(what: str, allow_pipe: bool | None) -> None:
    if not OpenOptions(allow_pipe=allow_pipe).pipe_allowed():
        raise ConfigError(f"{what}: shell commands are {pipe_advice()}")


def _program(args: tuple[Any, ...]) -> str:
    """The command's program, for messages: the rest of a command line may hold a token."""
    command = args[0] if args else ""
    if isinstance(command, (list, tuple)):
        command = command[0] if command else ""
    program = _io.pipe_program(str(command))
    return f"pipe command {program!r}" if program else "pipe command"


class Pipe:
    """A command's stdout (mode ``"r..."``) or stdin (``"w..."``) as a stream.

    Needs the pipe opt-in (``allow_pipe=True`` or ``CLOUDSHARDS_ALLOW_PIPE=1``). Exit statuses
    other than 0 and ``ignore_status`` raise ``OSError`` on reads after the end and on close.
    """

    def __init__(
        self,
        *args: Any,
        mode: str = "rb",
        timeout: float = 7200.0,
        ignore_errors: bool = False,
        ignore_status: list[int] | None = None,
        allow_pipe: bool | None = None,
        **kw: Any,
    ) -> None:
        _check_pipe_allowed(_program(args), allow_pipe)
        self.ignore_errors = ignore_errors
        self.ignore_status = [0, *(ignore_status or [])]
        self.timeout = timeout
        self.args = (args, kw)
        self.status: int | None = None
        popen: Any = subprocess.Popen  # webdataset passes Popen's arguments through untyped
        if mode[0] == "r":
            self.proc = popen(*args, stdout=PIPE, **kw)
            stream = self.proc.stdout
        elif mode[0] == "w":
            self.proc = popen(*args, stdin=PIPE, **kw)
            stream = self.proc.stdin
        else:
            raise ValueError(f"{mode}: unknown mode")
        if stream is None:
            raise ValueError(f"{_program(args)}: couldn't open")
        self.stream: Any = stream

    def __str__(self) -> str:
        return f"<Pipe {_program(self.args[0])}>"

    def check_status(self) -> None:
        """Raise if the command has exited with a bad status."""
        if self.proc.poll() is not None:
            self.wait_for_child()

    def wait_for_child(self) -> None:
        """Wait for the command; raise ``OSError`` on a bad exit status."""
        self.status = self.proc.wait()
        if self.status not in self.ignore_status and not self.ignore_errors:
            raise OSError(f"{_program(self.args[0])}: exit {self.status} (read) {info}")

    def read(self, *args: Any, **kw: Any) -> Any:
        """Read from the command's stdout."""
        result = self.stream.read(*args, **kw)
        self.check_status()
        return result

    def write(self, *args: Any, **kw: Any) -> Any:
        """Write to the command's stdin."""
        result = self.stream.write(*args, **kw)
        self.check_status()
        return result

    def close(self) -> None:
        """Close the stream and wait for the command (up to ``timeout``)."""
        if not self.stream.closed:
            self.stream.close()
            self.status = self.proc.wait(self.timeout)
            self.wait_for_child()

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()


def set_options(
    obj: Any,
    timeout: float | None = None,
    ignore_errors: bool | None = None,
    ignore_status: list[int] | None = None,
    handler: Any = None,
) -> bool:
    """Set a :class:`Pipe`'s options; False for other streams."""
    if not isinstance(obj, Pipe):
        return False
    if timeout is not None:
        obj.timeout = timeout
    if ignore_errors is not None:
        obj.ignore_errors = ignore_errors
    if ignore_status is not None:
        obj.ignore_status = ignore_status
    if handler is not None:
        obj.handler = handler  # type: ignore[attr-defined]
    return True


class _Reader(io.RawIOBase):
    """A retrying remote read stream as a raw file: buffered (:func:`gopen_fsspec`), it has
    the methods of the pipe webdataset's ``gopen`` hands out for remote URLs (``readline``,
    iteration over lines, ``peek``, ``readinto``), none of which seeks."""

    def __init__(self, stream: Any, url: str) -> None:
        super().__init__()
        self._stream = stream
        self.url = url

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._stream.read(len(view))
        view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        data: bytes = self._stream.read()
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()


def gopen_fsspec(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """Open ``url`` through fsspec: reads stream with retries, writes commit on close.

    Keyword arguments: ``storage_options`` (fsspec options, per protocol or flat).
    """
    # Outside a DataLoader worker (timm reading its _info.json, a script reading metadata),
    # through fsspec: a main process that used obstore would leave every DataLoader worker it
    # forks later without it.
    options = OpenOptions(storage_options=kw.get("storage_options"), obstore=in_dataloader_worker())
    if mode[0] == "r":
        return io.BufferedReader(_Reader(open_remote(url, options), url), max(bufsize, 1))
    if mode[0] == "w":
        return _io.gopen(url, "wb", storage_options=options.storage_options)
    raise ValueError(f"{mode}: unknown mode")


def gopen_file(url: str, mode: str = "rb", bufsize: int = 8192) -> Any:
    """Open a local path or ``file:`` URL."""
    if url.startswith("file:"):
        url = re.sub("^file://?", "", url)
    return open(url, mode)


def gopen_pipe(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Pipe:
    """Run ``pipe:CMD`` in a shell (needs ``allow_pipe=True`` or ``CLOUDSHARDS_ALLOW_PIPE=1``)."""
    if not url.startswith("pipe:"):
        raise ValueError(f"{redact_url(url)}: not a pipe: URL")
    if mode[0] not in "rw":
        raise ValueError(f"{mode}: unknown mode")
    return Pipe(  # noqa: S604 - runs only after the pipe opt-in, checked in Pipe
        url[5:],
        mode=mode,
        shell=True,
        bufsize=bufsize,
        ignore_status=[141],
        allow_pipe=kw.get("allow_pipe"),
    )


def gopen_curl(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """http(s), sftp, ftps, scp: through fsspec instead of ``curl``."""
    return gopen_fsspec(url, mode, bufsize, **kw)


def gopen_gsutil(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """``gs://`` through fsspec (gcsfs) instead of ``gsutil``."""
    return gopen_fsspec(url, mode, bufsize, **kw)


def gopen_hf(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """``hf://`` through fsspec (huggingface_hub's filesystem) instead of ``curl``."""
    if mode[0] == "w":
        raise ValueError(f"{mode}: cannot write")
    return gopen_fsspec(url, mode, bufsize, **kw)


gopen_htgs = unsupported_function(
    "gopen.gopen_htgs", "open gs:// URLs (through gcsfs) or the object's https:// URL instead"
)
gopen_ais = unsupported_function(
    "gopen.gopen_ais",
    "it runs the ais command; read AIStore through its S3 API with s3:// URLs and "
    "storage_options={'s3': {'endpoint_url': ...}}",
)


def gopen_error(url: str, *args: Any, **kw: Any) -> Any:
    """Raise: no handler for this URL."""
    raise ValueError(f"{redact_url(url)}: no gopen handler defined")


#: Scheme -> opener ``f(url, mode, bufsize, **kw)``. Add entries to handle more schemes;
#: ``__default__`` (here fsspec, in webdataset an error) handles the rest.
gopen_schemes: dict[str, Callable[..., Any]] = {
    "__default__": gopen_fsspec,
    "pipe": gopen_pipe,
    "http": gopen_curl,
    "https": gopen_curl,
    "ais": gopen_ais,
    "sftp": gopen_curl,
    "ftps": gopen_curl,
    "scp": gopen_curl,
    "gs": gopen_gsutil,
    "htgs": gopen_htgs,
    "hf": gopen_hf,
}


#: The table as cloudshards made it: entries still equal to these are cloudshards' own.
_DEFAULT_SCHEMES = dict(gopen_schemes)


def _registered_opener(scheme: str) -> Callable[..., Any] | None:
    """The opener the user put in :data:`gopen_schemes` for ``scheme`` (an entry of its own, or
    a replaced ``__default__`` for a scheme without one); None where the table is as made."""
    if scheme in gopen_schemes:
        handler, default = gopen_schemes[scheme], _DEFAULT_SCHEMES.get(scheme)
    else:
        handler = gopen_schemes.get("__default__", gopen_error)
        default = _DEFAULT_SCHEMES["__default__"]
    return None if handler is default else handler


# Readers (WebDataset, url_opener) and writers (TarWriter) open such URLs as webdataset does.
_io.serve_user_openers(_registered_opener)


def gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """Open ``url`` (``"rb"`` or ``"wb"``): ``-`` is stdin/stdout, local paths open directly,
    other schemes go to :data:`gopen_schemes`.

    Keyword arguments reach the scheme's opener: ``storage_options``, ``allow_pipe``.
    """
    if mode not in ("rb", "wb"):
        raise ConfigError(f"gopen: mode must be 'rb' or 'wb', got {mode!r}")
    if url == "-":
        return sys.stdin.buffer if mode == "rb" else sys.stdout.buffer
    url = rewrite_url(url)
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        if secure():
            raise ValueError("gopen: unsafe_gopen is False, cannot open local files")
        from urllib.request import url2pathname  # urllib.request is slow to import

        path = url if parsed.scheme == "" else url2pathname(parsed.path)
        return open(path, mode, buffering=int(config.webdataset_var("GOPEN_BUFFER", "-1")))
    handler = gopen_schemes.get(parsed.scheme, gopen_schemes["__default__"])
    return handler(url, mode, bufsize, **kw)


def reader(url: str, **kw: Any) -> Any:
    """``gopen(url, "rb", **kw)``."""
    return gopen(url, "rb", **kw)
