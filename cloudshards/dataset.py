"""``WebDataset`` and ``WebLoader``: cloudshards' datasets, with webdataset 1.0.2's arguments.

``import cloudshards as wds`` runs code written for webdataset. Differences on purpose: shards
open through fsspec (``s3://``, ``gs://``, ``http(s)://`` and more work natively), ``pipe:``
needs ``allow_pipe=True``, shard shuffling is a seeded permutation that changes every epoch
(identical on all ranks), the default node splitter splits by rank instead of refusing
multi-node runs, and fluent methods return new pipelines instead of modifying their receiver.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any, cast

from torch.utils.data import DataLoader

from cloudshards import config
from cloudshards.balance import BALANCE_MODES
from cloudshards.cache import ShardCache
from cloudshards.countfree import CountFree
from cloudshards.datasetstages import _Counter, _EmptyCheck, _ShardReader, _Split
from cloudshards.errors import ConfigError
from cloudshards.handlers import as_handler, reraise_exception
from cloudshards.multishard import MultiShardSample
from cloudshards.pipeline import DataPipeline, FluidInterface
from cloudshards.process import SettledFork
from cloudshards.redact import redact_url
from cloudshards.shards import (
    ResampledShards,
    ShardList,
    own_splitters,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from cloudshards.source import FetchOptions, OpenOptions
from cloudshards.stages import elastic
from cloudshards.stages.batch import convert_batch
from cloudshards.types import ExceptionHandler

__all__ = ["WebDataset", "WebLoader"]

logger = logging.getLogger(__name__)

_DEFAULT_SPLITTERS = (split_by_node, split_by_worker, single_node_only)


class WebDataset(DataPipeline, FluidInterface):
    """Stream samples from WebDataset tar shards at any fsspec URL.

    Args:
        urls: Shard spec: braces (``s3://b/train-{000000..000999}.tar``), ``::``-joined specs,
            globs, or a list of URLs; or webdataset's dataset spec (a YAML file or a dict
            with ``datasets``, read by :class:`MultiShardSample`). Local paths, ``file://``,
            ``s3://``, ``gs://``, ``http(s)://`` and any fsspec protocol.
        handler: What a bad shard or sample does: a webdataset handler function
            (``reraise_exception``, ``warn_and_continue``...) or ``"raise"``/``"warn"``/``"skip"``.
        mode: ``"resampled"`` is the same as ``resampled=True``.
        resampled: Draw shards with replacement, endlessly (use ``with_epoch`` to cut epochs).
        repeat: Accepted for compatibility; ignored, as in webdataset 1.0.2.
        shardshuffle: Shuffle the shard order each epoch (True or a positive int; the int is
            webdataset's buffer size and any positive value gives a full permutation here).
        cache_size: Node cache budget in bytes; least recently used entries not in use are
            evicted (-1 or 0: no limit). Default ``CLOUDSHARDS_CACHE_SIZE``.
        cache_dir: Per-node shard cache directory, shared by every rank and worker on the
            machine: each shard crosses the network once per node. Default
            ``CLOUDSHARDS_CACHE_DIR`` (or webdataset's ``WDS_CACHE``); None streams uncached.
        url_to_name: Accepted for compatibility; ignored.
        detshuffle: Accepted for compatibility; shard shuffling is always deterministic.
        nodesplitter: Splits shards across ranks (default :func:`split_by_node`; None for none).
        workersplitter: Splits shards across DataLoader workers (default
            :func:`split_by_worker`; None for none).
        select_files: Keep only tar members whose (renamed) name passes this predicate.
        rename_files: Rename tar members before grouping.
        empty_check: Raise if a worker gets no samples at all in an epoch.
        verbose: Log the shard count at INFO level.
        seed: Base seed for shard order and shuffles (default ``CLOUDSHARDS_SEED``/``WDS_SEED``
            or 0); the same on every rank.
        storage_options: fsspec options per protocol, e.g. ``{"s3": {"endpoint_url": ...}}``,
            or one flat mapping for all; when absent the backends read their usual environment.
        allow_pipe: Allow ``pipe:CMD`` shard URLs, which run shell commands (off by default).
        block_bytes: Read size for streaming shards.
        prefetch: Remote shards fetched ahead of the one being read (default 2; 0 for none).
        part_bytes: Size of each ranged GET for remote shards (default 2 MiB).
        concurrency: Ranged GETs in flight per shard (default 16).
        retries: Retries of a failed request, with exponential backoff (default 5).
        stall_timeout_s: A request's try with no progress for this long is abandoned and
            retried like a cut one, keeping what arrived (default 120).
        balance: Equal epochs across ranks, so DDP never hangs on uneven shards: ``"drop"``
            gives every rank and worker exactly ``T // C`` samples of the ``T`` in the epoch
            (``C`` = ranks x workers; the ``T % C`` left over are skipped, a different few
            each epoch), ``"pad"`` gives ``ceil(T / C)`` (the consumers one short repeat a
            sample), None splits whole shards as webdataset does. ``"auto"`` (default) is
            ``"drop"`` when there are several ranks and no ``with_epoch``, else None.
        sample_counts: Samples per shard for balancing: an index (``cloudshards index``;
            its URL or a ``DatasetIndex``), a mapping URL -> count, or a list in shard order.
            Default: the index next to the shards if there is one, else counted once per
            node and remembered (``CLOUDSHARDS_COUNTS_DIR``, default ``~/.cache/cloudshards``).
        subsample: Use this fraction of each epoch's samples (0 < f <= 1): the first
            ``int(f * T)`` of the epoch's sample sequence (the shards in the epoch's order, so
            with ``shardshuffle`` a different subset of shards each epoch), split across ranks
            and workers as balanced epochs are; only those shards are read. Needs sample
            counts (``sample_counts`` or one counting pass per node).
        limit: Use at most this many samples of each epoch (over all ranks), as ``subsample``.
        allow_external_shards: Accept a ``sample_counts`` index file (or the one next to the
            shards) that lists shards outside its own location; only for an index you trust.
        rank: This process's rank, overriding detection (torch.distributed, then torchrun's
            ``RANK``/``WORLD_SIZE``, then SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``).
        world_size: The number of ranks, overriding detection likewise (give both).
        replication: Ranks per model-parallel group (tensor or sequence parallel), whose ranks
            are consecutive: each group's ranks get identical samples in the same order (also
            shuffled and balanced alike), the groups disjoint ones; the data-parallel rank is
            ``rank // replication`` of ``world_size // replication``. For groups laid out
            otherwise, pass the data-parallel ``rank`` and ``world_size`` instead.
        max_member_bytes: Largest tar member accepted (default ``CLOUDSHARDS_MAX_MEMBER_BYTES``
            or 1 GiB); a larger one is a ``ShardFormatError`` before any memory is allocated
            (a ``handler`` that continues loses that member's sample, not the shard).

    Raises:
        ConfigError: Bad URLs or options (unknown protocol, missing backend, empty expansion).
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        handler: ExceptionHandler | str = reraise_exception,
        mode: str | None = None,
        resampled: bool = False,
        repeat: bool = False,
        shardshuffle: bool | int | None = None,
        cache_size: int = -1,
        cache_dir: str | None = None,
        url_to_name: Callable[[str], str] | None = None,
        detshuffle: bool = False,
        nodesplitter: Callable[..., Any] | None = split_by_node,
        workersplitter: Callable[..., Any] | None = split_by_worker,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        empty_check: bool = True,
        verbose: bool = False,
        seed: int | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        allow_pipe: bool | None = None,
        block_bytes: int | None = None,
        max_member_bytes: int | None = None,
        prefetch: int | None = None,
        part_bytes: int | None = None,
        concurrency: int | None = None,
        retries: int | None = None,
        stall_timeout_s: float | None = None,
        balance: str | None = "auto",
        sample_counts: Any = None,
        allow_external_shards: bool = False,
        subsample: float | None = None,
        limit: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        replication: int = 1,
    ) -> None:
        super().__init__(seed=seed, rank=rank, world_size=world_size, replication=replication)
        handler = as_handler(handler)
        if mode not in (None, "resampled"):
            raise ConfigError(f"mode={mode!r} is not supported; use resampled=True or None")
        resampled = resampled or mode == "resampled"
        _check_urls(urls)
        # webdataset's hooks see the arguments as it passes them (a subclass may override them).
        args = SimpleNamespace(
            urls=urls, handler=handler, mode="resampled" if resampled else None,
            resampled=resampled, repeat=repeat, shardshuffle=shardshuffle,
            cache_size=cache_size, cache_dir=cache_dir, url_to_name=url_to_name,
            detshuffle=detshuffle, nodesplitter=nodesplitter, workersplitter=workersplitter,
            select_files=select_files, rename_files=rename_files, empty_check=empty_check,
            verbose=verbose, seed=seed, storage_options=storage_options,
        )  # fmt: skip
        self.update_cache_info(args)
        cache_dir, cache_size = args.cache_dir, args.cache_size
        self.cache = ShardCache(cache_dir, max_bytes=cache_size) if cache_dir is not None else None
        first = len(self.pipeline)
        self.create_url_iterator(args)
        added = self.pipeline[first:]
        source: Any = added[0] if len(added) == 1 else None
        # A shard list that this class made is split and balanced by sample counts below;
        # any other URL source (a dataset spec, a subclass's own) gets the splitters appended.
        resampled = isinstance(source, ResampledShards)
        multi = not resampled and not isinstance(source, ShardList)
        shuffled = isinstance(source, ShardList) and source.shuffle
        self.num_shards = len(source.urls) if hasattr(source, "urls") else -1
        if balance not in (None, "auto", *BALANCE_MODES):
            raise ConfigError(f"balance={balance!r}; use 'drop', 'pad', 'auto' or None")
        nodesplitter, workersplitter = own_splitters(nodesplitter, workersplitter, balance)
        custom_split = any(
            s not in (None, *_DEFAULT_SPLITTERS) for s in (nodesplitter, workersplitter)
        )
        if subsample is not None and not 0 < subsample <= 1:
            raise ConfigError(f"subsample={subsample!r}: a fraction of the samples, 0 < f <= 1")
        if limit is not None and limit < 0:
            raise ConfigError(f"limit={limit!r}: a number of samples")
        subsets = subsample is not None or limit is not None
        if subsets and (resampled or custom_split or multi or balance is None):
            raise ConfigError(
                "subsample/limit take a run of the epoch's samples, split as balanced epochs "
                "are: not with resampled=True (use with_epoch), a dataset spec, another URL "
                "source (create_url_iterator), a custom nodesplitter/workersplitter or "
                "balance=None"
            )
        if balance in BALANCE_MODES and (resampled or custom_split or multi):
            raise ConfigError(
                f"balance={balance!r} splits the epoch's samples itself: it cannot be combined "
                "with resampled=True, a dataset spec, another URL source (create_url_iterator), "
                "or a custom nodesplitter/workersplitter"
            )
        if resampled and not multi:
            for splitter in (nodesplitter, workersplitter):
                if splitter is not None and splitter not in _DEFAULT_SPLITTERS:
                    self.append(splitter)
        elif multi:
            for splitter in (nodesplitter, workersplitter):
                if splitter is not None:
                    self.append(splitter)
        options = OpenOptions(
            storage_options=storage_options,
            allow_pipe=allow_pipe,
            block_bytes=block_bytes or config.DEFAULT_BLOCK_BYTES,
            max_member_bytes=max_member_bytes,
        )
        self.fetch = FetchOptions.from_env(
            prefetch=prefetch,
            part_bytes=part_bytes,
            concurrency=concurrency,
            retries=retries,
            stall_timeout_s=stall_timeout_s,
        )
        if not resampled and not multi:
            self.append(
                _Split(
                    source.urls,
                    nodesplitter,
                    workersplitter,
                    None if custom_split and balance == "auto" else balance,
                    sample_counts,
                    _Counter(source.urls, options, self.fetch, self.cache, allow_external_shards),
                    subsample,
                    limit,
                )
            )
        reader = _ShardReader(handler, options, select_files, rename_files, self.cache, self.fetch)
        self.append(reader)
        if empty_check:
            self.append(_EmptyCheck(self.num_shards, reader))
        log = logger.info if verbose else logger.debug
        log(
            "WebDataset: %d shards, resampled=%s, shard shuffle=%s, seed=%d, cache=%s",
            self.num_shards,
            resampled,
            shuffled,
            self.seed,
            self.cache.directory if self.cache is not None else None,
        )

    def update_cache_info(self, args: SimpleNamespace) -> None:
        """Fill in ``args.cache_dir`` and ``args.cache_size`` (what the arguments leave out)
        from ``CLOUDSHARDS_CACHE_DIR``/``WDS_CACHE`` and ``CLOUDSHARDS_CACHE_SIZE``/
        ``WDS_CACHE_SIZE``: webdataset's hook, called once by ``__init__`` before the node
        cache is made from them. A subclass may override it to choose the cache."""
        if args.cache_dir is None:
            args.cache_dir = config.cache_dir_default()
        if args.cache_size == -1:  # webdataset's "unset"
            env_size = config.cache_size_default()
            args.cache_size = args.cache_size if env_size is None else env_size

    def create_url_iterator(self, args: SimpleNamespace) -> None:
        """Append the stage that yields the shard URLs (``{"url": ...}`` dicts): webdataset's
        hook, called once by ``__init__``. A subclass may override it to append its own
        source; the node and worker splitters given are then appended after it, as in
        webdataset, and ``balance``, ``subsample`` and ``limit`` are not available."""
        if _is_multi_spec(args.urls):
            # webdataset's dataset specs (YAML file or dict): several datasets mixed per epoch.
            self.append(MultiShardSample(cast("str | Mapping[str, Any]", args.urls)))
        elif args.mode == "resampled":
            self.append(ResampledShards(args.urls, seed=self.seed))
        else:
            shuffle = bool(args.shardshuffle)
            self.append(ShardList(args.urls, shuffle=shuffle, storage_options=args.storage_options))

    def stats(self) -> dict[str, dict[str, float]]:
        """This process's counters: ``io`` (shards, requests, retries, bytes, wait_s,
        failures) and, with a cache, ``cache`` (hits, misses, waits, bytes from disk...)."""
        from cloudshards.source import process_stats

        result: dict[str, dict[str, float]] = {"io": process_stats().as_dict()}
        if self.cache is not None:
            result["cache"] = dict(self.cache.stats.as_dict())
        return result

    def __enter__(self) -> WebDataset:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()


