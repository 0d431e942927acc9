"""DataPipeline: a chain of stages that is a torch IterableDataset, plus the fluent methods.

Each ``iter()`` is one epoch: the pipeline detects rank and worker, makes the (seed, epoch)
context current while its stages run (so shard order and shuffles are deterministic and
change per epoch), and builds a fresh iterator chain. Fluent methods return a new pipeline and
never modify the one they are called on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from cloudshards import config
from cloudshards.dist import WorkerInfo, derive_seed
from cloudshards.handlers import reraise_exception
from cloudshards.stages import base, batch, fields, shuffle, transform
from cloudshards.stages.base import IterationContext, PipelineStage
from cloudshards.stages.epoch import _slice
from cloudshards.types import ExceptionHandler

__all__ = ["DataPipeline", "FluidInterface", "FluidWrapper", "default_seed"]

logger = logging.getLogger(__name__)


def default_seed() -> int:
    """The base seed when none is given: ``CLOUDSHARDS_SEED``, else ``WDS_SEED``, else 0.

    A fixed default keeps every rank on the same shard order without coordination, the way
    ``DistributedSampler(seed=0)`` does; epochs still differ through the epoch number.
    """
    value = _env_seed()
    return 0 if value is None else value


def _env_seed() -> int | None:
    import os

    value = config.env_str("SEED") or os.environ.get("WDS_SEED")
    return int(value) if value else None


def _shuffles(stage: Any) -> bool:
    return getattr(stage, "shuffle", None) is True or isinstance(stage, shuffle.Shuffler)


def _torch_base_seed() -> int | None:
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    return None if info is None else int(info.seed - info.id)


class DataPipeline(IterableDataset, PipelineStage):  # type: ignore[type-arg]
    """A source followed by stages: ``DataPipeline(source, stage, stage, ...)``.

    Stages are webdataset-style: iterables or datasets (sources), callables ``f(src) -> it``,
    :class:`PipelineStage` objects, or lists of those.

    Args:
        *args: The source and the stages, in order.
        seed: Base seed for shard order and shuffles (default :func:`default_seed`).
        rank: This process's rank, overriding detection (torch.distributed, then torchrun's
            ``RANK``, then SLURM's ``SLURM_PROCID``).
        world_size: The number of ranks, overriding detection likewise.
    """

    def __init__(
        self,
        *args: Any,
        seed: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if (rank is None) != (world_size is None) or (
            rank is not None and world_size is not None and not 0 <= rank < world_size
        ):
            from cloudshards.errors import ConfigError

            raise ConfigError(
                f"rank={rank}, world_size={world_size}: give both, with 0 <= rank < world_size"
            )
        self._ranks = None if rank is None or world_size is None else (rank, world_size)
        self.pipeline: list[Any] = []
        self.repetitions = 1
        self.nsamples = -1
        self.seed = default_seed() if seed is None else int(seed)
        # A seed the user chose (argument or environment) alone fixes the order of each epoch.
        self._seed_given = seed is not None or _env_seed() is not None
        self._epoch = 0
        self._epoch_set = False
        self._epoch_from_user = False  # set_epoch was called since a WebLoader last pushed
        self._length: int | None = None
        self._live: dict[str, Any] | None = None  # the running epoch, for state_dict
        self._resume: dict[str, Any] | None = None
        for arg in args:
            if arg is None:
                continue
            if isinstance(arg, list):
                self.pipeline.extend(arg)
            else:
                self.pipeline.append(arg)

    # --- epochs ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next ``iter()``; later iterations count up from it.

        Call it with the same value on every rank (as with ``DistributedSampler``) so that all
        ranks agree on the shard order; DataLoader workers receive it with the dataset.
        """
        self._epoch = int(epoch)
        self._epoch_set = True
        self._epoch_from_user = True

    def _push_epoch(self, epoch: int) -> None:
        # A WebLoader keeping this dataset in step: like set_epoch, but not the user's choice.
        self.set_epoch(epoch)
        self._epoch_from_user = False

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will run."""
        return self._epoch

    def _context(self, epoch: int | None = None) -> IterationContext:
        info = WorkerInfo.detect()
        if self._ranks is not None:
            info = dataclasses.replace(info, rank=self._ranks[0], world_size=self._ranks[1])
        seed = self.seed
        epoch = self._epoch if epoch is None else epoch
        if not self._epoch_set and info.world_size == 1 and not self._seed_given:
            # Without set_epoch, non-persistent DataLoader workers get a fresh copy of the
            # dataset each epoch, so their epoch counter never moves. Mixing in the DataLoader's
            # per-epoch base seed (equal for all workers of one epoch) still reshuffles. Only
            # on one rank (ranks must agree, and their torch seeds may differ) and only without
            # a seed (a seed the user gives must fix the order regardless of torch's RNG).
            base_seed = _torch_base_seed()
            if base_seed is not None:
                seed = derive_seed(seed, base_seed)
        elif (
            not self._epoch_set
            and epoch == 0
            and (info.num_workers > 1 or _torch_base_seed() is not None)
            and (info.rank, info.worker) == (0, 0)
            and any(_shuffles(stage) for stage in self.pipeline)
        ):
            # Several ranks or an explicit seed, DataLoader workers and no set_epoch: fresh
            # (non-persistent) workers start from epoch 0 every time, so the order repeats.
            why = f"with {info.world_size} ranks" if info.world_size > 1 else f"with seed={seed}"
            logger.warning(
                "no set_epoch() on this dataset %s: unless the DataLoader has "
                "persistent_workers=True, its workers see epoch 0 every epoch and repeat its "
                "order; call dataset.set_epoch(epoch) each epoch (the same value on every rank)",
                why,
            )
        return IterationContext(seed=seed, epoch=epoch, info=info)

    # --- iteration ---------------------------------------------------------------------------

    def invoke(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply one stage to the output of the previous one (or start a source)."""
        if not args and isinstance(f, (IterableDataset, DataLoader)):
            return iter(f)
        if isinstance(f, PipelineStage):
            return f.run(*args, **kwargs)
        if isinstance(f, list):
            return iter(f)
        if callable(f):
            return f(*args, **kwargs)
        if not args and hasattr(f, "__iter__"):
            return iter(f)
        raise ValueError(f"{f!r}: not a valid pipeline stage")

    def iterator1(self) -> Iterator[Any]:
        """Build the iterator chain for one pass over the data."""
        if not self.pipeline:
            raise ValueError("DataPipeline has no source")
        source = self.invoke(self.pipeline[0])
        for step in self.pipeline[1:]:
            source = self.invoke(step, source)
        return iter(source)

    def iterator(self, epoch: int | None = None) -> Iterator[Any]:
        """Run ``repetitions`` passes (stopping early if a pass yields nothing), at most
        ``nsamples`` items when ``with_epoch`` set it, resuming where ``load_state_dict`` says."""
        context = self._context(epoch)
        context.bounded = self.nsamples > 0
        resume, self._resume = self._resume, None
        first_repetition, yielded = 0, 0
        if resume is not None:
            self._check_consumer(resume, context.info)
            context.seed = int(resume["seed"])
            first_repetition, yielded = int(resume["repetition"]), int(resume["yielded"])
            context.resumed = True
            if resume["shards"] > 0:
                context.resume = (int(resume["shards"]) - 1, int(resume["samples"]))
        live = {"epoch": context.epoch, "seed": context.seed, "info": context.info}
        live.update(repetition=first_repetition, yielded=yielded, position=context.position)
        self._live = live
        limit = self.nsamples if self.nsamples > 0 else sys.maxsize
        for repetition in range(first_repetition, self.repetitions):
            if yielded >= limit:
                break
            context.repetition = live["repetition"] = repetition
            count = 0
            for sample in _with_context(context, self.iterator1):
                count += 1
                yielded += 1
                live["yielded"] = yielded
                yield sample
                if yielded >= limit:
                    break
            if count == 0:
                break
        if self._live is live:
            self._live = None

    def __iter__(self) -> Iterator[Any]:
        for stage in self.pipeline:
            # WebLoader: keep the wrapped dataset's epoch in step with ours. An epoch the user
            # set on the dataset since our last push wins (a job restarted at epoch k calls
            # dataset.set_epoch(k)), unless the loader's own epoch was set explicitly.
            dataset = getattr(stage, "dataset", None) if isinstance(stage, DataLoader) else None
            if isinstance(dataset, DataPipeline):
                if dataset._epoch_from_user and not self._epoch_from_user:
                    self._epoch = dataset.epoch
                dataset._push_epoch(self._epoch)
                self._epoch_from_user = False
            elif dataset is not None and hasattr(dataset, "set_epoch"):
                dataset.set_epoch(self._epoch)
        it = self.iterator(self._epoch)
        # Until the first next(), state_dict() says "the start of this epoch".
        self._live = {"epoch": self._epoch, "seed": None, "info": None, "repetition": 0}
        self._live.update(yielded=0, position=[0, 0])
        self._epoch += 1
        return it

    # --- state ---------------------------------------------------------------------------------

    def _fingerprint(self) -> str:
        """What a state must match: the source's shards and the stage layout."""
        parts: list[Any] = [type(self).__name__]
        for stage in self.pipeline:
            parts.append(type(stage).__name__)
            urls = getattr(stage, "urls", None)
            if isinstance(urls, list):
                parts.append(urls)
        return str(derive_seed(*parts))

    def state_dict(self) -> dict[str, Any]:
        """Where this process's stream is: epoch, pass, items delivered, and the reader's
        position (shards begun, samples from the last one).

        Restoring it with :meth:`load_state_dict` continues exactly after the last item
        delivered, unless a shuffle buffer held samples (those are lost: resume is then
        approximate by at most the buffer size). Under ``StatefulDataLoader`` each worker
        saves and restores its own.
        """
        live = self._live
        state: dict[str, Any] = {"version": 1, "fingerprint": self._fingerprint()}
        if live is None:
            info = WorkerInfo.detect()
            epoch, seed = self._epoch, None
            state.update(repetition=0, yielded=0, shards=0, samples=0)
        else:
            info, epoch, seed = live["info"] or WorkerInfo.detect(), live["epoch"], live["seed"]
            position = live["position"]
            state.update(
                repetition=live["repetition"],
                yielded=live["yielded"],
                shards=position[0],
                samples=position[1],
            )
        state.update(
            epoch=epoch,
            seed=seed,
            consumer=[info.rank, info.world_size, info.worker, info.num_workers],
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next ``iter()`` resumes that epoch.

        Raises:
            StateMismatchError: The state is from another dataset or configuration, or from
                another rank/worker layout.
        """
        from cloudshards.errors import StateMismatchError

        if not isinstance(state, dict) or state.get("version") != 1:
            raise StateMismatchError(f"not a cloudshards pipeline state: {state!r:.200}")
        if state.get("fingerprint") != self._fingerprint():
            raise StateMismatchError(
                "this state was saved by a different dataset or configuration (other shards "
                "or stages); refusing to resume from it"
            )
        self._epoch = int(state["epoch"])
        self._epoch_set = True
        self._epoch_from_user = True  # a WebLoader around it continues from this epoch
        has_position = state["yielded"] or state["shards"] or state["repetition"]
        if state.get("seed") is None or not has_position:
            self._resume = None
        else:
            self._resume = dict(state)

    @staticmethod
    def _check_consumer(state: dict[str, Any], info: WorkerInfo) -> None:
        saved = list(state["consumer"])
        now = [info.rank, info.world_size, info.worker, info.num_workers]
        if saved != now:
            from cloudshards.errors import StateMismatchError

            raise StateMismatchError(
                f"state saved by rank {saved[0]}/{saved[1]}, worker {saved[2]}/{saved[3]} "
                f"cannot resume rank {now[0]}/{now[1]}, worker {now[2]}/{now[3]}: restore "
                "with the same number of ranks and DataLoader workers"
            )

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(
                f"{type(self).__name__} has no length (it streams); use .with_length(n) if a "
                "framework needs one"
            )
        return self._length

    # --- building ----------------------------------------------------------------------------

    def stage(self, i: int) -> Any:
        """Return stage ``i``."""
        return self.pipeline[i]

    def append(self, f: Any) -> None:
        """Append a stage to this pipeline in place (used while constructing it)."""
        self.pipeline.append(f)

    def compose(self, *args: Any) -> Any:
        """Return a copy of this pipeline with ``args`` appended as stages."""
        result = copy.copy(self)
        result.pipeline = list(self.pipeline)
        for arg in args:
            result.append(arg)
        return result

    def with_length(self, n: int, silent: bool = False) -> Any:
        """Return a copy whose ``len()`` is ``n`` (it does not change what is iterated)."""
        result = self.compose()
        result._length = int(n)
        if not silent:
            logger.info("with_length(%d) sets __len__ only; the epoch is unchanged", n)
        return result

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> Any:
        """Return a copy whose epochs are exactly ``max(nsamples, nbatches)`` items long.

        The data is repeated (restarting its passes) as often as needed to fill the epoch,
        so every worker of every rank yields the same count: the fix for DDP hangs.
        """
        result = self.compose()
        result.repetitions = sys.maxsize
        result.nsamples = max(nsamples, nbatches)
        return result

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> Any:
        """Return a copy that makes ``nepochs`` passes (forever if < 1), capped at ``nbatches``."""
        result = self.compose()
        result.repetitions = nepochs if nepochs > 0 else sys.maxsize
        result.nsamples = nbatches
        return result

    def close(self) -> None:
        """Close every stage that has a ``close`` method."""
        for step in self.pipeline:
            close = getattr(step, "close", None)
            if callable(close) and not isinstance(step, DataLoader):
                close()


def _with_context(context: IterationContext, build: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    # Keep the context current whenever the chain's generators run (they start lazily, on
    # the first next()), and only then, so that interleaved pipelines never see each other's.
    local = base._local
    previous = getattr(local, "context", None)
    local.context = context
    try:
        it = build()
    finally:
        local.context = previous
    while True:
        previous = getattr(local, "context", None)
        local.context = context
        try:
            sample = next(it)
        except StopIteration:
            return
        finally:
            local.context = previous
        yield sample


class FluidInterface:
    """webdataset's fluent methods; each returns a new pipeline with one more stage."""

    def compose(self, *args: Any) -> Any:  # provided by DataPipeline
        raise NotImplementedError

    def batched(
        self,
        batchsize: int,
        collation_fn: Callable[[list[Any]], Any] | None = batch.default_collation_fn,
        partial: bool = True,
    ) -> Any:
        """Group samples into batches (tensors and arrays stacked by the default collation)."""
        return self.compose(batch.batched(batchsize, collation_fn=collation_fn, partial=partial))

    def unbatched(self) -> Any:
        """Split batches back into samples."""
        return self.compose(batch.unbatched())

    def listed(self, batchsize: int, partial: bool = True) -> Any:
        """Group samples into plain lists (no collation)."""
        return self.compose(batch.batched(batchsize, collation_fn=None, partial=partial))

    def unlisted(self) -> Any:
        """Flatten lists of samples."""
        return self.compose(batch.unlisted())

    def log_keys(self, logfile: str | None = None) -> Any:
        """Append sample keys to ``logfile``."""
        return self.compose(transform.log_keys(logfile))

    def shuffle(self, size: int, **kw: Any) -> Any:
        """Shuffle samples through a buffer of ``size`` (no-op when ``size < 1``)."""
        if size < 1:
            return self
        return self.compose(shuffle.shuffle(size, **kw))

    def map(self, f: Callable[[Any], Any], handler: ExceptionHandler = reraise_exception) -> Any:
        """Apply ``f`` to every sample."""
        return self.compose(transform.map(f, handler=handler))

    def decode(
        self,
        *args: Any,
        pre: Any = None,
        post: Any = None,
        only: Any = None,
        partial: bool = False,
        handler: ExceptionHandler = reraise_exception,
        max_bytes: int | None = None,
    ) -> Any:
        """Decode fields with imagespecs (``"rgb"``, ``"torchrgb"``, ``"pil"``...) or handlers.

        gzip, ``.npz``, ``.npy`` and ``.pth`` fields inflate to at most ``max_bytes``: by
        default the ``max_member_bytes`` given to this pipeline, else
        ``CLOUDSHARDS_MAX_DECODED_BYTES``, else ``CLOUDSHARDS_MAX_MEMBER_BYTES``, else 1 GiB.
        """
        from cloudshards.decoders import make_decoder

        if max_bytes is None:
            max_bytes = _member_limit(getattr(self, "pipeline", []))
        decoder = make_decoder(
            *args, pre=pre, post=post, only=only, partial=partial, max_bytes=max_bytes
        )
        return self.map(decoder, handler=handler)

    def map_dict(self, handler: ExceptionHandler = reraise_exception, **kw: Any) -> Any:
        """Apply ``kw[field]`` to each sample's field."""
        return self.compose(transform.map_dict(handler=handler, **kw))

    def select(self, predicate: Callable[[Any], bool], **kw: Any) -> Any:
        """Keep samples for which ``predicate`` is true."""
        return self.compose(transform.select(predicate, **kw))

    def to_tuple(self, *args: Any, **kw: Any) -> Any:
        """Turn dict samples into tuples of fields (``"jpg;png"`` takes the first present).

        Right after ``.decode(...)``, the decoder is narrowed to the fields kept here: the
        others would be decoded only to be dropped.
        """
        result = self.compose(fields.to_tuple(*args, **kw))
        _narrow_decoder(result.pipeline, args)
        return result

    def map_tuple(self, *args: Any, handler: ExceptionHandler = reraise_exception) -> Any:
        """Apply one function per tuple element."""
        return self.compose(transform.map_tuple(*args, handler=handler))

    def slice(self, *args: int | None) -> Any:
        """Take ``islice(stream, *args)`` of each epoch (per worker)."""
        return self.compose(base.FilterFunction(_slice, *args))

    def rename(self, **kw: Any) -> Any:
        """Rename fields, e.g. ``rename(image="jpg;png", label="cls")``."""
        return self.compose(fields.rename(**kw))

    def rsample(self, p: float = 0.5) -> Any:
        """Keep each sample with probability ``p``."""
        return self.compose(transform.rsample(p))

    def rename_keys(self, *args: Any, **kw: Any) -> Any:
        """Rename fields by glob patterns."""
        return self.compose(fields.rename_keys(*args, **kw))

    def extract_keys(self, *args: Any, **kw: Any) -> Any:
        """Turn samples into tuples of fields matched by glob patterns."""
        return self.compose(fields.extract_keys(*args, **kw))

    def mcached(self) -> Any:
        """Keep the first pass's samples in memory and replay them on later passes."""
        from cloudshards.webdataset.filters import Cached

        return self.compose(Cached())

    def lmdb_cached(self, *args: Any, **kw: Any) -> Any:
        """Not supported (it pickles samples into LMDB): raises ``UnsupportedError``."""
        from cloudshards.webdataset.filters import LMDBCached

        return self.compose(LMDBCached(*args, **kw))

    def xdecode(self, *args: Any, **kw: Any) -> Any:
        """Decode fields by glob patterns (decoders receive a stream)."""
        return self.compose(fields.xdecode(*args, **kw))


def _member_limit(stages: list[Any]) -> int | None:
    """The ``max_member_bytes`` a reader stage was given explicitly, if any."""
    for stage in stages:
        limit = getattr(getattr(stage, "options", None), "max_member_bytes", None)
        if isinstance(limit, int):
            return limit
    return None


def _narrow_decoder(stages: list[Any], kept: tuple[Any, ...]) -> None:
    """If the stage before the last (a ``to_tuple``) decodes every field, make it decode only
    the fields ``to_tuple`` keeps. Replaces the stage in ``stages``; shared objects are not
    modified."""
    from cloudshards.decoders import Decoder

    if len(stages) < 2 or not kept or not all(isinstance(k, str) for k in kept):
        return
    stage = stages[-2]
    if not (isinstance(stage, base.FilterFunction) and stage.f is transform._map):
        return
    decoder = stage.args[0] if stage.args else None
    if type(decoder) is not Decoder or decoder.only is not None:
        return
    narrowed = copy.copy(decoder)
    narrowed.only = {name for spec in kept for name in spec.split(";")}
    stages[-2] = base.FilterFunction(stage.f, narrowed, *stage.args[1:], **stage.kw)


class FluidWrapper(DataPipeline, FluidInterface):
    """A fluent pipeline over any initial source or dataset."""

    def __init__(self, initial: Any) -> None:
        super().__init__()
        self.append(initial)
