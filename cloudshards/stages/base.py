"""The Stage protocol, filter currying (webdataset's ``pipelinefilter``) and the epoch context.

A pipeline stage is anything webdataset accepts (an iterable source, a callable
``f(src) -> iterator``, a :class:`PipelineStage`); stateless stages need nothing more. A stage
may also declare (see :class:`Stage` and :class:`StageIterator`):

- its configuration, ``stage_config()``: plain data that the pipeline's state fingerprint
  covers, so that a state saved with another configuration (shuffle buffer, batch size...)
  is refused on restore;
- its state: the iterator it returns while the pipeline runs has a ``state_key`` and
  ``state_dict()``/``load_state_dict()``. The pipeline nests each such iterator's state under
  its key, without knowing the stage's type, and hands it back at the next ``iter()``.

The context (:class:`IterationContext`) carries the read-only facts of one epoch (seed, epoch,
rank, worker, pass) into stages while the pipeline runs them, so every random stage gets a seed
that is deterministic, differs per epoch and per worker, and needs no global RNG. It holds no
position: positions are the stages' own state.
"""

from __future__ import annotations

import contextvars
import functools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from cloudshards.dist import WorkerInfo, derive_seed

__all__ = [
    "FilterFunction",
    "IterationContext",
    "PipelineStage",
    "RestCurried",
    "Stage",
    "StageIterator",
    "StatefulIterator",
    "automatic_snapshot",
    "checkpoint_warning",
    "current_context",
    "flush_checkpoint_warnings",
    "iteration_context",
    "make_rng",
    "one_item_per_sample",
    "per_sample",
    "pipelinefilter",
    "rng_state",
    "run_in_context",
    "set_rng_state",
    "stateful_key",
]

_T = TypeVar("_T")

#: True while the pipeline takes its stages' states for itself (an epoch's end, a running
#: pipeline pickled for DataLoader workers), not for a checkpoint the user asked for.
_AUTOMATIC = contextvars.ContextVar("cloudshards_automatic_snapshot", default=False)
#: Warnings about what a checkpoint cannot hold, met during such snapshots, by key.
_DEFERRED: dict[str, Callable[[], None]] = {}


@contextmanager
def automatic_snapshot() -> Iterator[None]:
    """States taken inside are the pipeline's own (see :func:`checkpoint_warning`)."""
    token = _AUTOMATIC.set(True)
    try:
        yield
    finally:
        _AUTOMATIC.reset(token)


def checkpoint_warning(key: str, warn: Callable[[], None]) -> None:
    """A stage's warning about what its state cannot hold: given now when a checkpoint was
    asked for, kept for the next :func:`flush_checkpoint_warnings` when the pipeline only
    snapshots itself (a program that never checkpoints is not told)."""
    if _AUTOMATIC.get():
        _DEFERRED.setdefault(key, warn)
    else:
        warn()


def flush_checkpoint_warnings() -> None:
    """Give the warnings kept by :func:`checkpoint_warning` (a checkpoint is being taken)."""
    while _DEFERRED:
        _DEFERRED.pop(next(iter(_DEFERRED)))()


#: Filter functions and stage classes known to give at most one item per item they take,
#: decided by that item alone (see :func:`one_item_per_sample`).
_PER_SAMPLE: set[object] = set()

_F = TypeVar("_F")


def per_sample(f: _F) -> _F:
    """Mark a filter function (or stage class) as giving at most one item per item it takes,
    decided by that item alone: ``map``, ``decode``, ``select``, ``to_tuple``..."""
    _PER_SAMPLE.add(f)
    return f


def one_item_per_sample(stage: Any) -> bool:
    """Whether ``stage`` is known to give at most one item per item, decided by that item
    alone: a shuffle buffer after such stages can be restored by reading its samples again."""
    inner = stage.f if isinstance(stage, FilterFunction) else type(stage)
    return inner in _PER_SAMPLE


@runtime_checkable
class Stage(Protocol):
    """What a pipeline stage declares beyond being callable on its source (all optional).

    ``stage_config()`` returns the configuration that decides what the stage delivers, as
    plain data (numbers, strings, booleans, None, and lists or string-keyed dicts of those):
    a shuffle's buffer size, a batch size, a shard list's URLs. The pipeline's state
    fingerprint covers it, so restoring a state saved under another configuration raises
    ``StateMismatchError``. Leave out what does not change positions (the functions a ``map``
    applies, decoders). A stage without it counts by its class name (and its ``urls`` list and
    ``balance`` mode, if it has them); a function or class used as a stage, by its own name.

    A stage with state makes the iterator it returns while the pipeline runs a
    :class:`StatefulIterator` (see :class:`StageIterator`).
    """

    def stage_config(self) -> Mapping[str, Any]:
        """The configuration the state fingerprint covers (plain data)."""
        ...


