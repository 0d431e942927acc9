"""The whole cloudshards exception hierarchy.

::

    CloudShardsError
    ├── ConfigError(CloudShardsError, ValueError)
    │   └── UnsupportedError(ConfigError, NotImplementedError)  a webdataset name left out
    ├── ShardError                                  .url, .shard_index, .offset, .member
    │   ├── ShardOpenError(ShardError, OSError)     open/read failed (missing object, auth, network)
    │   │   └── ShardNotFoundError(ShardOpenError, FileNotFoundError)   missing object
    │   ├── ShardFormatError(ShardError, ReadError, OSError, ValueError)
    │   │                                           truncated tar, bad header, duplicate field
    │   └── DecodeError(ShardError, ValueError)     .key, .field (.k), .sample
    ├── CacheError(CloudShardsError, OSError)
    └── StateMismatchError(CloudShardsError, ValueError)

Every message that contains a URL shows it redacted (no credentials, no query string).
``ShardFormatError`` is also a ``tarfile.ReadError`` and an ``OSError``, so code written for
webdataset (which lets ``tarfile`` raise) keeps catching it.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import re
import tarfile
from typing import Any

from cloudshards.redact import redact_url

__all__ = [
    "CacheError",
    "CloudShardsError",
    "ConfigError",
    "DecodeError",
    "ShardError",
    "ShardFormatError",
    "ShardNotFoundError",
    "ShardOpenError",
    "StateMismatchError",
    "UnsupportedError",
]


class CloudShardsError(Exception):
    """Base class of every error cloudshards raises on purpose."""


class ConfigError(CloudShardsError, ValueError):
    """An argument, URL or environment setting is invalid; the message says which and why."""


class UnsupportedError(ConfigError, NotImplementedError):
    """A webdataset name that cloudshards leaves out on purpose; the message says what to use."""


class ShardError(CloudShardsError):
    """A problem with one shard.

    Attributes:
        url: The shard URL, redacted (no credentials, no query string).
        shard_index: Position of the shard in the epoch's shard list, when known.
        offset: Byte offset in the (uncompressed) shard stream, when known.
        member: Name of the tar member involved, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        shard_index: int | None = None,
        offset: int | None = None,
        member: str | None = None,
    ) -> None:
        if url is None and offset is None and member is None:
            message, url, offset, member = _from_worker(message)
        self.url = redact_url(url) if url is not None else None
        self.shard_index = shard_index
        self.offset = offset
        self.member = member
        self.reason = message
        super().__init__(self._format())

    def name_member(self, member: str | None) -> None:
        """Name the tar member involved, where none is named yet (in the message too)."""
        if self.member is None and member is not None:
            self.member = member
            self.args = (self._format(), *self.args[1:])

    def _format(self) -> str:
        parts = [self.reason]
        where = []
        if self.url is not None:
            where.append(f"shard {self.url}")
        if self.member is not None:
            where.append(f"member {shown_name(self.member)}")
        if self.offset is not None:
            where.append(f"byte offset {self.offset}")
        if where:
            parts.append("(" + ", ".join(where) + ")")
        return " ".join(parts)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep errors picklable across DataLoader worker boundaries with all their fields.
        return (
            _rebuild_shard_error,
            (
                type(self),
                self.reason,
                self.url,
                self.shard_index,
                self.offset,
                self.member,
                {k: v for k, v in self.__dict__.items() if k != "received"},  # a part's bytes
            ),
        )


#: torch re-raises an error of a DataLoader worker as ``type(text)``, ``text`` its traceback
#: ("Caught ShardOpenError in DataLoader worker process 0. Original Traceback ..."): the
#: fields are read back from the error's own message, the traceback's last line.
_WORKER_TEXT = "Original Traceback (most recent call last)"
_WHERE = re.compile(r" \(shard (\S+?)(?:, member (.+?))?(?:, byte offset (\d+))?\)$")


def _from_worker(text: str) -> tuple[str, str | None, int | None, str | None]:
    """(reason, url, offset, member) of an error torch re-raised from a DataLoader worker;
    ``text`` and no fields for any other message."""
    found = _WHERE.search(text.rstrip("\n")) if _WORKER_TEXT in text else None
    if not text.startswith("Caught ") or found is None:
        return text, None, None, None
    url, shown, offset = found.groups()
    member = shown
    with contextlib.suppress(ValueError, SyntaxError):  # a long name shown cut: as shown
        member = None if shown is None else str(ast.literal_eval(shown))
    return text[: found.start()], url, None if offset is None else int(offset), member


def _rebuild_shard_error(
    cls: type[ShardError],
    message: str,
    url: str | None,
    shard_index: int | None,
    offset: int | None,
    member: str | None,
    state: dict[str, Any],
) -> ShardError:
    exc = cls.__new__(cls)
    exc.__dict__.update(state)
    Exception.__init__(exc, exc._format())
    if isinstance(exc, ShardNotFoundError):
        exc.errno, exc.strerror, exc.filename = errno.ENOENT, message, url
    return exc


