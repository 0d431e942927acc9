"""Filter currying (webdataset's ``pipelinefilter``) and the per-iteration context.

The context carries (seed, epoch, rank, worker) into stages while a pipeline builds its
iterator chain, so every random stage gets a seed that is deterministic, differs per epoch and
per worker, and needs no global RNG.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from cloudshards.dist import WorkerInfo, derive_seed

__all__ = [
    "FilterFunction",
    "IterationContext",
    "PipelineStage",
    "RestCurried",
    "current_context",
    "iteration_context",
    "make_rng",
    "pipelinefilter",
]


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
    """What a pipeline knows while it builds one epoch's iterator chain.

    Attributes:
        seed: The pipeline's base seed.
        epoch: The epoch being built.
        info: Rank and worker of this process.
        repetition: Index of the pass over the data within this epoch (``with_epoch`` repeats).
    """

    seed: int
    epoch: int
    info: WorkerInfo
    repetition: int = 0
    _draws: int = field(default=0, repr=False)
    #: Reader position for ``state_dict``: [shards begun this pass, samples from the last].
    position: list[int] = field(default_factory=lambda: [0, 0])
    #: Where to resume the first pass: (shards to skip, samples to skip in the next one).
    resume: tuple[int, int] | None = None
    #: The epoch's length is set by ``with_epoch`` (so it needs no balancing).
    bounded: bool = False
    #: This epoch continues from a restored state (it may legitimately have nothing left).
    resumed: bool = False

    def stage_seed(self, salt: str) -> int:
        """A fresh seed for the next random stage: same on a rerun, new per epoch and worker."""
        self._draws += 1
        return derive_seed(
            self.seed,
            self.epoch,
            self.repetition,
            self.info.rank,
            self.info.worker,
            salt,
            self._draws,
        )


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


def make_rng(salt: str) -> random.Random:
    """An RNG for a random stage: deterministic inside a pipeline, else seeded from the OS."""
    context = current_context()
    if context is not None:
        return random.Random(context.stage_seed(salt))
    # Outside a pipeline (a filter called by hand) behave like webdataset: a fresh seed.
    return random.Random(derive_seed(os.getpid(), time.time_ns(), os.urandom(8)))