@runtime_checkable
class StatefulIterator(Protocol):
    """The running iterator of a stateful stage: the pipeline finds it by its ``state_key``.

    When a pipeline builds its chain (each ``iter()``, each pass of ``with_epoch``), every
    iterator a stage returns that has a string ``state_key`` is registered under that key (a
    second one with the same key becomes ``key.1``, then ``key.2``...). Then:

    - ``load_state_dict(state)`` is called once, before its first ``next()``, with the state
      it reported when the pipeline's state was saved, and only in the first pass of a
      restored epoch; it must not start iterating.
    - ``state_dict()`` is called between two items the pipeline delivers (under
      ``StatefulDataLoader``: after each item a worker yields). It returns the position of
      what this stage has *delivered* to the next stage, as plain JSON-able data; ``{}``
      means "at its start" and is left out of the pipeline's state.

    Resumption is exact when the stages after it hold no items between two deliveries
    (``batched`` takes exactly one batch; a shuffle buffer does not).

    The pipeline holds the iterator while its epoch runs; when the epoch ends or is dropped it
    keeps the last ``state_dict()`` and lets the iterator go. Avoid a reference cycle between
    the iterator and a generator it runs (a generator method of ``self``): the chain behind
    it, open shards included, would then wait for the cyclic garbage collector to close.
    """

    state_key: str

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class StageIterator(Iterator[_T]):
    """Convenience base class for a stateful stage's running iterator.

    Subclasses set ``state_key`` and implement ``__next__``, ``state_dict`` and
    ``load_state_dict`` (see :class:`StatefulIterator`). A stage returns one from
    ``__call__(src)`` (or :meth:`PipelineStage.run`)::

        class Numbered(StageIterator[dict]):
            state_key = "numbered"

            def __init__(self, src):
                self.src, self.count = iter(src), 0

            def __next__(self):
                sample = next(self.src)
                self.count += 1
                return {**sample, "n": self.count}

            def state_dict(self):
                return {"count": self.count} if self.count else {}

            def load_state_dict(self, state):
                self.count = int(state["count"])

    Note that ``__next__`` is a method call per item; a stage on the per-sample path that
    must be fast can return an object whose ``__iter__`` returns a generator instead (the
    shard reader does).
    """

    state_key: ClassVar[str] = ""

    def __iter__(self) -> Iterator[_T]:
        return self

    def __next__(self) -> _T:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The position of what this iterator has delivered (plain data; ``{}``: at start)."""
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result; called before the first ``next()``."""
        raise NotImplementedError


def stateful_key(it: object) -> str | None:
    """The ``state_key`` of a stage's running iterator, or None when it has no state."""
    key = getattr(it, "state_key", None)
    if isinstance(key, str) and key and callable(getattr(it, "state_dict", None)):
        return key
    return None


class PipelineStage:
    """Base class for stateful pipeline stages (webdataset's ``PipelineStage``).

    Subclasses implement ``run(src)`` (or webdataset's older ``invoke``) returning an iterator.
    """

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Return the stage's output iterator for the given source."""
        return self.invoke(*args, **kwargs)

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        """Older webdataset name for :meth:`run`."""
        raise NotImplementedError(f"{type(self).__name__} must implement run() or invoke()")


