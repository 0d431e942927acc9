"""webdataset 1.0.2's ``webdataset.cache``: shard openers with and without a local cache.

``FileCache`` is cloudshards' node cache (:class:`cloudshards.ShardCache`: one download per
node, shared by all processes, streamed while it downloads, LRU by bytes) behind webdataset's
interface; ``StreamingOpen`` is :func:`url_opener`. ``LRUCleanup`` and ``get_filetype`` (which
runs the ``file`` command) are left out.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlparse

from cloudshards import config
from cloudshards.cache import ShardCache
from cloudshards.handlers import reraise_exception
from cloudshards.tar import GZIP_MAGIC
from cloudshards.webdataset._unsupported import unsupported_class, unsupported_function
from cloudshards.webdataset.gopen import gopen
from cloudshards.webdataset.tariterators import url_opener
from cloudshards.webdataset.utils import obsolete

__all__ = [
    "FileCache",
    "LRUCleanup",
    "StreamingOpen",
    "check_tar_format",
    "default_cache_dir",
    "default_cache_size",
    "download",
    "get_filetype",
    "islocal",
    "magic_filetype",
    "obsolete",
    "pipe_cleaner",
    "reraise_exception",
    "url_to_cache_name",
    "verbose_cache",
]

#: webdataset's defaults, from ``WDS_CACHE``, ``WDS_CACHE_SIZE`` and ``WDS_VERBOSE_CACHE``.
default_cache_dir = config.webdataset_var("WDS_CACHE", "./_cache")
default_cache_size = float(config.webdataset_var("WDS_CACHE_SIZE", "1e18"))
verbose_cache = int(config.webdataset_var("WDS_VERBOSE_CACHE", "0"))


def islocal(url: str) -> bool:
    """True for local paths and ``file:`` URLs."""
    return urlparse(url).scheme in ("", "file")


def magic_filetype(fname: str) -> str:
    """``"<fname>: gzip compressed data"``, ``"...: POSIX tar archive"`` or ``"...: data"``."""
    with open(fname, "rb") as f:
        header = f.read(512)
    if header[:2] == GZIP_MAGIC:
        return f"{fname}: gzip compressed data"
    if len(header) > 261 and header[257:262] == b"ustar":
        return f"{fname}: POSIX tar archive"
    return f"{fname}: data"


def check_tar_format(fname: str) -> bool:
    """True when ``fname`` starts like a tar archive or gzip data."""
    ftype = magic_filetype(fname).lower()
    return "tar archive" in ftype or "gzip compressed" in ftype


get_filetype = unsupported_function(
    "cache.get_filetype", "it runs the file command; use cache.magic_filetype"
)


@obsolete
def pipe_cleaner(spec: str) -> str:
    """The URL inside a ``pipe:`` command (obsolete in webdataset: needs ``ALLOW_OBSOLETE=1``)."""
    if spec.startswith("pipe:"):
        for word in spec[5:].split(" "):
            if re.match("^(https?|hdfs|gs|ais|s3):", word):
                return word
    return spec


def url_to_cache_name(url: str, ndir: int = 0) -> str:
    """webdataset's cache file name: the last ``ndir + 1`` path components (or a quoted URL).

    cloudshards' own cache names entries by a hash of the whole URL instead, so two buckets'
    ``train-0000.tar`` never collide.
    """
    parsed = urlparse(url)
    if parsed.scheme in ("", "file", "http", "https", "ftp", "ftps", "gs", "s3", "ais"):
        directories = parsed.path.lstrip("/").split("/")
        return "/".join(directories[-1 - ndir :])
    return urllib.parse.quote(url, safe="_+{}*,-")[-128:]


LRUCleanup = unsupported_class(
    "cache.LRUCleanup",
    "the node cache evicts least recently used shards itself: pass cache_size=BYTES to "
    "WebDataset, or use cloudshards.ShardCache(directory, max_bytes=...)",
)


def download(url: str, dest: str, chunk_size: int = 1024**2, verbose: bool = False) -> None:
    """Copy ``url`` to the local file ``dest`` (through a temporary name)."""
    temp = dest + f".temp{os.getpid()}"
    with gopen(url) as stream, open(temp, "wb") as f:
        while data := stream.read(chunk_size):
            f.write(data)
    os.replace(temp, dest)


def _shard_dicts(urls: Iterable[Any]) -> Iterator[dict[str, Any]]:
    for url in urls:
        yield {"url": url["url"] if isinstance(url, dict) else url}


def _with_local_path(sources: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for source in sources:
        url = source["url"]
        result = {"url": url, "stream": source["stream"]}
        if islocal(url):
            result["local_path"] = urlparse(url).path
        yield result


class StreamingOpen:
    """Open each URL (or ``{"url": ...}``) as a stream: ``{"url", "stream"[, "local_path"]}``."""

    def __init__(
        self, verbose: bool = False, handler: Callable[[BaseException], bool] = reraise_exception
    ) -> None:
        self.verbose = verbose
        self.handler = handler

    def __call__(self, urls: Iterable[Any]) -> Iterator[dict[str, Any]]:
        return _with_local_path(url_opener(_shard_dicts(urls), handler=self.handler, cache=None))


class FileCache:
    """Open URLs through the node cache in ``cache_dir`` (default ``WDS_CACHE`` or ./_cache).

    Yields ``{"url", "stream"}`` (plus ``local_path`` for local files). ``url_to_name``,
    ``validator`` and ``cache_cleanup_interval`` are accepted and ignored: entries are named by
    a hash of the URL, checked as tar data while they are read, and evicted to stay within
    ``cache_size`` bytes (no limit when <= 0).
    """

    def __init__(
        self,
        cache_dir: str | None = None,
        *,
        url_to_name: Callable[[str], str] = url_to_cache_name,
        verbose: bool = False,
        validator: Callable[[str], bool] = check_tar_format,
        handler: Callable[[BaseException], bool] = reraise_exception,
        cache_size: int = -1,
        cache_cleanup_interval: int = 30,
    ) -> None:
        self.cache_dir = default_cache_dir if cache_dir is None else cache_dir
        self.url_to_name = url_to_name
        self.verbose = verbose
        self.validator = validator
        self.handler = handler
        self.cache = ShardCache(self.cache_dir, max_bytes=cache_size)

    def __call__(self, urls: Iterable[Any]) -> Iterator[dict[str, Any]]:
        return _with_local_path(
            url_opener(_shard_dicts(urls), handler=self.handler, cache=self.cache)
        )
