"""Writing WebDataset shards to any fsspec URL: ``TarWriter`` and ``ShardWriter``.

Writes are atomic: a shard appears under its name only when its writer closes without error.
Local files go to a hidden temporary name in the same directory, then ``os.replace``; S3 and GCS
objects stream as multipart/resumable uploads that only a successful close completes.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import time
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO, Literal, cast

from cloudshards.encoders import make_encoder
from cloudshards.errors import ConfigError
from cloudshards.output import AtomicOutput, discard_upload
from cloudshards.redact import redact_url
from cloudshards.source import user_output
from cloudshards.types import Sample

__all__ = ["ShardWriter", "TarWriter"]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- writers


_TarMode = Literal["w|", "w|gz", "w|bz2", "w|xz"]


class TarWriter:
    """Write samples (dicts) into one tar file, one member per field: ``KEY.FIELD``.

    webdataset 1.0.2's ``TarWriter`` with the same arguments and encoders. Given a URL (local
    path, ``s3://``, ``gs://``, any fsspec URL), the shard appears only when :meth:`close`
    succeeds; leaving a ``with`` block by an exception, or dropping the writer unclosed,
    discards it. Given an open stream, the caller owns the stream. ``pipe:CMD`` writes into
    ``CMD``'s stdin (with the pipe opt-in, as when reading); discarding the shard kills
    ``CMD`` before its input ends.

    Differences from webdataset, on purpose: ``format`` is honoured (webdataset ignores it and
    writes PAX); the default mtime is a whole second, so members get no PAX header each (webdataset
    writes a float mtime and thus a 512-byte PAX header per member); an exception inside ``with``
    discards the shard instead of publishing a partial one.

    Args:
        fileobj: A URL or path (``.tgz``/``.tar.gz`` compress), or a binary stream to write to.
        user: Member owner name.
        group: Member group name.
        mode: Member permission bits.
        compress: True or ``"gz"``, ``"bz2"``, ``"xz"``; None guesses from the name.
        encoder: True (webdataset's encoders by extension), False (fields are bytes or str),
            a dict of extension -> function, or a function of the whole sample.
        keep_meta: Also write ``_``-prefixed fields other than ``__key__``.
        mtime: Member modification time; None means now (whole seconds).
        format: tarfile format (``tarfile.PAX_FORMAT`` or a name like ``"USTAR_FORMAT"``);
            default PAX, which only adds headers where ustar cannot hold a name or value.
        storage_options: Per-protocol fsspec options for URLs (``{"s3": {...}}``).
        allow_pipe: Allow a ``pipe:CMD`` URL, which runs ``CMD`` in a shell (default: the
            ``CLOUDSHARDS_ALLOW_PIPE`` environment variable, off when unset).

    Raises:
        ConfigError: Bad arguments, an unknown protocol, a missing backend package, or a
            ``pipe:`` URL without the opt-in.
        ShardOpenError: The store refused the write.
    """

    def __init__(
        self,
        fileobj: str | os.PathLike[str] | BinaryIO,
        user: str = "bigdata",
        group: str = "bigdata",
        mode: int = 0o444,
        compress: bool | str | None = None,
        encoder: Any = True,
        keep_meta: bool = False,
        mtime: float | None = None,
        format: Any = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        allow_pipe: bool | None = None,
    ) -> None:
        if isinstance(fileobj, os.PathLike):
            fileobj = os.fspath(fileobj)
        tar_format = getattr(tarfile, format, format) if format else tarfile.PAX_FORMAT
        if tar_format not in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
            raise ConfigError(f"unknown tar format {format!r}")
        tarmode = self.tarmode(fileobj, compress)  # a subclass may override it, as in webdataset
        self.encoder = make_encoder(encoder)
        url = fileobj if isinstance(fileobj, str) else None  # an opener in gopen_schemes wins
        self.own_fileobj: Any = (
            (user_output(url) or AtomicOutput(url, storage_options, allow_pipe=allow_pipe))
            if url
            else None
        )
        self.stream: Any = self.own_fileobj if self.own_fileobj is not None else fileobj
        # Streaming mode ("w|"): never seeks, so any upload stream works. Closed by close/abort.
        self.tarstream: Any = tarfile.open(  # noqa: SIM115
            fileobj=cast(Any, self.stream), mode=cast(Any, tarmode), format=tar_format
        )
        self.user, self.group, self.mode = user, group, mode
        self.keep_meta, self.mtime, self.compress = keep_meta, mtime, compress

    @staticmethod
    def tarmode(fileobj: Any, compress: bool | str | None = None) -> _TarMode:
        """webdataset's ``TarWriter.tarmode``: the streaming ``tarfile`` mode for writing to
        ``fileobj``: ``compress`` (True or ``"gz"``, ``"bz2"``, ``"xz"``; False for none), else
        from the ending of ``fileobj`` when it is a name (``.tgz``, ``.tar.gz``: ``"w|gz"``)."""
        name = fileobj if isinstance(fileobj, str) else ""
        if compress is False:
            return "w|"
        if compress is True or compress == "gz" or name.endswith("gz"):
            return "w|gz"
        if compress == "bz2" or name.endswith("bz2"):
            return "w|bz2"
        if compress == "xz" or name.endswith("xz"):
            return "w|xz"
        return "w|"

    def write(self, obj: Sample) -> int:
        """Encode and write one sample; fields are written in sorted order.

        Returns:
            The bytes of field data written (without tar headers).

        Raises:
            ConfigError: No ``__key__``, or a field that does not encode to bytes.
            ShardOpenError: The store failed; the shard is then unusable, abort it.
        """
        encoded = self.encoder(obj)
        if not isinstance(encoded, Mapping) or "__key__" not in encoded:
            raise ConfigError(f"a sample needs a __key__, got fields {sorted(obj)}")
        key = encoded["__key__"]
        members: list[tuple[str, bytes | bytearray | memoryview]] = []
        for field in sorted(encoded):
            if not field:  # a custom encoder's: the member would be named "KEY."
                raise ConfigError(f"sample {key!r} has a field without a name")
            if field == "__key__" or (field[0] == "_" and not self.keep_meta):
                continue
            value = encoded[field]
            if isinstance(value, str):
                value = value.encode("utf-8")
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ConfigError(
                    f"field {field!r} of sample {key!r} is {type(value).__name__} after "
                    "encoding, not bytes"
                )
            members.append((f"{key}.{field}", value))
        total = 0
        for name, value in members:
            info = tarfile.TarInfo(name)
            info.size = len(value)
            info.mtime = int(time.time()) if self.mtime is None else self.mtime
            info.mode, info.uname, info.gname = self.mode, self.user, self.group
            self.tarstream.addfile(info, io.BytesIO(value))
            total += info.size
        return total

    def close(self) -> None:
        """Finish the archive and, for a URL, publish it. Idempotent.

        Raises:
            ShardOpenError: The final upload or rename failed; nothing was published.
        """
        if self.tarstream.closed:
            return
        try:
            self.tarstream.close()
        except BaseException:
            self.abort()
            raise
        if self.own_fileobj is not None:
            self.own_fileobj.commit()

    def abort(self) -> None:
        """Stop without finishing the archive; a URL's shard is discarded. Idempotent."""
        # Mark the archive and its compressing stream closed: no end-of-archive blocks, and
        # no flush from tarfile's __del__ into a discarded output.
        self.tarstream.closed = self.tarstream.fileobj.closed = True
        if self.own_fileobj is not None:
            self.own_fileobj.abort()

    def __enter__(self) -> TarWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardWriter:
    """Write samples into numbered shards, starting a new one at ``maxcount`` samples or
    ``maxsize`` bytes of field data (webdataset 1.0.2's ``ShardWriter``).

    Each shard is a :class:`TarWriter` on ``pattern % shard_number``, so it is atomic: finished
    shards exist, the shard in progress appears only when it is finished. An exception inside a
    ``with`` block discards the shard in progress. A shard is opened at the first sample
    written to it, so no empty shard is left when nothing is written.

    Args:
        pattern: Shard URL with a ``%d``-style field, e.g. ``"s3://bucket/train-%06d.tar"``.
        maxcount: Most samples per shard.
        maxsize: Most bytes of field data per shard (checked before each sample, so a shard can
            exceed it by one sample).
        post: Called with each finished shard's name, after it is published.
        start_shard: Number of the first shard.
        verbose: Log each shard started (at INFO) when true.
        opener: Called with a shard name, returns the binary stream to write it to (then
            atomicity is the opener's business).
        **kw: Passed to :class:`TarWriter` (``encoder``, ``compress``, ``storage_options``...).

    Raises:
        ConfigError: A bad pattern or limit.
    """

    def __init__(
        self,
        pattern: str,
        maxcount: int = 100000,
        maxsize: float = 3e9,
        post: Callable[[str], Any] | None = None,
        start_shard: int = 0,
        verbose: int = 1,
        opener: Callable[[str], BinaryIO] | None = None,
        **kw: Any,
    ) -> None:
        try:
            pattern % start_shard
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"shard pattern {redact_url(pattern)!r} needs one %d-style field, "
                f"e.g. 'out-%06d.tar' ({exc})"
            ) from exc
        if maxcount < 1 or maxsize <= 0:
            raise ConfigError(f"maxcount and maxsize must be positive, got {maxcount}, {maxsize}")
        self.pattern, self.maxcount, self.maxsize = pattern, maxcount, maxsize
        self.post, self.verbose, self.opener, self.kw = post, verbose, opener, kw
        self.shard = start_shard
        self.tarstream: TarWriter | None = None
        self.fname: str | None = None
        self.total = self.count = self.size = 0
        #: Names of the shards finished so far, in order.
        self.written: list[str] = []

    def next_stream(self) -> None:
        """Finish the current shard and start the next one."""
        self.finish()
        self.fname = self.pattern % self.shard
        if self.verbose:
            logger.info("writing %s (%d samples so far)", redact_url(self.fname), self.total)
        self.shard += 1
        target = self.opener(self.fname) if self.opener is not None else self.fname
        self.tarstream = TarWriter(target, **self.kw)
        self.count = self.size = 0

    def write(self, obj: Sample) -> None:
        """Write one sample, starting a new shard first when the current one is full."""
        if self.tarstream is None or self.count >= self.maxcount or self.size >= self.maxsize:
            self.next_stream()
        assert self.tarstream is not None
        self.size += self.tarstream.write(obj)
        self.count += 1
        self.total += 1

    def finish(self) -> None:
        """Finish and publish the shard in progress, if any."""
        writer, self.tarstream = self.tarstream, None
        if writer is None or self.fname is None:
            return
        writer.close()
        if self.opener is not None:
            writer.stream.close()  # webdataset leaves the opener's stream open
        self.written.append(self.fname)
        if callable(self.post):
            self.post(self.fname)

    def close(self) -> None:
        """Finish the last shard. Idempotent."""
        self.finish()

    def abort(self) -> None:
        """Discard the shard in progress; finished shards stay. Idempotent."""
        writer, self.tarstream = self.tarstream, None
        if writer is not None:
            writer.abort()
            if self.opener is not None:
                _abandon(writer.stream)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _abandon(stream: Any) -> None:
    """Drop an opener's stream without committing it where the stream allows that."""
    if callable(getattr(stream, "discard", None)):
        discard_upload(stream)
    else:
        stream.close()
