"""webdataset 1.0.2's ``webdataset.tariterators``: shards -> opened streams -> files -> samples.

``url_opener`` opens through cloudshards (any fsspec URL, prefetch, ranged reads, retries, the
node cache named by ``CLOUDSHARDS_CACHE_DIR``/``WDS_CACHE``); ``tar_file_iterator`` runs on
cloudshards' tar reader. ``tar_file_expander`` follows webdataset 0.2.x: no ``{}`` end-of-shard
marker unless ``eof_value={}`` (1.0.2's marker breaks programs that group files themselves);
``group_by_keys`` ends a sample at a new shard either way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import braceexpand

from cloudshards.grouping import make_name_filter, split_key
from cloudshards.handlers import reraise_exception
from cloudshards.source import OpenOptions
from cloudshards.stages.base import make_rng, pipelinefilter
from cloudshards.stages.read import env_cache, open_shards, read_shards
from cloudshards.tar import iter_members
from cloudshards.types import ExceptionHandler, NameFilter, Sample

__all__ = [
    "base_plus_ext",
    "group_by_keys",
    "meta_prefix",
    "meta_suffix",
    "reraise_exception",
    "shardlist",
    "tar_file_expander",
    "tar_file_iterator",
    "tarfile_samples",
    "tarfile_to_samples",
    "trace",
    "url_opener",
    "valid_sample",
]

#: webdataset's debugging switch; cloudshards logs at DEBUG instead.
trace = False
#: Top-level members named ``__...__`` are metadata and skipped.
meta_prefix = "__"
meta_suffix = "__"


def shardlist(urls: str | Iterable[str], *, shuffle: bool = False) -> Iterator[dict[str, Any]]:
    """Yield ``{"url": url}`` for each URL of a brace spec or list, shuffled if asked.

    The order is drawn when this is called (as the chain is built), not on the first item:
    a chain built again to restore a shuffle buffer then draws the same seed."""
    expanded = list(braceexpand.braceexpand(urls)) if isinstance(urls, str) else list(urls)
    if shuffle:
        make_rng("shardlist").shuffle(expanded)
    return ({"url": url} for url in expanded)


def base_plus_ext(path: str) -> tuple[str, str] | tuple[None, None]:
    """Split a member name into (key, extension) by webdataset's rule, or (None, None)."""
    result = split_key(path)
    return result if result is not None else (None, None)


def valid_sample(sample: Any) -> bool:
    """True for a non-empty dict sample not marked ``__bad__``."""
    return (
        sample is not None
        and isinstance(sample, dict)
        and len(sample) > 0
        and not sample.get("__bad__", False)
    )


def url_opener(
    data: Iterable[dict[str, Any]], handler: ExceptionHandler = reraise_exception, **kw: Any
) -> Iterator[dict[str, Any]]:
    """Add an open ``stream`` to each ``{"url": ...}`` dict, as webdataset's ``url_opener``.

    Shards open through cloudshards: any fsspec URL, remote shards prefetched and read with
    parallel ranged GETs and retries, and through the node cache when the environment names
    one (``CLOUDSHARDS_CACHE_DIR`` or ``WDS_CACHE``). Keyword arguments: ``storage_options``,
    ``allow_pipe``, ``cache`` (a :class:`~cloudshards.ShardCache`, overriding the
    environment), ``fetch`` (:class:`~cloudshards.source.FetchOptions`); webdataset's ``gopen``
    arguments (``bufsize``...) are accepted and ignored. A failing open goes to ``handler``.
    The consumer closes each stream (:func:`tar_file_expander` does).
    """
    options = OpenOptions(
        storage_options=kw.pop("storage_options", None), allow_pipe=kw.pop("allow_pipe", None)
    )
    cache = kw.pop("cache") if "cache" in kw else env_cache()
    shards = open_shards(
        data, handler=handler, options=options, cache=cache, fetch=kw.pop("fetch", None)
    )
    try:
        for shard, stream in shards:
            shard.update(stream=stream)
            yield shard
    finally:
        shards.close()


class _StopShard(Exception):
    """Raised inside the name filter when the handler says to stop reading the shard."""


_DEFAULT_SKIP_META = r"__[^/]*__($|/)"


