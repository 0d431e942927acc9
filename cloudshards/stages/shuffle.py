"""Sample shuffling with a bounded buffer (webdataset's ``shuffle`` and ``detshuffle``).

Resumption: exact when the buffer is fed by a shard reader through stages that give at most one
item per sample (``map``, ``decode``, ``select``, ``to_tuple``...): the state holds the
generator's RNG state and, for each buffered sample, where the reader found it (shard number,
sample number), never sample bytes; a restore reads those samples again (see
:class:`ShuffleIterator`). Otherwise (no shard reader upstream, or a stage that gives several
items per sample, such as ``batched`` before the shuffle) the buffer is not saved and a restore
loses at most ``bufsize`` samples per worker, with one warning. The buffer size, ``initial``
and seed are in the state fingerprint: a state saved with another shuffle is refused.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from cloudshards.errors import StateMismatchError
from cloudshards.redact import redact_url
from cloudshards.stages.base import (
    PipelineStage,
    checkpoint_warning,
    make_rng,
    rng_state,
    set_rng_state,
)

__all__ = ["ShuffleIterator", "Shuffler", "detshuffle", "pick", "shuffle"]

logger = logging.getLogger(__name__)


def pick(buf: list[Any], rng: random.Random) -> Any:
    """Remove and return a random element of ``buf`` in O(1)."""
    k = rng.randint(0, len(buf) - 1)
    sample = buf[k]
    buf[k] = buf[-1]
    buf.pop()
    return sample


def _shuffle(
    data: Iterable[Any],
    bufsize: int = 1000,
    initial: int = 100,
    rng: random.Random | None = None,
    seed: int | None = None,
    handler: Any = None,
) -> Iterator[Any]:
    """Shuffle ``data`` through a buffer of ``bufsize`` items, yielding once ``initial`` are in.

    Same algorithm as webdataset 1.0.2 (it pulls up to two items per output while filling).
    Without ``rng`` or ``seed`` the seed comes from the pipeline's (seed, epoch, rank, worker).
    """
    if seed is not None:
        if rng is not None:
            raise ValueError("pass either rng or seed to shuffle, not both")
        rng = random.Random(seed)
    elif rng is None:
        rng = make_rng("shuffle")
    yield from _run(data, bufsize, min(initial, bufsize), _Buffer(rng), None)


class Shuffler:
    """The ``shuffle(bufsize, initial, ...)`` filter; picks its RNG when the chain is built."""

    def __init__(
        self,
        bufsize: int = 1000,
        initial: int = 100,
        rng: random.Random | None = None,
        seed: int | None = None,
    ) -> None:
        self.bufsize = bufsize
        self.initial = initial
        self.rng = rng
        self.seed = seed

    def __call__(self, data: Iterable[Any]) -> ShuffleIterator:
        rng = self.rng
        if rng is not None and self.seed is not None:
            raise ValueError("pass either rng or seed to shuffle, not both")
        shared = None
        if rng is None and self.seed is None:
            # Drawn now, while the pipeline's context is current, not lazily on first next().
            rng = make_rng("shuffle")
            # For shards (webdataset's README shuffles URLs, then splits them by worker): one
            # order for every rank and worker, or their shares would overlap.
            shared = make_rng("shuffle", shared=True)
        elif rng is None:
            rng = random.Random(self.seed)
        return ShuffleIterator(data, self.bufsize, self.initial, rng, shared)

    def stage_config(self) -> dict[str, Any]:
        """Buffer size, initial fill and seed (an explicit ``rng`` counts by its type)."""
        return {"bufsize": self.bufsize, "initial": self.initial, "seed": self.seed}

    def __repr__(self) -> str:
        return f"<shuffle bufsize={self.bufsize} initial={self.initial}>"


def shuffle(
    bufsize: int = 1000,
    initial: int = 100,
    rng: random.Random | None = None,
    seed: int | None = None,
    handler: Any = None,
) -> Shuffler:
    """Filter factory: shuffle samples through a buffer (see :func:`_shuffle`)."""
    return Shuffler(bufsize, initial, rng=rng, seed=seed)


class detshuffle(PipelineStage):
    """Deterministic shuffle: seeded by ``seed + epoch``, the epoch counting calls to ``run``."""

    def __init__(self, bufsize: int = 1000, initial: int = 100, seed: int = 0, epoch: int = -1):
        self.bufsize = bufsize
        self.initial = initial
        self.seed = seed
        self.epoch = epoch

    def stage_config(self) -> dict[str, Any]:
        """Buffer size, initial fill and seed (not the epoch counter)."""
        return {"bufsize": self.bufsize, "initial": self.initial, "seed": self.seed}

    def run(self, src: Iterable[Any]) -> Iterator[Any]:
        """Shuffle ``src`` with the next epoch's seed."""
        self.epoch += 1
        rng = random.Random(self.seed + self.epoch)
        return ShuffleIterator(src, self.bufsize, self.initial, rng)


