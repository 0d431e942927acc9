"""Where an index lives and how it is read and written: any fsspec URL, JSON or gzip JSON.

Part of :mod:`cloudshards.indexed`, which re-exports the public names.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from cloudshards.errors import ConfigError, ShardOpenError
from cloudshards.indexed.format import DatasetIndex, read_index
from cloudshards.indexed.location import entry_outside, parent_url, relative_entry, strip_query
from cloudshards.redact import caused_by, redact_url
from cloudshards.source import FetchOptions, map_backend_error, read_object, retry
from cloudshards.urls import protocol_of, resolve

__all__ = ["default_index_url", "load_index", "read_bytes", "write_index"]

logger = logging.getLogger(__name__)

_INDEX_SUFFIX = ".index.json"
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def default_index_url(urls: Sequence[str]) -> str:
    """Where ``cloudshards index`` writes by default: ``<dir of first shard>/<name>.index.json``.

    ``<name>`` is the shard names' common prefix without trailing digits and separators
    (``train-{000000..000099}.tar`` -> ``train.index.json``), or ``dataset`` when that is empty.
    """
    if not urls:
        raise ConfigError("no shard URLs to index")
    parent = parent_url(urls[0])
    stems = []
    for url in urls:
        base = strip_query(url).rsplit("/", 1)[-1]
        for suffix in _TAR_SUFFIXES:
            if base.endswith(suffix):
                base = base[: -len(suffix)]
                break
        stems.append(base)
    # A string prefix, not a path: train-000000 and train-000001 share "train-00000".
    name = os.path.commonprefix(stems).rstrip("0123456789-_.") or "dataset"  # noqa: RUF071
    return f"{parent}/{name}{_INDEX_SUFFIX}"


def load_index(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    allow_external_shards: bool = False,
) -> DatasetIndex:
    """Read an index written by :func:`write_index` (or ``cloudshards index``) from any URL.

    Relative shard URLs in the file are resolved against the index's own location, and every
    shard must lie inside it: the same protocol and host or bucket, under the index's
    directory. An index that points elsewhere could send reads (with the credentials in
    ``storage_options``) to another host, or return local files as samples.

    Args:
        url: The index file.
        storage_options: fsspec options, per protocol or flat.
        allow_external_shards: Accept shards anywhere (another host, bucket or directory, an
            absolute local path): only for an index you trust.

    Raises:
        ShardOpenError: The index cannot be read (missing, denied, network).
        ConfigError: The file is not a cloudshards index, has another format version, or lists
            a shard outside its location.
        ShardFormatError: The file is corrupt or inconsistent.
    """
    data = read_bytes(url, storage_options)
    if data is None:
        raise ShardOpenError("index not found; build it with `cloudshards index`", url=url)
    return read_index(data, url, allow_external_shards=allow_external_shards)


def read_bytes(url: str, storage_options: Mapping[str, Any] | None) -> bytes | None:
    """The whole object at ``url``, or None when it does not exist."""
    try:
        return retry(
            lambda: read_object(url, storage_options),
            url=url,
            offset=0,
            options=FetchOptions.from_env(),
        )
    except ShardOpenError as exc:
        if caused_by(exc, FileNotFoundError):
            return None
        raise


def write_index(
    index: DatasetIndex, url: str, storage_options: Mapping[str, Any] | None = None
) -> DatasetIndex:
    """Write ``index`` as JSON to any fsspec URL (gzip-compressed when ``url`` ends in ``.gz``).

    Shard URLs below the index's directory are stored relative to it, so the shards and their
    index can move together. Shards elsewhere are stored as given, and readers then need
    ``allow_external_shards=True`` (a warning says so). Local files are written to a temporary
    name and renamed into place; object stores publish an object atomically when its single
    upload completes.

    Returns:
        The same index, with ``url`` set to where it was written.

    Raises:
        ShardOpenError: The store refused the write.
    """
    payload = json.dumps(index.to_json(url), separators=(",", ":")).encode()
    if strip_query(url).endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    fs, path = resolve(url, storage_options)
    try:
        if protocol_of(url) == "file":
            _write_local(path, payload)
        else:
            fs.pipe_file(path, payload)
    except Exception as exc:  # any backend failure, e.g. NotImplementedError on http://
        raise map_backend_error(exc, url, action="cannot write index") from exc
    logger.debug("wrote index of %d shards to %s", len(index.shards), redact_url(url))
    outside = [s.url for s in index.shards if entry_outside(relative_entry(s.url, url), url)]
    if outside:
        logger.warning(
            "%d of the %d shards in %s lie outside its directory (first: %s); readers must pass "
            "allow_external_shards=True to load it",
            len(outside),
            len(index.shards),
            redact_url(url),
            redact_url(outside[0]),
        )
    return DatasetIndex(index.shards, url)


def _write_local(path: str, payload: bytes) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