class FilterFunction:
    """A filter with its arguments bound: ``FilterFunction(f, *args)(src) == f(src, *args)``."""

    def __init__(self, f: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self.f = f
        self.args = args
        self.kw = kw

    def __call__(self, data: Any) -> Any:
        return self.f(data, *self.args, **self.kw)

    def stage_config(self) -> dict[str, Any]:
        """The filter's name and its plain-data arguments (a batch size, a slice...)."""
        from cloudshards.stages.state import plain

        name = getattr(self.f, "__qualname__", type(self.f).__name__)
        return {"filter": name, "args": plain(list(self.args)), "kw": plain(self.kw)}

    def __repr__(self) -> str:
        return f"<{getattr(self.f, '__name__', self.f)} {self.args} {self.kw}>"

    __str__ = __repr__


class RestCurried:
    """Curries all arguments but the first: ``RestCurried(f)(*args)(src) == f(src, *args)``."""

    def __init__(self, f: Callable[..., Any]) -> None:
        self.f = f

    def __call__(self, *args: Any, **kw: Any) -> FilterFunction:
        return FilterFunction(self.f, *args, **kw)


def pipelinefilter(f: Callable[..., Any]) -> RestCurried:
    """Turn ``f(src, *args, **kw)`` into a filter factory, as webdataset's decorator does."""
    result = RestCurried(f)
    functools.update_wrapper(result, f)
    return result


@dataclass
class IterationContext:
    """What a pipeline's stages may read while it runs one epoch (never a position).

    Stages read it through :func:`current_context` (and :func:`make_rng`) while they build
    their iterators and while the pipeline's ``next()`` runs them: random stages for their
    seed, splitters for rank and worker, the shard list for (seed, epoch).

    Attributes:
        seed: The pipeline's base seed (the effective one: restored from a state on resume).
        epoch: The epoch being built.
        info: Rank and worker of this process.
        repetition: Index of the pass over the data within this epoch (``with_epoch`` repeats).
        bounded: The epoch's length is set by ``with_epoch`` (so it needs no balancing).
        resumed: This epoch continues from a restored state (it may have nothing left).
    """

    seed: int
    epoch: int
    info: WorkerInfo
    repetition: int = 0
    _draws: int = field(default=0, repr=False)
    #: The epoch's length is set by ``with_epoch`` (so it needs no balancing).
    bounded: bool = False
    #: This epoch continues from a restored state (it may legitimately have nothing left).
    resumed: bool = False
    #: This epoch runs without sample counts; the loader ends it for every rank at once.
    count_free: bool = False

    def stage_seed(self, salt: str, shared: bool = False) -> int:
        """A fresh seed for the next random stage: same on a rerun, new per epoch and pass,
        and per rank and worker unless ``shared``."""
        self._draws += 1
        rank, worker = (None, None) if shared else (self.info.rank, self.info.worker)
        return derive_seed(self.seed, self.epoch, self.repetition, rank, worker, salt, self._draws)

    @property
    def draws(self) -> int:
        """How many seeds this pass's stages have drawn so far."""
        return self._draws

    def start_pass(self, repetition: int) -> None:
        """Begin a pass: its draws restart (a restore into this pass draws the same seeds)."""
        self.repetition, self._draws = repetition, 0

    @contextmanager
    def drawing_from(self, draws: int) -> Iterator[None]:
        """Draw as if ``draws`` were drawn, then go on where this was: a second chain over the
        same stages (one reading a shuffle buffer again) gets the first one's seeds."""
        now, self._draws = self._draws, draws
        try:
            yield
        finally:
            self._draws = now


_local = threading.local()


def current_context() -> IterationContext | None:
    """The context of the pipeline currently building its iterators in this thread, if any."""
    return getattr(_local, "context", None)


@contextmanager
def iteration_context(context: IterationContext) -> Iterator[IterationContext]:
    """Make ``context`` current in this thread while an iterator chain is built."""
    previous = current_context()
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


def make_rng(salt: str, shared: bool = False) -> random.Random:
    """An RNG for a random stage: deterministic inside a pipeline (the same on every rank and
    worker if ``shared``), else seeded from the OS."""
    context = current_context()
    if context is not None:
        return random.Random(context.stage_seed(salt, shared))
    # Outside a pipeline (a filter called by hand) behave like webdataset: a fresh seed.
    return random.Random(derive_seed(os.getpid(), time.time_ns(), os.urandom(8)))


def rng_state(rng: random.Random) -> list[Any]:
    """``rng``'s state as plain data (JSON), for a stage's ``state_dict``."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: Sequence[Any]) -> None:
    """Put ``rng`` back in a state :func:`rng_state` gave."""
    version, internal, gauss = state
    rng.setstate((int(version), tuple(int(x) for x in internal), gauss))


def run_in_context(context: IterationContext, build: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """Build an iterator chain and run it with ``context`` current: while ``build()`` runs and
    during every ``next()`` (the chain's generators start lazily, and random stages draw their
    seeds then), and only then, so that interleaved pipelines never see each other's."""
    local = _local
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