class _Buffer:
    """What a running shuffle holds, shared by :class:`ShuffleIterator` and its generator
    (which must not refer to the iterator: see StatefulIterator)."""

    __slots__ = ("done", "exact", "items", "places", "pulled", "rng", "shared", "why")

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.shared: random.Random | None = None
        self.items: list[Any] = []
        #: Where the reader found each item of ``items`` (same order), see :func:`_pack`.
        self.places: list[int] = []
        self.pulled = 0  # items taken from the source
        self.done = False  # the source is exhausted: only the buffer is left
        self.exact = True
        self.why = ""


class ShuffleIterator:
    """A running shuffle buffer (webdataset 1.0.2's algorithm, see :func:`_shuffle`) whose
    state says which samples it holds.

    The pipeline hands it the shard reader upstream (``reader``) when it builds the chain;
    after each item taken from its source it notes the reader's position, which is that
    item's sample when every stage in between gives at most one item per sample. Its state is
    the RNG's state and those positions in buffer order; restored, the pipeline reads those
    samples again (from the shards that hold them, through the same stages, see
    :meth:`~cloudshards.pipeline.DataPipeline._chain`) and :meth:`refill` puts them back in
    place, so the run continues with exactly the items it would have delivered.
    """

    state_key = "shuffle"

    def __init__(
        self,
        src: Iterable[Any],
        bufsize: int,
        initial: int,
        rng: random.Random,
        shared: random.Random | None = None,
    ) -> None:
        self._src = src
        self._bufsize = bufsize
        self._initial = min(initial, bufsize)
        self._buffer = _Buffer(rng)
        #: The RNG to use instead if the items are shards (see :func:`shard_like`).
        self._buffer.shared = shared
        if not isinstance(rng, random.Random):  # a user's generator: its state is its own
            self._buffer.exact, self._buffer.why = False, "its rng is not a random.Random"
        self._it: Iterator[Any] | None = None
        #: The shard reader upstream (set by the pipeline), or None.
        self.reader: Any = None
        #: Positions to read again before the first item (set by load_state_dict).
        self.pending: list[tuple[int, int]] = []
        self._restored: Mapping[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._it is None:
            if self.pending:
                raise StateMismatchError(
                    "this shuffle buffer was restored but its samples were never read again "
                    "(the pipeline has no shard reader before it)"
                )
            position = getattr(self.reader, "position", None)
            if position is None and self._buffer.exact:
                self.inexact("no shard reader feeds it")
            self._it = _run(self._src, self._bufsize, self._initial, self._buffer, position)
        return self._it

    def __next__(self) -> Any:
        return next(self.__iter__())

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def inexact(self, why: str) -> None:
        """The buffer cannot be read again by position (``why``): leave it out of the state."""
        self._buffer.exact = False
        self._buffer.why = why
        self.reader = None

    def state_dict(self) -> dict[str, Any]:
        """``{"rng": ..., "buffer": [[shard, sample], ...], "pulled": n, "done": bool}``;
        ``{}`` before the first item or when the buffer cannot be restored exactly."""
        buffer = self._buffer
        if not buffer.exact:
            _warn_inexact(buffer.why)
            return {}
        if not buffer.pulled:
            return {}
        return {
            "rng": rng_state(buffer.rng),
            "buffer": [list(_unpack(place)) for place in buffer.places],
            "pulled": buffer.pulled,
            "done": buffer.done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Note the saved buffer; the pipeline reads its samples again and calls
        :meth:`refill` before the first item."""
        if self._it is not None:
            raise RuntimeError("a shuffle buffer is restored before it starts")
        self._restored = state
        self.pending = [(int(shard), int(sample)) for shard, sample in state.get("buffer", [])]

    def refill(
        self, items: Mapping[tuple[int, int], Any], urls: Mapping[int, str] | None = None
    ) -> None:
        """Put the samples read again (by position) back, in the saved order, with the RNG;
        ``urls``: the shards' URLs by number, for the error when some are missing."""
        state = self._restored
        assert state is not None
        buffer = self._buffer
        missing = [place for place in self.pending if place not in items]
        if missing:
            shard, sample = missing[0]
            where = redact_url(urls[shard]) if urls and shard in urls else "not in the list"
            raise StateMismatchError(
                f"cannot restore the shuffle buffer exactly: {len(missing)} of its "
                f"{len(self.pending)} samples were not found again, the first sample {sample} "
                f"of shard {shard} ({where}); the shards changed since the checkpoint, or could "
                "not be read"
            )
        seen: set[tuple[int, int]] = set()
        buffer.items = []
        for place in self.pending:  # a sample the reader repeated is in it more than once
            item = items[place]
            buffer.items.append(copy.copy(item) if place in seen else item)
            seen.add(place)
        buffer.places = [_pack(*place) for place in self.pending]
        set_rng_state(buffer.rng, state["rng"])
        buffer.pulled = int(state.get("pulled", len(self.pending)))
        buffer.done = bool(state.get("done", False))
        self.pending = []


def _run(
    src: Iterable[Any],
    bufsize: int,
    initial: int,
    buffer: _Buffer,
    position: list[int] | None,
) -> Iterator[Any]:
    """:func:`_shuffle` over ``buffer`` (possibly refilled), noting each item's place: the
    same pulls and picks, so a restored buffer continues the same sequence. A place is the
    reader's position packed in one int (see :func:`_pack`), cheaper per sample than a tuple."""
    items, places = buffer.items, buffer.places
    where = position if position is not None else [0, 0]
    last = -1
    pulled = buffer.pulled
    source = iter(src) if not buffer.done else iter(())
    done = buffer.done
    if buffer.shared is not None and not pulled and not done:
        first = next(source, _NONE)
        if shard_like(first):
            buffer.rng = buffer.shared
        source = itertools.chain(() if first is _NONE else (first,), source)
    rng = buffer.rng
    while not done:
        pulls = 0
        while True:  # webdataset pulls a second item while the buffer is not full
            try:
                sample = next(source)
            except StopIteration:
                done = buffer.done = True
                break
            place = where[0] << 32 | where[1]
            if place == last and buffer.exact and len(where) == 2:
                # Two items from one sample: a stage in between is not one-to-one (a reader
                # repeating a sample to keep ranks in step says so: see Shortfall).
                buffer.exact = False
                buffer.why = "a stage before it gives several items per sample"
            last = place
            items.append(sample)
            places.append(place)
            pulls += 1
            if pulls == 2 or len(items) >= bufsize:
                break
        pulled += pulls
        buffer.pulled = pulled
        if pulls and len(items) >= initial:
            yield _take(items, places, rng)
    while items:
        yield _take(items, places, rng)


_NONE = object()


def shard_like(item: Any) -> bool:
    """Whether a shuffle's first item is a shard (a URL, or ``{"url": ...}`` without a
    sample's ``__key__``) rather than a sample: shards are shuffled with one seed for every
    rank and worker."""
    if isinstance(item, str):
        return True
    return isinstance(item, dict) and "url" in item and "__key__" not in item


def _take(items: list[Any], places: list[int], rng: random.Random) -> Any:
    """:func:`pick`, keeping ``places`` in step with ``items``."""
    k = rng.randint(0, len(items) - 1)
    sample = items[k]
    items[k] = items[-1]
    items.pop()
    places[k] = places[-1]
    places.pop()
    return sample


def _pack(shard: int, sample: int) -> int:
    """A (shard, sample) place as :func:`_run` notes it: the reader's position right after
    delivering it, ``(shard + 1, sample + 1)``, in one int."""
    return (shard + 1) << 32 | (sample + 1)


def _unpack(place: int) -> tuple[int, int]:
    return (place >> 32) - 1, (place & 0xFFFFFFFF) - 1


_WARNED: set[str] = set()


def _warn_inexact(why: str) -> None:
    def warn() -> None:
        if why not in _WARNED:
            _WARNED.add(why)
            logger.warning(
                "shuffle: a checkpoint does not hold this buffer (%s); a restore loses the "
                "samples in it (at most its size per worker)",
                why,
            )

    checkpoint_warning(f"shuffle: {why}", warn)
