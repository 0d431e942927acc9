"""``DistributedChunkedSampler``: disjoint, equal-size, locality-preserving sample order per rank.

Part of :mod:`cloudshards.indexed`, which re-exports it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch.utils.data

from cloudshards.dist import WorkerInfo, derive_seed
from cloudshards.errors import ConfigError, StateMismatchError

__all__ = ["DistributedChunkedSampler"]

logger = logging.getLogger(__name__)

#: Chunk size for datasets that do not say where their shards begin and end.
DEFAULT_CHUNK_SIZE = 1000


class DistributedChunkedSampler(torch.utils.data.Sampler[int]):
    """Give each rank a disjoint, equally long list of sample indices, read chunk by chunk.

    The dataset is cut into chunks of contiguous indices: its shards (from
    ``dataset.shard_ranges()``, which :class:`IndexedDataset` has), each split further into
    pieces of at most ``chunk_size``. Each epoch the chunk order is a permutation seeded by
    ``(seed, epoch)``, identical on every rank; the concatenated chunks are cut into
    ``num_replicas`` consecutive equal spans, one per rank, and indices are shuffled within each
    chunk. A rank therefore reads a few shards at a time (each fetched once into a node cache)
    while the epoch order still changes completely.

    Like :class:`torch.utils.data.DistributedSampler`: with ``drop_last=False`` every rank gets
    ``ceil(N / num_replicas)`` indices and the last ranks are padded with indices from the
    start of the epoch's order; with ``drop_last=True`` every rank gets ``N // num_replicas``
    and the remainder is dropped. Call :meth:`set_epoch` before each epoch.

    Args:
        dataset: A sized dataset; ``shard_ranges()`` (``[(start, end), ...]``) when it has one.
        num_replicas: Number of ranks (default: detected, see :class:`~cloudshards.WorkerInfo`).
        rank: This rank (default: detected).
        shuffle: Shuffle chunk order and indices within chunks; False gives rank r the r-th
            consecutive span of ``range(N)``.
        seed: Base seed; must be the same on every rank.
        chunk_size: Largest chunk; None means whole shards (or 1000 for datasets without
            ``shard_ranges``). Smaller chunks mix more, larger ones touch fewer shards at once.
        drop_last: Drop the tail instead of padding.

    Raises:
        ConfigError: Bad rank, world size or chunk size, or an empty dataset.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        chunk_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if num_replicas is None or rank is None:
            info = WorkerInfo.detect()
            num_replicas = info.world_size if num_replicas is None else num_replicas
            rank = info.rank if rank is None else rank
        if num_replicas < 1:
            raise ConfigError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ConfigError(f"rank must be in [0, {num_replicas}), got {rank}")
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {chunk_size}")
        size = len(dataset)
        if size == 0:
            raise ConfigError("DistributedChunkedSampler: the dataset is empty")
        ranges = _shard_ranges(dataset, size)
        if ranges is None:
            ranges = [(0, size)]
            chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
        self.chunks = [
            (lo, min(lo + chunk_size, hi)) if chunk_size else (lo, hi)
            for start, hi in ranges
            for lo in range(start, hi, chunk_size or max(hi - start, 1))
        ]
        self.dataset_size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_samples = size // num_replicas if drop_last else -(-size // num_replicas)
        if self.num_samples == 0:
            logger.warning(
                "DistributedChunkedSampler: %d samples for %d ranks with drop_last=True: "
                "every rank gets none",
                size,
                num_replicas,
            )
        self.epoch = 0
        self.yielded = 0  # indices handed out in this iteration of the epoch
        self._resume: tuple[int, int] | None = None  # (epoch, indices) of a loaded state

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next iteration on (the same on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def _order(self) -> dict[str, Any]:
        """What this rank's order of an epoch depends on (besides the epoch)."""
        chunks = hashlib.blake2b(repr(self.chunks).encode(), digest_size=8).hexdigest()
        return {
            "samples": self.dataset_size,
            "chunks": chunks,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in its order of the epoch, and what that order depends on:
        torchdata's ``StatefulDataLoader`` (and :class:`~cloudshards.StatefulLoader`) save it
        and restore it with :meth:`load_state_dict`, instead of counting indices again."""
        return {"epoch": self.epoch, "yielded": self.yielded, "order": self._order()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next iteration (its epoch, unless :meth:`set_epoch`
        moves to the next one after an epoch that had ended).

        Raises:
            StateMismatchError: ``state`` was saved by a sampler whose order differs (another
                dataset size or chunks, number of ranks, rank, seed, shuffle or drop_last): the
                indices that follow would not be the ones the saved run had left.
        """
        saved = state.get("order") if isinstance(state, Mapping) else None
        if not isinstance(saved, Mapping):
            raise StateMismatchError("not a DistributedChunkedSampler state")
        differ = sorted(k for k, v in self._order().items() if saved.get(k) != v)
        if differ:
            raise StateMismatchError(
                "the checkpoint's DistributedChunkedSampler had another order (it differs in "
                f"{', '.join(differ)}): restore with the sampler of the run that saved it"
            )
        epoch, yielded = state.get("epoch"), state.get("yielded")
        if type(epoch) is not int or type(yielded) is not int or not 0 <= yielded <= len(self):
            raise StateMismatchError(f"a DistributedChunkedSampler state out of range: {state}")
        self.epoch, self._resume = epoch, (epoch, yielded)

    def __iter__(self) -> Iterator[int]:
        self.yielded, skip = 0, 0
        if self._resume is not None:
            (epoch, yielded), self._resume = self._resume, None
            if epoch == self.epoch:
                skip = yielded
            elif yielded < len(self):  # set_epoch left an epoch that had not ended
                raise StateMismatchError(
                    f"the sampler's state is in epoch {epoch} (after {yielded} of {len(self)} "
                    f"indices), but set_epoch({self.epoch}) was called before iterating"
                )
        for index in itertools.islice(self._indices(), skip, None):
            self.yielded = skip = skip + 1
            yield index

    def _indices(self) -> Iterator[int]:
        order = list(range(len(self.chunks)))
        if self.shuffle:
            random.Random(derive_seed(self.seed, self.epoch, "chunks")).shuffle(order)
        first = self.rank * self.num_samples
        last = first + self.num_samples
        position = 0  # of the current chunk in the epoch's concatenated order
        turn = 0
        while position < last:
            chunk_id = order[turn % len(order)]  # wraps around to pad the last ranks
            lo, hi = self.chunks[chunk_id]
            begin, end = max(first, position), min(last, position + hi - lo)
            if begin < end:
                indices = list(range(lo + begin - position, lo + end - position))
                if self.shuffle:
                    seed = derive_seed(self.seed, self.epoch, "within", chunk_id, turn)
                    random.Random(seed).shuffle(indices)
                yield from indices
            position += hi - lo
            turn += 1


def _shard_ranges(dataset: Any, size: int) -> list[tuple[int, int]] | None:
    ranges_of = getattr(dataset, "shard_ranges", None)
    if not callable(ranges_of):
        return None
    ranges = [(int(lo), int(hi)) for lo, hi in ranges_of() if hi > lo]
    covered = [0, *(hi for _, hi in ranges)]
    if [lo for lo, _ in ranges] != covered[:-1] or covered[-1] != size:
        raise ConfigError("dataset.shard_ranges() does not cover range(len(dataset)) in order")
    return ranges
