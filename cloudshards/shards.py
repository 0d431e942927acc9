"""Shard lists: per-epoch seeded shard order, resampling, and node/worker splitting.

Shards travel between stages as webdataset-style dicts ``{"url": ..., "shard_index": ...}``
so that user-written splitters and filters from webdataset code keep working.
Resumption: exact (the order is a pure function of seed, epoch and position: the shard lists
keep no state; each declares its configuration, ``stage_config()``, for the state fingerprint).
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from cloudshards.dist import WorkerInfo, derive_seed, pytorch_worker_seed
from cloudshards.errors import ConfigError
from cloudshards.stages.base import current_context, make_rng, pipelinefilter
from cloudshards.urls import expand_urls

__all__ = [
    "ResampledShards",
    "ShardList",
    "SimpleShardList",
    "epoch_shard_order",
    "non_empty",
    "resampled",
    "single_node_only",
    "split_by_node",
    "split_by_worker",
]

logger = logging.getLogger(__name__)


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The shard permutation of an epoch: identical on every rank, different each epoch."""
    order = list(range(num_shards))
    random.Random(derive_seed("shards", seed, epoch)).shuffle(order)
    return order


def _context_info() -> WorkerInfo:
    context = current_context()
    return context.info if context is not None else WorkerInfo.detect()


