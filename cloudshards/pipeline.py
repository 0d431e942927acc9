"""DataPipeline: a chain of stages that is a torch IterableDataset (fluent methods: fluid.py).

Each ``iter()`` is one epoch: the pipeline detects rank and worker, makes the (seed, epoch)
context current while its stages run (so shard order and shuffles are deterministic and
change per epoch), and builds a fresh iterator chain. Stateful stages' running iterators are
found by their ``state_key`` while the chain is built (:mod:`cloudshards.stages.base`); the
pipeline nests their states in its own, restores them at the next ``iter()`` and fingerprints
every stage's configuration (:mod:`cloudshards.stages.state`). Fluent methods return a new
pipeline (but ``with_length``, ``with_epoch`` and ``repeat``, as in webdataset)."""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from cloudshards import config
from cloudshards.dist import check_ranks, effective_info, one_reader_for_all_ranks
from cloudshards.fluid import FluidInterface
from cloudshards.length import Length
from cloudshards.process import freeze_inherited_objects, in_dataloader_worker
from cloudshards.seeding import default_seed, epoch_context
from cloudshards.stages import base, elastic
from cloudshards.stages.base import IterationContext, PipelineStage, flush_checkpoint_warnings
from cloudshards.stages.elastic import ELASTIC_KEY, gathered
from cloudshards.stages.epoch import EpochLimiter
from cloudshards.stages.rebuffer import connect, is_reader, read_again, snapshot
from cloudshards.stages.shuffle import ShuffleIterator
from cloudshards.stages.state import (
    STATE_VERSION,
    LiveEpoch,
    StageRegistry,
    check_consumer,
    legacy_fingerprint,
    pipeline_fingerprint,
    validated,
)
from cloudshards.workerpipe import serve_plain_dataloaders, warn_if_read_in_workers

__all__ = ["DataPipeline", "FluidInterface", "FluidWrapper", "default_seed"]

