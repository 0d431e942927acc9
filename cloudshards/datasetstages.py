"""The stages :class:`~cloudshards.WebDataset` chains after its shard list: this consumer's
share of the shards (or of the samples, balanced), reading them, and the empty-epoch check.

The classes keep their names: the state fingerprint names each stage by its class.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cloudshards.balance import assign_samples, counts_file, resolve_sample_counts, seen_file
from cloudshards.cache import ShardCache
from cloudshards.dist import WorkerInfo, derive_seed
from cloudshards.grouping import make_name_filter
from cloudshards.source import FetchOptions, OpenOptions
from cloudshards.stages.base import IterationContext, current_context, per_sample
from cloudshards.stages.read import read_shards
from cloudshards.types import ExceptionHandler

__all__ = ["_Counter", "_EmptyCheck", "_ShardReader", "_Split"]

logger = logging.getLogger(__name__)


@per_sample  # passes every sample on
class _EmptyCheck:
    """Raise when this worker's whole epoch produced no sample, with a message saying why."""

    #: The reader whose errors explain an empty epoch (None in checks pickled before it).
    reader: _ShardReader | None = None

    def __init__(self, num_shards: int, reader: _ShardReader | None = None) -> None:
        self.num_shards = num_shards
        self.reader = reader  # its errors explain an empty epoch better than a guess

    def __call__(self, source: Iterable[Any]) -> Iterator[Any]:
        return self._run(source)

    def _run(self, source: Iterable[Any]) -> Iterator[Any]:
        count = 0
        for sample in source:
            count += 1
            yield sample
        context = current_context()
        # (A count-free epoch hands out whole shards: a consumer's may all be empty, and its
        # ranks end the epoch together whatever each one holds.)
        if count == 0 and not (context is not None and (context.resumed or context.count_free)):
            info = WorkerInfo.detect()
            errors = getattr(self.reader, "errors", None)
            if errors is not None and errors.count:
                raise ValueError(
                    f"No samples found in dataset (rank {info.rank}/{info.world_size}, worker "
                    f"{info.worker}/{info.num_workers}): {errors.count} error(s) in this "
                    f"worker's shards went to the handler, the first: {errors.first}. Turn "
                    "this check off with empty_check=False."
                )
            raise ValueError(
                f"No samples found in dataset (rank {info.rank}/{info.world_size}, worker "
                f"{info.worker}/{info.num_workers}, {self.num_shards} shards for "
                f"{info.num_consumers} consumers); perhaps you have fewer shards than workers. "
                "Use more shards or fewer workers, resampled=True, or turn this check off "
                "with empty_check=False."
            )


class _Counter:
    """Samples per shard for balancing (picklable, for spawned DataLoader workers)."""

    def __init__(
        self,
        urls: list[str],
        options: OpenOptions,
        fetch: FetchOptions,
        cache: ShardCache | None,
        allow_external_shards: bool,
    ) -> None:
        self.urls = urls
        self.options = options
        self.fetch = fetch
        self.cache = cache
        self.allow_external_shards = allow_external_shards

    def __call__(self, counts: Any, count: bool = True) -> list[int] | None:
        """Samples per shard (None when ``count`` is False and only counting would tell)."""
        is_index = isinstance(counts, str) or hasattr(counts, "shards")
        return resolve_sample_counts(
            self.urls,
            counts=None if is_index else counts,
            index=counts if is_index else None,
            options=self.options,
            fetch=self.fetch,
            cache=self.cache,
            allow_external_shards=self.allow_external_shards,
            count=count,
        )