def _member_filter(
    skip_meta: str | None,
    handler: ExceptionHandler,
    select_files: Callable[[str], bool] | None,
    rename_files: Callable[[str], str] | None,
) -> NameFilter:
    """webdataset's member rules; a failing ``select_files``/``rename_files`` goes to
    ``handler`` (True skips that member, False stops the shard)."""
    if skip_meta == _DEFAULT_SKIP_META and select_files is None and rename_files is None:
        return make_name_filter(None, None)
    skip = re.compile(skip_meta) if skip_meta is not None else None

    def name_filter(name: str) -> str | None:
        if "/" not in name and name.startswith("__") and name.endswith("__"):
            return None
        if skip is not None and skip.match(name):
            return None
        try:
            if rename_files is not None:
                name = rename_files(name)
            if select_files is not None and not select_files(name):
                return None
        except Exception as exn:
            if handler(exn):
                return None
            raise _StopShard from exn
        return name

    return name_filter


def tar_file_iterator(
    fileobj: Any,
    skip_meta: str | None = _DEFAULT_SKIP_META,
    handler: ExceptionHandler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield ``{"fname", "data"}`` for each regular file of an open tar (or tar.gz) stream.

    Runs on cloudshards' tar reader. As in webdataset, top-level ``__name__`` members and
    names matching ``skip_meta`` are skipped, then ``rename_files`` renames and
    ``select_files`` selects. A corrupt or truncated stream raises
    :class:`~cloudshards.ShardFormatError` (also a ``tarfile.ReadError``) through ``handler``.
    """
    url = getattr(fileobj, "url", None)
    name_filter = _member_filter(skip_meta, handler, select_files, rename_files)
    try:
        for member in iter_members(fileobj, url=url, name_filter=name_filter):
            yield {"fname": member.name, "data": member.data}
    except _StopShard:
        return
    except Exception as exn:
        if not handler(exn):
            return


def tar_file_expander(
    data: Iterable[dict[str, Any]],
    handler: ExceptionHandler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    eof_value: Any = None,
) -> Iterator[dict[str, Any]]:
    """Expand opened shards into ``{"fname", "data", "__url__"}`` file dicts.

    ``eof_value`` defaults to None: webdataset 0.2.x's behaviour, which programs that group
    files themselves rely on (1.0.2's ``{}`` end-of-shard marker breaks them). Pass ``{}`` to
    get 1.0.2's marker. A source's ``local_path`` becomes each file's ``__local_path__``.
    Each stream is closed when its shard is done.
    """
    for source in data:
        url = source["url"]
        stream = source["stream"]
        local_path = source.get("local_path")
        try:
            for sample in tar_file_iterator(
                stream, handler=handler, select_files=select_files, rename_files=rename_files
            ):
                sample["__url__"] = url
                if local_path is not None:
                    sample["__local_path__"] = local_path
                yield sample
            if eof_value is not None:
                yield eof_value
        except Exception as exn:
            if handler(exn):
                continue
            break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()


def group_by_keys(
    data: Iterable[dict[str, Any]],
    keys: Callable[[str], tuple[str | None, str | None]] = base_plus_ext,
    lcase: bool = True,
    suffixes: set[str] | None = None,
    handler: ExceptionHandler = reraise_exception,
) -> Iterator[Sample]:
    """Group consecutive file dicts with the same key into samples (webdataset's rules).

    A new shard (``__url__``) or a ``{}`` marker also ends a sample, so samples never span
    shards even without 1.0.2's end-of-shard markers. ``__local_path__`` is carried over.
    """
    current: Sample | None = None
    for filesample in data:
        try:
            if filesample == {}:
                if valid_sample(current):
                    yield current  # type: ignore[misc]
                current = None
                continue
            fname, value = filesample["fname"], filesample["data"]
            prefix, suffix = keys(fname)
            if prefix is None or suffix is None:
                continue
            if lcase:
                suffix = suffix.lower()
            url = filesample["__url__"]
            if current is None or prefix != current["__key__"] or url != current["__url__"]:
                if valid_sample(current):
                    yield current  # type: ignore[misc]
                current = {"__key__": prefix, "__url__": url}
            if suffix in current:
                raise ValueError(
                    f"{fname}: duplicate file name in tar file {suffix} {list(current.keys())}"
                )
            if suffixes is None or suffix in suffixes:
                current[suffix] = value
            local_path = filesample.get("__local_path__")
            if local_path is not None:
                current["__local_path__"] = local_path
        except Exception as exn:
            if handler(exn):
                continue
            break
    if valid_sample(current):
        yield current  # type: ignore[misc]


def tarfile_samples(
    src: Iterable[dict[str, Any]],
    handler: ExceptionHandler = reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
) -> Iterator[Sample]:
    """Turn a stream of ``{"url": ...}`` dicts into samples (open, read tar, group).

    Shards open as in :func:`open_shards` (prefetch, retries, the environment's node cache).
    """
    return read_shards(
        src,
        handler=handler,
        name_filter=make_name_filter(select_files, rename_files),
        cache=env_cache(),
    )


tarfile_to_samples = pipelinefilter(tarfile_samples)