logger = logging.getLogger(__name__)
serve_plain_dataloaders()  # importing the module (to make or to unpickle a dataset)


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
        replication: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self._ranks = check_ranks(rank, world_size)
        self.replication = int(replication)  # ranks per model-parallel group: same samples
        self.pipeline: list[Any] = []
        self.repetitions = 1
        self.nsamples = -1
        self.seed = default_seed() if seed is None else int(seed)
        # A seed the user chose (argument or environment) alone fixes the order of each epoch.
        self._seed_given = seed is not None or config.env_seed() is not None
        self._epoch = 0
        self._epoch_set = False
        self._epoch_from_user = False  # set_epoch was called since a WebLoader last pushed
        self._length: int | None = None
        self._live: LiveEpoch | None = None  # the running epoch, for state_dict
        self._resume: dict[str, Any] | None = None
        for arg in args:
            if arg is None:
                continue
            if isinstance(arg, list):
                self.pipeline.extend(arg)
            else:
                self.pipeline.append(arg)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next ``iter()``; later iterations count up from it.

        Call it with the same value on every rank (as with ``DistributedSampler``) so that all
        ranks agree on the shard order; DataLoader workers receive it with the dataset.
        """
        self._epoch = int(epoch)
        self._epoch_set = True
        self._epoch_from_user = True
        self.__dict__["_changes"] = self.__dict__.get("_changes", 0) + 1  # see __iter__

    def _push_epoch(self, epoch: int) -> None:
        # A WebLoader keeping this dataset in step: like set_epoch, but not the user's choice.
        self.set_epoch(epoch)
        self._epoch_from_user = False

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will run."""
        return self._epoch

    def _context(self, epoch: int | None = None) -> IterationContext:
        context = epoch_context(
            self.seed,
            self._epoch if epoch is None else epoch,
            info=effective_info(self._ranks, self.replication),
            seed_given=self._seed_given,
            # A StatefulLoader's first pass needs no set_epoch (Lightning starts workers first).
            epoch_set=self._epoch_set or self.__dict__.get("_loader_passes") == 1,
            stages=self.pipeline,
        )
        # An epoch without sample counts, that a loader ends for every rank at once.
        context.count_free = self.__dict__.get("_count_free") == context.epoch
        return context

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
        return iter(self._chain(None))

    def _chain(self, registry: StageRegistry | None, pipeline: list[Any] | None = None) -> Any:
        # One pass's chain (``pipeline``: an elastic restore's plan); iterators to ``registry``.
        pipeline = self.pipeline if pipeline is None else pipeline
        if not pipeline:
            raise ValueError("DataPipeline has no source")
        # A restored buffer is read again through copies of the stages taken now (snapshot).
        steps = snapshot(pipeline) if registry is not None and registry.restores else []
        context = base.current_context()
        draws = context.draws if context else 0  # before this chain's (see read_again)
        source: Any = None
        reader: tuple[int, Any] | None = None
        for number, step in enumerate(pipeline):
            source = self.invoke(step, source) if number else self.invoke(step)
            if is_reader(source):
                reader = (number, source)
            elif isinstance(source, ShuffleIterator):
                connect(pipeline, source, number, reader)
            if registry is not None:
                registry.track(source)
                if isinstance(source, ShuffleIterator) and source.pending:
                    found = read_again(self.invoke, steps, number, source.pending, draws)
                    source.refill(*found)
        return iter(source)

    def iterator(self, epoch: int | None = None) -> Iterator[Any]:
        """Run ``repetitions`` passes (stopping early if a pass yields nothing), at most
        ``nsamples`` items (``with_epoch``), resuming where ``load_state_dict`` says."""
        freeze_inherited_objects()  # in a DataLoader worker: see its docstring
        if not one_reader_for_all_ranks(self):  # a rank whose loader nobody reads
            return
        context = self._context(epoch)
        context.bounded = self.nsamples > 0
        resume, self._resume = self._resume, None
        passes = EpochLimiter(self.repetitions, self.nsamples)
        saved: dict[str, Any] | None = None
        if resume is not None and ELASTIC_KEY in resume and resume["epoch"] != context.epoch:
            resume = None  # an elastic restore is for its own epoch only
        pipeline, plan = None, None
        if resume is not None:
            if ELASTIC_KEY not in resume:
                check_consumer(resume, context.info)
            context.seed = int(resume["seed"])
            context.resumed = True
            pipeline, plan = elastic.restore(self, resume, context)
            saved = dict(resume.get("stages", {}))
            passes.load_state_dict(saved.pop(passes.state_key, {}))
            passes.nsamples = (plan or {}).get("limit", passes.nsamples)
        live = LiveEpoch(context.epoch, context.seed, context.info, passes, plan)
        self._live = live
        custom = type(self).iterator1 is not DataPipeline.iterator1  # a subclass builds it
        limit = passes.limit
        yielded = passes.yielded
        # A restored pass may have nothing left (saved after its last item): not the epoch's end.
        resumed_pass = resume is not None
        try:
            for repetition in range(passes.repetition, self.repetitions):
                if yielded >= limit:
                    break
                passes.repetition = repetition
                context.start_pass(repetition)
                # Only the first pass of a restored epoch resumes its stages.
                registry = live.registry = StageRegistry(saved, {passes.state_key: passes})
                build = self.iterator1 if custom else partial(self._chain, registry, pipeline)
                saved, pipeline = None, None
                count = 0
                for sample in base.run_in_context(context, build):
                    count += 1
                    yielded += 1
                    passes.yielded = yielded
                    yield sample
                    if yielded >= limit:
                        break
                if count == 0 and not resumed_pass:
                    break
                resumed_pass = False
        except Exception:  # a stage raised: its traceback keeps the chain alive until the
            if isinstance(live.registry, StageRegistry):  # collector runs, so close the
                live.registry.close()  # readers' shards and threads now
            raise
        finally:
            # Stopped early (closed, dropped, an error) or done: keep what the stages said and
            # let their iterators go, so that a dropped epoch closes its shards at once.
            live.freeze()
        if self._live is live:
            self._live = None
        self.__dict__["_ended"] = context.epoch  # ran to its end: see load_state_dict

    def __iter__(self) -> Iterator[Any]:
        if self.__dict__.pop("_skip_ended", False):
            return iter(())  # torchdata's one more batch after the share ended: none
        self.__dict__["_ended"] = None
        unstarted = self.__dict__.get("_unstarted")  # the last iterator, the epoch's changes
        if unstarted == (self._live, self.__dict__.get("_changes", 0)):
            self._epoch = unstarted[0].epoch  # it never ran (torchdata drops one): not spent
        for stage in self.pipeline:
            # WebLoader: keep the wrapped dataset's epoch in step with ours. One the user set on
            # the dataset since our last push wins, unless the loader's own was set explicitly.
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
        passes = EpochLimiter(self.repetitions, self.nsamples)
        self._live = LiveEpoch(self._epoch, None, None, passes)
        self.__dict__["_unstarted"] = (self._live, self.__dict__.get("_changes", 0))
        self._epoch += 1
        return it

    def _fingerprint(self) -> tuple[str, list[str]]:
        return pipeline_fingerprint(self)  # what a state must match

    def state_dict(self) -> dict[str, Any]:
        """Where this process's stream is: the epoch, its effective seed, and each stateful
        stage's position under its key (``"passes"``: pass and items delivered; ``"reader"``:
        shards begun and samples delivered from the last one; ``"shuffle"``: the positions of
        the buffered samples and the RNG state); see :mod:`cloudshards.stages.state` for the
        format.

        Restoring it with :meth:`load_state_dict` continues exactly after the last item
        delivered, shuffle buffers included (their samples are read again by position; see
        :class:`~cloudshards.stages.shuffle.ShuffleIterator` for when a buffer cannot be).
        Under ``StatefulDataLoader`` each worker saves and restores its own.
        """
        live = self._live
        digest, layout = self._fingerprint()
        flush_checkpoint_warnings()  # met while the pipeline snapshot itself: told now
        state: dict[str, Any] = {"version": STATE_VERSION, "fingerprint": digest}
        state["layout"] = layout
        if live is None:
            if not in_dataloader_worker():
                warn_if_read_in_workers(self)
            info = effective_info(self._ranks, self.replication)
            epoch, seed, stages = self._epoch, None, {}
        else:
            info = live.info or effective_info(self._ranks, self.replication)
            epoch, seed = live.epoch, live.seed
            stages = live.registry.state_dict()
        state.update(
            epoch=epoch,
            seed=seed,
            consumer=[info.rank, info.world_size, info.worker, info.num_workers],
            stages=stages,
        )
        if live is not None and live.plan is not None:
            state.update(live.plan)  # this consumer's part of an elastic restore's epoch
        if self.__dict__.get("_count_free") == epoch:
            state["count_free"] = True  # its restore is one too (cloudshards.countfree)
        if live is None and self.__dict__.get("_ended") is not None:
            state["ended"] = self.__dict__["_ended"]  # the epoch whose pass it finished
        if seed is None and self._resume is not None:  # a restore not started yet: keep it
            pending = self._resume
            keep = elastic.PENDING if ELASTIC_KEY in pending else elastic.KEPT
            state.update({key: pending[key] for key in (*keep, "seed") if key in pending})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next ``iter()`` resumes that epoch.

        ``state`` may also be ``{"elastic": [every consumer's state]}``, saved by another
        number of ranks or DataLoader workers (an elastic restore; :class:`StatefulLoader`
        makes it from a gathered checkpoint): this process then takes its share of the
        samples that epoch had left (see :mod:`cloudshards.stages.elastic`). States of version
        1 (saved before stages owned their state) are read too.

        Raises:
            StateMismatchError: The state is from another dataset or configuration (other
                shards, seed, epoch length, or stage configuration: a shuffle buffer or batch
                size), or from another rank/worker layout (outside an elastic restore).
        """

        def check(one: Any) -> dict[str, Any]:
            legacy = partial(legacy_fingerprint, type(self).__name__, self.pipeline)
            return validated(one, self._fingerprint(), legacy)

        if isinstance(state, dict) and ELASTIC_KEY in state:
            extra = {key: state[key] for key in elastic.PENDING[1:] if key in state}
            state = {**gathered(state[ELASTIC_KEY], check), **extra}
        else:
            state = check(state)
        self.set_epoch(int(state["epoch"]))  # a WebLoader around it continues from this epoch
        # Saved by a DataLoader worker after its share ended (not the loader's epoch): in a
        # worker it yields nothing more this epoch; elsewhere it is the next epoch's start.
        self.__dict__["_skip_ended"] = state.get("ended") is not None and in_dataloader_worker()
        self.__dict__["_count_free"] = self._epoch if state.get("count_free") else None
        positions = (*elastic.KEPT, ELASTIC_KEY)  # plan, limit: an elastic restore's epoch
        if state.get("seed") is None or not any(state.get(key) for key in positions):
            self._resume = None
        else:
            self._resume = dict(state)

    __len__ = Length()

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

    # with_length, with_epoch and repeat change the pipeline and return it, as webdataset's
    # do (programs call ds.with_epoch(n) without using the result); the others copy.

    def with_length(self, n: int, silent: bool = False) -> Any:
        """Make ``len()`` of this pipeline ``n`` (not what is iterated); returns it."""
        self._length = int(n)
        if not silent:
            logger.info("with_length(%d) sets __len__ only; the epoch is unchanged", n)
        return self

    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> Any:
        """Make this pipeline's epochs exactly ``max(nsamples, nbatches)`` items long (its
        passes repeated as needed: every worker of every rank yields the same count, the fix
        for DDP hangs); returns the pipeline."""
        self.repetitions = sys.maxsize
        self.nsamples = max(nsamples, nbatches)
        return self

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> Any:
        """``nepochs`` passes (forever if < 1), at most ``nbatches`` (unless one, as webdataset)."""
        self.repetitions = nepochs if nepochs > 0 else sys.maxsize
        self.nsamples = nbatches if self.repetitions != 1 else -1
        return self

    def close(self) -> None:
        """Close every stage that has a ``close`` method."""
        for step in self.pipeline:
            close = getattr(step, "close", None)
            if callable(close) and not isinstance(step, DataLoader):
                close()


class FluidWrapper(DataPipeline, FluidInterface):
    """A fluent pipeline over any initial source or dataset."""

    def __init__(self, initial: Any) -> None:
        super().__init__()
        self.append(initial)