def _is_multi_spec(urls: Any) -> bool:
    """A webdataset dataset spec: a YAML file or a dict with ``datasets``."""
    if isinstance(urls, Mapping):
        if "datasets" not in urls:
            raise ConfigError("a dataset spec dict needs a 'datasets' list")
        return True
    return isinstance(urls, str) and urls.endswith((".yaml", ".yml"))


def _check_urls(urls: Any) -> None:
    if isinstance(urls, str) and urls.endswith(".json"):
        raise ConfigError(
            "wids JSON dataset specs are not supported; pass a brace spec, a URL list, or a "
            "YAML/dict spec (webdataset's MultiShardSample format)"
        )
    if isinstance(urls, str) and urls.endswith("/"):
        raise ConfigError(
            f"{redact_url(urls)!r} looks like a directory; pass a glob such as "
            f"{redact_url(urls) + '*.tar'!r} instead"
        )
    if not isinstance(urls, (str, Iterable)):
        raise ConfigError(f"cannot handle urls of type {type(urls).__name__}")


class _Loader(SettledFork, DataLoader[Any]):
    """torch's DataLoader, each epoch's workers forked once the last epoch's threads ended."""


class WebLoader(DataPipeline, FluidInterface):
    """A torch DataLoader with the fluent methods: ``WebLoader(ds, batch_size=None, ...)``.

    Iterating it advances the wrapped dataset's epoch, so shards reshuffle every epoch even
    with non-persistent workers.

    Its :meth:`state_dict` is the start of the current epoch: the DataLoader under it keeps no
    state of its workers (nor does webdataset's). For an exact mid-epoch resume, use
    :class:`cloudshards.StatefulLoader` (see docs/distributed.md, "Resuming training").
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        if len(args) <= 1 and "batch_size" in kw and kw["batch_size"] is None:
            # Batches come from the pipeline (.batched): torch would pass each through
            # default_convert, ~5 us a sample for a batch of bytes; convert_batch gives the same.
            kw.setdefault("collate_fn", convert_batch)
        super().__init__(_Loader(*args, **kw))
        self._free_epochs = CountFree()  # not _count_free: DataPipeline state uses it
        self._told_restart = False

    def state_dict(self) -> dict[str, Any]:
        """The start of the current epoch (or of the next, between epochs): a restore reads
        that epoch again from its start, with its shard order, whatever ``with_epoch`` or
        loader-side stages say. Saved mid-epoch, this warns once that batches already trained
        will be trained again (use :class:`cloudshards.StatefulLoader` to continue exactly)."""
        state = super().state_dict()
        if state.get("seed") is not None and not self._told_restart:
            self._told_restart = True
            logger.warning(
                "WebLoader.state_dict() describes the start of epoch %s: a restore trains that "
                "epoch's batches again (a DataLoader keeps no state of its workers). To resume "
                "exactly mid-epoch, use cloudshards.StatefulLoader (docs/distributed.md)",
                state["epoch"],
            )
        for key in (*elastic.PENDING, *elastic.KEPT):
            state.pop(key, None)
        state.update(seed=None, stages={})
        return state

    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()  # (hands the dataset its epoch; starts nothing yet)
        loader = self.pipeline[0]
        dataset = loader.dataset
        single = self.repetitions == 1 and self.nsamples <= 0  # one pass of the loader
        if not (single and isinstance(dataset, DataPipeline)):
            return batches
        return self._meet_first(batches, dataset, loader.num_workers)

    def _meet_first(self, batches: Iterator[Any], dataset: Any, workers: int) -> Iterator[Any]:
        """The ranks meet (whether they end the epoch together) at its first batch, not at
        ``iter()``: Lightning calls ``iter()`` once to check a loader, and drops the iterator."""
        if self._free_epochs.begin(dataset, workers, self.pipeline[1:]):
            yield from self._free_epochs.run(batches, dataset)  # the ranks end it together
        else:
            yield from batches