class _Split:
    """Stage: this consumer's shards of the epoch.

    Balanced (``drop``/``pad``, or ``auto`` with several ranks and no ``with_epoch``): a
    contiguous run of the epoch's samples, equal in length for every rank and worker (see
    :mod:`cloudshards.balance`). Otherwise the node and worker splitters, with a warning when
    some consumers get no shard at all.
    """

    def __init__(
        self,
        urls: list[str],
        nodesplitter: Callable[..., Any] | None,
        workersplitter: Callable[..., Any] | None,
        balance: str | None,
        sample_counts: Any,
        counter: Callable[..., list[int] | None],
        subsample: float | None = None,
        limit: int | None = None,
    ) -> None:
        self.urls = urls
        #: (fraction, count) of the epoch's samples to use, or None (see :meth:`limit`).
        self.sample_limit = None if subsample is None and limit is None else [subsample, limit]
        self.nodesplitter = nodesplitter
        self.workersplitter = workersplitter
        self.balance = balance
        self.sample_counts = sample_counts
        self._counter = counter
        self._counts: list[int] | None = None

    def mode(self, context: IterationContext | None) -> str | None:
        if self.balance != "auto":
            return self.balance
        if self.sample_limit is not None:
            return "drop"  # a subsample is a run of the epoch's sample sequence: counted
        if context is None or context.bounded or context.info.world_size < 2:
            return None
        if self.nodesplitter is None:
            # The user's "no node splitting" (webdataset's nodesplitter=None): each rank reads
            # every shard it was given, as on one node; its own split keeps its ranks equal.
            return None
        return "drop"

    def consumer(self, info: WorkerInfo) -> tuple[int, int]:
        """This consumer's index among those the epoch's samples are balanced over, and
        their number: ranks x workers, or only the kind whose splitter is not None (a rank
        with ``nodesplitter=None`` shares the epoch only among its own workers)."""
        ranks = (info.rank, info.world_size) if self.nodesplitter is not None else (0, 1)
        workers = (info.worker, info.num_workers) if self.workersplitter is not None else (0, 1)
        return ranks[0] * workers[1] + workers[0], ranks[1] * workers[1]

    def limit(self, total: int) -> int | None:
        """Samples of the epoch to use (``subsample``'s fraction of ``total``, at most
        ``limit``), or None for all."""
        if self.sample_limit is None:
            return None
        fraction, count = self.sample_limit
        result = total if fraction is None else int(fraction * total)
        return result if count is None else min(result, int(count))

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = self._counter(self.sample_counts)
        assert self._counts is not None
        return self._counts

    def known_counts(self) -> list[int] | None:
        """The samples per shard if something other than a counting pass tells them (an
        index, metadata, this node's counts file), else None."""
        if self._counts is None:
            self._counts = self._counter(self.sample_counts, False)
        return self._counts

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        context = current_context()
        mode = self.mode(context)
        info = context.info if context is not None else WorkerInfo.detect()
        if mode is not None and context is not None and context.count_free:
            # An epoch without counts (cloudshards.countfree): whole shards per rank and
            # worker, each read whole noting its count; the loader ends the epoch for all.
            return _noting(_split(src, self.nodesplitter, self.workersplitter), self.urls)
        if mode is not None:
            counts = self.counts()
            consumer, num_consumers = self.consumer(info)
            limit = self.limit(sum(counts))
            total = sum(counts) if limit is None else min(sum(counts), max(0, limit))
            drop_at = -1  # the last of its run
            if mode == "drop" and context is not None and total % num_consumers:
                # Which samples are left over moves each epoch (one shard's too); not a draw
                # of the random stages' sequence (their seeds stay as they were).
                seed = derive_seed(context.seed, context.epoch, context.repetition, consumer)
                drop_at = random.Random(seed).randrange(total)
            return assign_samples(
                src,
                dict(enumerate(counts)),
                consumer=consumer,
                num_consumers=num_consumers,
                mode=mode,
                limit=limit,
                drop_at=drop_at,
            )
        if len(self.urls) < info.num_consumers and self.nodesplitter is not None:
            logger.warning(
                "%d shards for %d consumers (%d ranks x %d workers): some get no shard and "
                "ranks get unequal numbers of samples; use fewer workers, more shards, "
                "balance='drop', or resampled=True with with_epoch()",
                len(self.urls),
                info.num_consumers,
                info.world_size,
                info.num_workers,
            )
        return _split(src, self.nodesplitter, self.workersplitter)


def _split(src: Iterable[Any], *splitters: Callable[..., Any] | None) -> Iterator[Any]:
    stream: Iterable[Any] = src
    for splitter in splitters:
        if splitter is not None:
            stream = splitter(stream)
    return iter(stream)


def _noting(shards: Iterator[dict[str, Any]], urls: list[str]) -> Iterator[dict[str, Any]]:
    """``shards``, each told where to note its count once read whole (see
    :func:`~cloudshards.balance.observe`)."""
    path, keys = counts_file(urls)
    where = seen_file(path)
    for shard in shards:
        yield {**shard, "observe": (where, keys[shard["shard_index"]])}


class _Errors:
    """How many errors went to a pass's handler, and the first of them (as text: an
    exception would keep its frames alive)."""

    def __init__(self) -> None:
        self.count = 0
        self.first = ""

    def note(self, exn: BaseException) -> None:
        self.count += 1
        if not self.first:
            try:
                self.first = f"{type(exn).__name__}: {exn}"
            except Exception:  # a message that cannot be made must not replace the error
                self.first = type(exn).__name__


class _ShardReader:
    """Stage: shard dicts in, samples out (open + tar + group), with the error handler.

    ``errors`` holds what the handler was asked about in the latest pass this process built.
    """

    def __init__(
        self,
        handler: ExceptionHandler,
        options: OpenOptions,
        select_files: Callable[[str], bool] | None,
        rename_files: Callable[[str], str] | None,
        cache: ShardCache | None,
        fetch: FetchOptions,
    ) -> None:
        self.fetch = fetch
        self.handler = handler
        self.options = options
        self.select_files = select_files
        self.rename_files = rename_files
        self.cache = cache

    #: Until a pass is built (and in a reader unpickled from an older state).
    errors = _Errors()

    def __call__(self, src: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        name_filter = make_name_filter(self.select_files, self.rename_files)
        errors = self.errors = _Errors()
        handler = self.handler

        def noting(exn: BaseException) -> bool:
            try:
                return handler(exn)
            finally:
                errors.note(exn)

        return read_shards(
            src,
            handler=noting,
            options=self.options,
            name_filter=name_filter,
            cache=self.cache,
            fetch=self.fetch,
        )