class ShardOpenError(ShardError, OSError):
    """A shard could not be opened or read: missing object, bad credentials, network failure."""

    #: The bytes of a failed ranged read that arrived before it failed, from its start: the
    #: reader hands them on before it raises (the samples before a cut are not lost).
    received: bytes = b""


class ShardNotFoundError(ShardOpenError, FileNotFoundError):
    """The shard does not exist (a missing file or object, HTTP 404). Also a
    ``FileNotFoundError``, which is what webdataset code catches (webdataset lets ``open``
    or fsspec raise it), with its ``errno`` (``ENOENT``), ``strerror`` and ``filename`` (the
    redacted URL) set as ``open`` sets them."""

    def __init__(self, message: str, **where: Any) -> None:
        super().__init__(message, **where)
        self.errno, self.strerror, self.filename = errno.ENOENT, message, self.url

    def __str__(self) -> str:
        return self._format()  # not OSError's "[Errno 2] ...: 'filename'"


class ShardFormatError(ShardError, tarfile.ReadError, OSError, ValueError):
    """A shard is not a valid tar stream: truncated, corrupt header, bad gzip, duplicate field.

    Also a ``tarfile.ReadError`` and an ``OSError`` (what webdataset code catches around
    ``tarfile``), and a ``ValueError``; ``OSError`` and ``ValueError`` combine as in
    ``io.UnsupportedOperation``.
    """

    #: True once the pipeline's error handler was asked about this error and said stop (a
    #: duplicated member, asked where it was found): the reader does not ask again.
    handled: bool = False


class DecodeError(ShardError, ValueError):
    """A field of a sample could not be decoded. Also webdataset's ``DecodingError``.

    Built as cloudshards builds it, ``DecodeError(message, url=, key=, field=)``, or as
    webdataset builds ``DecodingError``: ``(url, key, k, sample)``, positionally or by keyword.
    A lone positional argument is the message unless ``k=`` is given too (then it is the URL).

    Attributes:
        key: The sample's ``__key__``.
        field: The field (extension) that failed, e.g. ``"jpg"``; also named ``k``.
        sample: The sample as the decoder received it (undecoded), when the decoder raised
            this error; else None.
    """

    def __init__(
        self,
        *args: Any,
        url: str | None = None,
        key: str | None = None,
        field: str | None = None,
        k: str | None = None,
        sample: Any = None,
        shard_index: int | None = None,
    ) -> None:
        if len(args) >= 2 or (args and k is not None):
            # webdataset's positional form: DecodingError(url, key, k, sample).
            url, key, k, sample = _webdataset_args(args, url=url, key=key, k=k, sample=sample)
            args = ()
        if k is not None:
            if field is not None and field != k:
                raise TypeError(f"field={field!r} and k={k!r} name different fields")
            field = k
        if args:
            message = args[0]
        else:
            message = "decoding failed" if field is None else f"cannot decode field {field!r}"
        self.key = key
        self.field = field
        self.sample = sample
        super().__init__(message, url=url, shard_index=shard_index, member=_member(key, field))

    @property
    def k(self) -> str | None:
        """The failing field, under webdataset's ``DecodingError.k`` name."""
        return self.field


def _webdataset_args(args: tuple[Any, ...], **given: Any) -> tuple[Any, ...]:
    """Match webdataset's ``(url, key, k, sample)`` to positional and keyword arguments,
    raising TypeError where Python would."""
    names = ("url", "key", "k", "sample")
    if len(args) > len(names):
        raise TypeError(f"DecodingError takes at most 4 positional arguments ({len(args)} given)")
    for name, value in zip(names, args, strict=False):
        if given[name] is not None:
            raise TypeError(f"DecodingError got multiple values for argument {name!r}")
        given[name] = value
    return tuple(given[name] for name in names)


#: Characters of a member's name an error message shows (a tar name may be 1 MiB long).
NAME_SHOWN = 200


def shown_name(name: str) -> str:
    """``repr(name)``, its middle cut out past :data:`NAME_SHOWN` characters (the whole name
    stays in ``.member``)."""
    if len(name) <= NAME_SHOWN:
        return repr(name)
    half = NAME_SHOWN // 2
    return f"{name[:half]!r}...({len(name) - 2 * half:,} characters)...{name[-half:]!r}"


def _member(key: str | None, field: str | None) -> str | None:
    if key is None:
        return None
    return f"{key}.{field}" if field else key


class CacheError(CloudShardsError, OSError):
    """The node cache could not be used (bad directory, lock failure)."""


class StateMismatchError(CloudShardsError, ValueError):
    """A saved state does not belong to this dataset or configuration."""
