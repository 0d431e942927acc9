"""One plain, unretried stream of a shard: a local file, a ``pipe:`` command's output, or
one streaming read of the store. The other openers of the package build on it."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from cloudshards.errors import ConfigError
from cloudshards.process import in_dataloader_worker
from cloudshards.redact import redact_url
from cloudshards.source import local, remote, transport
from cloudshards.source.options import OpenOptions
from cloudshards.source.stream import ShardStream
from cloudshards.urls import PIPE_PREFIX

__all__ = ["gopen", "open_shard", "shard_size"]

# The logger's name from before the module moved: logging configurations name it.
logger = logging.getLogger("cloudshards.io")


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
    if local.is_local(url):
        raw = local.open_local(url, options, shard_index)
    else:
        raw = transport.open_stream(url, options, shard_index)
    logger.debug("opened %s in %.3fs", redact_url(url), time.perf_counter() - start)
    return ShardStream(raw, url, shard_index=shard_index)


def shard_size(url: str, options: OpenOptions | None = None) -> int | None:
    """Return a shard's size in bytes (None when the store does not say).

    Raises:
        ShardOpenError: The object is missing or cannot be reached.
    """
    options = options or OpenOptions()
    if url.startswith(PIPE_PREFIX):
        return None
    return transport.object_size(url, options)


def gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """Open a URL for reading or writing, like webdataset's ``gopen`` (through fsspec).

    ``"rb"`` returns a :class:`ShardStream`; ``"wb"`` an fsspec file (closing it commits the
    object). ``"-"`` is stdin or stdout. ``pipe:`` URLs need ``allow_pipe=True``.
    """
    if mode not in ("rb", "wb"):
        raise ConfigError(f"gopen: mode must be 'rb' or 'wb', got {mode!r}")
    if url == "-":
        return sys.stdin.buffer if mode == "rb" else sys.stdout.buffer
    # Through fsspec outside a DataLoader worker (metadata a script reads before training): a
    # main process that used obstore would leave every DataLoader worker it forks without it.
    options = OpenOptions(
        storage_options=kw.get("storage_options"),
        allow_pipe=kw.get("allow_pipe"),
        obstore=in_dataloader_worker(),
    )
    if mode == "rb":
        return open_shard(url, options)
    if url.startswith(PIPE_PREFIX):
        raise ConfigError("gopen: writing to pipe: URLs is not supported")
    return remote.open_write(url, options.storage_options)