class ShardList:
    """The source stage of a :class:`~cloudshards.WebDataset`: one epoch's shard order.

    With ``shuffle`` the order is :func:`epoch_shard_order` of the pipeline's (seed, epoch),
    applied before any node/worker split, so splits stay disjoint and change every epoch.

    Args:
        urls: Shard spec (braces, ``::`` lists, globs) or a list of URLs.
        shuffle: Permute the shards each epoch.
        storage_options: fsspec options, used to expand globs.
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        *,
        shuffle: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.urls = expand_urls(urls, storage_options=storage_options)
        self.shuffle = shuffle

    def __len__(self) -> int:
        return len(self.urls)

    def stage_config(self) -> dict[str, Any]:
        """The shard URLs and whether they are shuffled."""
        return {"urls": self.urls, "shuffle": self.shuffle}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order: Iterable[int] = range(len(self.urls))
        if self.shuffle:
            context = current_context()
            seed, epoch = (context.seed, context.epoch) if context is not None else (0, 0)
            order = epoch_shard_order(len(self.urls), seed, epoch)
        for index in order:
            yield {"url": self.urls[index], "shard_index": index}


class SimpleShardList:
    """webdataset's shard list: yields ``{"url": url}``; shuffled (same each pass) with a seed.

    Args:
        urls: A brace spec or a list of URLs.
        seed: None for the given order; an int (or True for a random one) to shuffle.
    """

    def __init__(self, urls: str | Iterable[str], seed: int | bool | None = None) -> None:
        self.urls = expand_urls(urls, glob=False) if isinstance(urls, str) else list(urls)
        if not self.urls or not isinstance(self.urls[0], str):
            raise ConfigError("SimpleShardList needs a non-empty list of URL strings")
        if seed is True:
            seed = random.SystemRandom().randrange(2**31)
        self.seed: int | None = None if seed is False else seed

    def __len__(self) -> int:
        return len(self.urls)

    def stage_config(self) -> dict[str, Any]:
        """The shard URLs and the shuffle seed."""
        return {"urls": self.urls, "seed": self.seed}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        urls = self.urls.copy()
        if self.seed is not None:
            random.Random(self.seed).shuffle(urls)
        for url in urls:
            yield {"url": url}


class ResampledShards:
    """Draw shards with replacement, ``nshards`` per pass (endless by default).

    The seed of each pass derives from (seed, epoch, rank, worker), so a rerun draws the same
    shards; pass ``deterministic=False`` to mix in OS entropy as webdataset does by default.

    Args:
        urls: A brace spec or a list of URLs.
        nshards: Shards drawn per pass.
        seed: Base seed.
        worker_seed: Function giving a per-worker seed (webdataset's hook); default rank/worker.
        deterministic: Reproducible draws (default True, unlike webdataset 1.0.2).
        max_urls: Cap on the number of URLs taken from an iterable.
        empty_check: Raise when the list is empty.
    """

    def __init__(
        self,
        urls: str | Iterable[str],
        nshards: int = sys.maxsize,
        seed: int = 0,
        worker_seed: Callable[[], int] | None = None,
        deterministic: bool = True,
        max_urls: int = int(1e6),
        empty_check: bool = True,
    ) -> None:
        if isinstance(urls, str):
            self.urls = expand_urls(urls, glob=False)
        else:
            self.urls = list(itertools.islice(urls, max_urls))
        if empty_check and not self.urls:
            raise ConfigError("empty_check=True, but no shards found in ResampledShards")
        self.nshards = nshards
        self.seed = seed
        self.worker_seed = worker_seed
        self.deterministic = deterministic
        self.epoch = -1

    # No __len__: the draws never end (len() is a TypeError, as in webdataset).

    def stage_config(self) -> dict[str, Any]:
        """The shard URLs and what decides the draws (not the pass counter ``epoch``)."""
        return {
            "urls": self.urls,
            "nshards": self.nshards,
            "seed": self.seed,
            "deterministic": self.deterministic,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.epoch += 1
        context = current_context()
        if self.deterministic:
            worker = self.worker_seed() if self.worker_seed is not None else pytorch_worker_seed()
            epoch = context.epoch if context is not None else self.epoch
            repetition = context.repetition if context is not None else 0
            parts: tuple[object, ...] = ("resampled", self.seed, epoch, repetition, worker)
            if context is not None and context.seed != self.seed:
                # The pipeline's seed of this epoch: another pipeline seed, or (one rank, no
                # set_epoch, no seed given) the DataLoader's per-epoch seed mixed in, so that
                # fresh workers draw new shards each epoch as the shuffles reshuffle.
                parts += (context.seed,)
            rng = random.Random(derive_seed(*parts))
        else:
            rng = make_rng("resampled")  # drawn as the chain is built (see _resampled)
        return self._draws(rng)

    def _draws(self, rng: random.Random) -> Iterator[dict[str, Any]]:
        for _ in range(self.nshards):
            index = rng.randrange(len(self.urls))
            yield {"url": self.urls[index], "shard_index": index}


ResampledShardList = ResampledShards


def split_by_node(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Keep every ``world_size``-th shard starting at this rank."""
    context = current_context()
    info = context.info if context is not None and group is None else WorkerInfo.detect(group)
    if info.world_size > 1:
        yield from itertools.islice(src, info.rank, None, info.world_size)
    else:
        yield from src


def single_node_only(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Pass shards through; raise if the job has several ranks (no node splitter given)."""
    info = WorkerInfo.detect(group)
    if info.world_size > 1:
        raise ConfigError(
            "you need to add an explicit nodesplitter (e.g. nodesplitter=split_by_node) "
            "for multi-node training"
        )
    yield from src


def split_by_worker(src: Iterable[Any]) -> Iterator[Any]:
    """Keep every ``num_workers``-th shard starting at this DataLoader worker."""
    info = _context_info()
    if info.num_workers > 1:
        yield from itertools.islice(src, info.worker, None, info.num_workers)
    else:
        yield from src


def non_empty(src: Iterable[Any]) -> Iterator[Any]:
    """Pass items through; raise ValueError if there were none."""
    count = 0
    for item in src:
        count += 1
        yield item
    if count == 0:
        raise ValueError("pipeline stage received no data at all and this was declared as an error")


def _resampled(src: Iterable[Any], n: int = sys.maxsize) -> Iterator[Any]:
    """Collect ``src`` and yield ``n`` items drawn from it with replacement (the seed is drawn
    as the chain is built, see :func:`~cloudshards.webdataset.tariterators.shardlist`)."""
    return _draw_from(src, n, make_rng("resampled"))


def _draw_from(src: Iterable[Any], n: int, rng: random.Random) -> Iterator[Any]:
    items = list(src)
    if not items:
        return
    for _ in range(n):
        yield rng.choice(items)


resampled = pipelinefilter(_resampled)


def own_splitters(
    nodesplitter: Callable[..., Any] | None,
    workersplitter: Callable[..., Any] | None,
    balance: str | None,
) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """The splitters a dataset uses: the webdataset package's own ``split_by_node`` and
    ``split_by_worker`` (passed by code that imports both libraries) are taken as
    cloudshards', which split the same way and keep balanced epochs. A nodesplitter of the
    user's own in a multi-rank job warns: its ranks' epochs cannot be balanced."""
    nodesplitter = _OURS.get(_qualified(nodesplitter), nodesplitter)
    workersplitter = _OURS.get(_qualified(workersplitter), workersplitter)
    custom = nodesplitter not in (None, split_by_node, single_node_only)
    if custom and balance == "auto" and WorkerInfo.detect().world_size > 1:
        logger.warning(
            "nodesplitter=%s is your own: the ranks read the shards it gives them, so "
            "their sample counts are not balanced, and unequal batch counts hang DDP. Leave "
            "nodesplitter out (cloudshards splits by node and balances), or use "
            "resampled=True with with_epoch() (docs/distributed.md)",
            getattr(nodesplitter, "__qualname__", type(nodesplitter).__name__),
        )
    return nodesplitter, workersplitter


def _qualified(function: Any) -> str:
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"


#: The webdataset package's splitters, by qualified name, and their equals here.
_OURS: dict[str, Callable[..., Any]] = {
    "webdataset.shardlists.split_by_node": split_by_node,
    "webdataset.shardlists.split_by_worker": split_by_worker,
    "webdataset.shardlists.single_node_only": single_node_only,
}
