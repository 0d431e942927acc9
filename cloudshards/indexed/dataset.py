"""``IndexedDataset``: random access to indexed samples, one ranged GET or one ``pread`` from
the node cache per sample.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import torch.utils.data

from cloudshards import config
from cloudshards.cache import ShardCache
from cloudshards.errors import ConfigError, ShardError, ShardFormatError, ShardOpenError
from cloudshards.handlers import as_handler, reraise_exception
from cloudshards.indexed.format import DatasetIndex, IndexedSample, ShardIndex
from cloudshards.indexed.read import (
    STALE_HINT,
    OpenFile,
    ProcessState,
    ShardChangedError,
    check_length,
    checked,
    parse_sample,
)
from cloudshards.indexed.spec import as_index
from cloudshards.process import PerProcess, freeze_inherited_objects
from cloudshards.redact import redact_url
from cloudshards.source import (
    EntrySource,
    FetchOptions,
    OpenOptions,
    PartStream,
    RangeIgnoredError,
    ShardSource,
    ShardStream,
    is_local_file,
    open_local_fd,
    open_source,
    process_stats,
    read_range,
)
from cloudshards.types import ExceptionHandler, Sample
from cloudshards.workerpipe import serve_plain_dataloaders

__all__ = ["IndexedDataset"]

logger = logging.getLogger(__name__)
serve_plain_dataloaders()  # importing the module (to make or to unpickle a dataset)

#: Samples tried in place of one that failed, when the handler lets it pass.
MAX_SUBSTITUTES = 16
#: How long this process passes over a shard that could not be read (missing, denied, its
#: retries spent) before it tries it again.
BAD_SHARD_S = 60.0


class IndexedDataset(torch.utils.data.Dataset[Any]):
    """Random access to the samples of WebDataset shards through a tar index.

    ``dataset[i]`` is the i-th sample in shard order, the same dict the streaming reader
    yields (``__key__``, ``__url__``, one bytes value per field), passed through ``transform``.
    Without a cache it costs one ranged GET of the sample's bytes. With ``cache_dir`` the
    whole shard is downloaded into the node cache on first touch (once per node, shared with
    :class:`~cloudshards.WebDataset`'s cache) and samples are read from the file; pair it with
    :class:`DistributedChunkedSampler`, which keeps each rank on a few shards at a time.
    Local shards are always read from their files.

    Thread-safe, and safe in forked DataLoader workers (each process opens its own files and
    connections). ``__getitems__`` (used by DataLoader for whole batches) and
    :meth:`get_many` read samples concurrently on a thread pool; :meth:`close` stops it.

    Args:
        index_or_urls: A :class:`DatasetIndex`, the URL of an index file (``*.json`` or
            ``*.json.gz``), or a shard spec; for a spec the default index next to the shards
            (:func:`default_index_url`) is used if it lists them, else the shards are scanned
            now (slow: save an index with ``cloudshards index``).
        storage_options: fsspec options, per protocol or flat.
        cache_dir: Node cache directory (default ``CLOUDSHARDS_CACHE_DIR``); whole shards.
        cache_size: Cache byte budget (default ``CLOUDSHARDS_CACHE_SIZE``; None: no limit).
        transform: Applied to each sample dict, e.g. a :class:`~cloudshards.Decoder`.
        handler: What a sample that cannot be read does (:class:`~cloudshards.ShardError`):
            ``reraise_exception`` (default) raises; a handler that returns instead (``"warn"``,
            ``"skip"``, ``warn_and_continue``) has it replaced by the next sample that can be
            read (of the next shard, when its shard cannot be read), so every index still
            returns a sample (at most 16 tries).
        max_workers: Threads of :meth:`get_many` / ``__getitems__``.
        allow_external_shards: Accept an index file whose shards lie outside its own location
            (another host, bucket or directory, an absolute local path); only for an index you
            trust. A :class:`DatasetIndex` object is never checked: your code made or loaded it.

    Raises:
        ConfigError: Bad arguments, an index file of another format version, or one that lists
            a shard outside its location.
        ShardFormatError: The index file is inconsistent (byte ranges no tar could have).
        ShardOpenError: The index (or, when scanning, a shard) cannot be read.
    """

    def __init__(
        self,
        index_or_urls: DatasetIndex | str | Iterable[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_size: int | None = None,
        transform: Callable[[Sample], Any] | None = None,
        handler: ExceptionHandler | str = reraise_exception,
        max_workers: int = 16,
        allow_external_shards: bool = False,
    ) -> None:
        if max_workers < 1:
            raise ConfigError(f"max_workers must be >= 1, got {max_workers}")
        if transform is not None and not callable(transform):
            raise ConfigError(f"transform must be callable, got {transform!r}")
        self.index = as_index(index_or_urls, storage_options, allow_external_shards)
        self.storage_options = storage_options
        directory = cache_dir if cache_dir is not None else config.cache_dir_default()
        budget = cache_size if cache_size is not None else config.cache_size_default()
        self.cache = ShardCache(directory, max_bytes=budget) if directory is not None else None
        self.transform = transform
        self.handler = as_handler(handler)
        self.max_workers = max_workers
        self.options = OpenOptions(storage_options=storage_options)
        self.fetch = FetchOptions.from_env()
        self._max_member_bytes = self.options.member_limit()
        self._state: PerProcess[ProcessState] = PerProcess(ProcessState)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # Threads, files and locks never cross a pickle (nor a fork: see PerProcess).
        state["_state"] = PerProcess(ProcessState)
        return state

    def __len__(self) -> int:
        return self.index.num_samples

    def shard_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` sample index range of each shard (for locality-aware samplers)."""
        return self.index.shard_ranges()

    def __getitem__(self, index: int) -> Any:
        freeze_inherited_objects()  # in a DataLoader worker: see its docstring
        size = len(self)
        position = int(index)
        if position < 0:
            position += size
        if not 0 <= position < size:
            raise IndexError(f"sample index {index} out of range for {size} samples")
        state = self._process()
        for attempt in range(MAX_SUBSTITUTES + 1):
            shard, within = self.index.locate(position)
            bad = state.bad_shards
            error: ShardError | None = self._passed_over(shard, within, bad) if bad else None
            read = error is None
            if read:
                try:
                    sample = self.read_sample(position)
                    return sample if self.transform is None else self.transform(sample)
                except ShardError as exc:
                    error = exc
            assert error is not None
            self.handler(error)  # raises, or lets a substitute stand in
            whole_shard = isinstance(error, (ShardOpenError, ShardChangedError))
            if read and whole_shard:
                state.bad_shards[shard] = (time.monotonic() + BAD_SHARD_S, error.reason)
            state.count("skipped")
            if attempt == MAX_SUBSTITUTES:
                raise error
            if whole_shard:
                # The shard cannot be read (its other samples would fail alike, each after its
                # retries, or it is not the shard indexed): a substitute from the next shard;
                # this one is passed over a while.
                position = self._next_readable(shard, position, state.bad_shards)
            else:
                position = (position + 1) % size  # the bytes of this sample: the next one
        raise AssertionError("unreachable")

    def _passed_over(
        self, shard: int, within: int, bad: dict[int, tuple[float, str]]
    ) -> ShardOpenError | None:
        """The error of sample ``within`` of ``shard`` if the shard failed within
        :data:`BAD_SHARD_S`."""
        until, reason = bad.get(shard, (0.0, ""))
        if until <= time.monotonic():
            return None
        entry = self.index.shards[shard].sample(within)
        return ShardOpenError(
            f"{reason} (not asked for again within {BAD_SHARD_S:.0f} s)",
            url=self.index.shards[shard].url,
            shard_index=shard,
            offset=entry.start,
            member=entry.members[0].name,
        )

    def _next_readable(self, shard: int, position: int, bad: dict[int, tuple[float, str]]) -> int:
        """The first sample of the first shard after ``shard`` (``position``'s) that is not
        marked as unreadable (``bad``, until a time); the next sample if all are."""
        shards = self.index.shards
        now = time.monotonic()
        for step in range(1, len(shards)):
            candidate = (shard + step) % len(shards)
            if shards[candidate].num_samples and bad.get(candidate, (0.0, ""))[0] <= now:
                return self.index.shard_ranges()[candidate][0]
        return (position + 1) % len(self)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch of samples, read concurrently (DataLoader calls this for each batch)."""
        return self.get_many(indices)

    def get_many(self, indices: Iterable[int], *, max_workers: int | None = None) -> list[Any]:
        """Samples at ``indices``, in order, read on up to ``max_workers`` threads."""
        indices = list(indices)
        workers = self.max_workers if max_workers is None else max_workers
        if len(indices) <= 1 or workers <= 1 or self._on_disk(indices):
            return [self[i] for i in indices]
        return list(self._process().pool(workers).map(self.__getitem__, indices))

    def _on_disk(self, indices: list[int]) -> bool:
        # Reads from open files take microseconds: threads would only add GIL contention.
        opened = self._process().files
        size = len(self)
        return all(self.index.locate(i % size)[0] in opened for i in indices)

    def read_sample(self, index: int) -> Sample:
        """The raw sample at ``index`` (no transform, no handler).

        Raises:
            ShardOpenError: The shard cannot be read (missing, denied, network), naming the
                shard URL (redacted) and the sample's first member.
            ShardFormatError: The bytes do not match the index (the shard changed).
        """
        position, within = self.index.locate(index)
        shard = self.index.shards[position]
        entry = shard.sample(within)
        try:
            data = self._fetch(position, shard, entry)
            return parse_sample(data, shard, entry, position, self._max_member_bytes)
        except (ShardOpenError, ShardFormatError) as exc:
            if exc.member is not None and exc.shard_index is not None:
                raise
            kind: type[ShardError] = ShardFormatError
            if isinstance(exc, (ShardOpenError, ShardChangedError)):  # whole-shard failures
                kind = ShardOpenError if isinstance(exc, ShardOpenError) else ShardChangedError
            error = kind(
                exc.reason,
                url=shard.url,
                shard_index=position,
                offset=entry.start if exc.offset is None else exc.offset,
                member=entry.members[0].name,
            )
            raise error from exc

    def _fetch(self, position: int, shard: ShardIndex, entry: IndexedSample) -> bytes:
        state = self._process()
        length = entry.end - entry.start
        if self.cache is not None or is_local_file(shard.url):
            handle = state.acquire(position, lambda: self._open_file(position, shard))
            if handle is not None:
                try:
                    data = os.pread(handle.fd, length, entry.start)
                finally:
                    state.release(handle)
                state.count("disk_reads")
                return check_length(data, length, shard, position)
        try:
            data = read_range(
                shard.url, self.options, entry.start, entry.end, fetch=self.fetch,
                stats=process_stats(),
            )  # fmt: skip
        except RangeIgnoredError as exc:
            if len(exc.body) != shard.size:
                raise ShardChangedError(
                    f"server ignored Range and sent {len(exc.body)} bytes; the index says "
                    f"{shard.size} ({STALE_HINT})",
                    url=shard.url,
                ) from None
            state.warn_once(
                f"{redact_url(shard.url)}: the server ignores Range requests; every sample "
                "downloads its whole shard (use cache_dir= to download each shard once)"
            )
            data = exc.body[entry.start : entry.end]
        state.count("ranged_gets")
        return check_length(data, length, shard, position)

    def _open_file(self, position: int, shard: ShardIndex) -> OpenFile | None:
        """Open a local shard or its cache entry (downloading it first); None: no file."""
        if is_local_file(shard.url):
            fd = open_local_fd(shard.url, self.options, position)
            return checked(OpenFile(fd, lambda: os.close(fd)), shard, position)
        assert self.cache is not None
        if not self.cache.keeps(shard.size):  # known from the index: no download to find out
            self._warn_not_kept()
            return None
        with cf.ThreadPoolExecutor(self.fetch.concurrency, "cloudshards-indexed-dl") as pool:
            stream = self._open_cached(position, shard, pool)
            if not isinstance(stream, PartStream) and not _is_file(stream):
                # A miss (we download) or another process's download (we follow): read it
                # to the end, which commits the entry, then open the entry.
                try:
                    while stream.read(4 << 20):
                        pass
                finally:
                    stream.close()
                stream = self._open_cached(position, shard, pool)
            if not _is_file(stream):
                # Streamed without being kept (the budget full of entries in use, disk full).
                stream.close()
                self._warn_not_kept()
                return None
        fd = stream.fileno()
        return checked(OpenFile(fd, stream.close), shard, position)

    def _warn_not_kept(self) -> None:
        self._process().warn_once(
            "cache: a shard was not kept (over the budget, or it is full, or the disk is); "
            "reading its samples with ranged GETs instead"
        )

    def _open_cached(
        self, position: int, shard: ShardIndex, pool: cf.ThreadPoolExecutor
    ) -> ShardSource:
        assert self.cache is not None

        def check_size(size: int) -> None:
            # One metadata request per download: refuse a shard that changed size.
            if size != shard.size:
                raise ShardChangedError(
                    f"shard is {size} bytes, the index says {shard.size} ({STALE_HINT})",
                    url=shard.url,
                    shard_index=position,
                )

        return open_source(
            shard.url,
            self.options,
            fetch=self.fetch,
            cache=self.cache,
            shard_index=position,
            executor=pool,
            size=shard.size,
            check_size=check_size,
        )

    def _process(self) -> ProcessState:
        return self._state.get()

    def stats(self) -> dict[str, dict[str, float]]:
        """This process's counters: ``indexed`` (ranged_gets, disk_reads, skipped), ``io``
        (requests, retries, bytes...) and, with a cache, ``cache`` (hits, misses...)."""
        result: dict[str, dict[str, float]] = {
            "indexed": dict(self._process().counters),
            "io": process_stats().as_dict(),
        }
        if self.cache is not None:
            result["cache"] = dict(self.cache.stats.as_dict())
        return result

    def close(self) -> None:
        """Stop the reading threads and close open shard files (reopened on next use)."""
        state = self._state.pop()
        if state is not None:
            state.close()

    def __enter__(self) -> IndexedDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _is_file(stream: ShardSource) -> TypeGuard[EntrySource]:
    # A complete cache entry: a ShardStream over a real file.
    return isinstance(stream, ShardStream) and hasattr(stream, "fileno")
