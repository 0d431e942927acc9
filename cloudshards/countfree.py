"""Balanced epochs that the ranks end together, with or without sample counts.

Balancing by counts (:mod:`cloudshards.balance`) hands every rank and worker the same number
of samples. Two things remain that it cannot settle alone, and that cloudshards' own loaders
(:class:`~cloudshards.WebLoader`, :class:`~cloudshards.StatefulLoader`) settle when they drive
a multi-rank job:

- A sample dropped after the reader (a ``select``, an ``rsample``, a ``slice``, a stage
  whose handler continues past a damaged sample) can leave one rank a batch short, and DDP
  then waits for it at an all-reduce forever. For pipelines with such a stage, after every
  batch but the first the ranks check (one small all-reduce on a gloo group) that all of
  them still have one; the first rank to run out ends the epoch for all, and every rank
  takes the same number of steps. The batches the others had left are not delivered this
  epoch (as ``balance="drop"`` leaves out a few). The ranks first meet once per loader, so a
  loader that only some ranks iterate waits once and then runs unchecked; the first batch
  goes unchecked so that a look at one batch on one rank takes no part.
  ``CLOUDSHARDS_END_TOGETHER=0`` turns the check off.
- Counts need every shard's number of samples before the first one is read; without an index
  or metadata that is a counting pass over the whole dataset on every node. Instead:

  1. At the start of an epoch the ranks say, through the job's rendezvous store, whether they
     know the counts. A rank that does not hear from every other one within two minutes (a
     loader iterated on some ranks only) balances by counts as before, and neither waits nor
     checks for that loader again: never a hang.
  2. If some rank lacks them (and the shards are remote, at least one per worker of the job),
     the epoch runs *count-free*: each rank and worker reads whole shards (split as webdataset
     splits them), notes the count of each shard it reads whole, and the ranks end the epoch
     together as above.
  3. At its end the ranks pool the counts they noted; the next epochs balance by counts.

Bytes read before the first sample: the first shards of each worker, not the dataset; in the
first epoch each node reads its own shards once. ``CLOUDSHARDS_COUNT_FREE=0`` counts first
instead (an exact first epoch, for a counting pass per node).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as torch_dist

from cloudshards import config
from cloudshards.balance import (
    counts_file,
    observe,
    observed,
    save_counts,
    saved_counts,
    seen_file,
)
from cloudshards.dist import WorkerInfo, effective_info
from cloudshards.handlers import reraise_exception
from cloudshards.urls import protocol_of

__all__ = ["CountFree"]

logger = logging.getLogger(__name__)

#: How long a rank waits to hear from every other one before balancing by counts instead
#: (``CLOUDSHARDS_RANKS_WAIT_S``).
DECIDE_TIMEOUT_S = 120


class CountFree:
    """A loader's count-free epochs (see the module's doc); one per loader."""

    def __init__(self) -> None:
        self._rounds = itertools.count()
        self._group: _Group | None = None
        self._free = False  # this epoch runs count-free
        self._solo = False  # some rank does not iterate this loader
        self._met = False  # every rank said it iterates this loader
        self._counted = False  # every rank said it knows the counts
        self._id: int | None = None  # this loader among this process's over the same data
        self._check_first = False  # the ranks met for this epoch: check its first batch too
        self.restored = False  # the loader restored a count-free epoch: run it as one

    def begin(self, dataset: Any, workers: int, after: Sequence[Any] = ()) -> bool:
        """Before the epoch's workers start (``workers`` per rank): whether the ranks end it
        together. True for a balanced multi-rank epoch whose pipeline (or ``after``: stages
        the loader applies to its batches) can drop samples after the reader, once every rank
        said it iterates this loader (``CLOUDSHARDS_END_TOGETHER=0`` turns this off): the
        batches then stop as soon as one rank has none, so a ``select`` or a handler that
        continues can never leave a rank a batch short. The epoch also runs count-free (sets
        the dataset's flag that its workers read) when a rank lacks the counts; only for
        remote shards, at least one per worker of the job: local ones are counted from their
        headers alone, and with fewer shards the first rank to run out would end the epoch
        early. Ranks meet through the store for that every epoch, and once per loader for
        ending together."""
        restored, self.restored = self.restored, False
        self._free = False
        split = _split_of(dataset)
        if split is None or not _distributed() or self._solo:
            return False
        if not restored and not _balanced(split, dataset):
            return False
        consumers = torch_dist.get_world_size() * max(1, workers)
        free = restored or (
            config.env_bool("COUNT_FREE", True)  # CLOUDSHARDS_COUNT_FREE=0: count first
            and not self._counted
            and split.sample_limit is None
            and len(split.urls) >= consumers
            and not any(protocol_of(url) == "file" for url in split.urls)
        )
        together = config.env_bool("END_TOGETHER", True) and (
            _may_drop(getattr(dataset, "pipeline", [])) or _may_drop(after, reader_seen=True)
        )
        if not (free or together):
            return False
        verdict: bool | None = True
        self._check_first = False
        if free or not self._met:
            known = not free or (not restored and split.known_counts() is not None)
            verdict = self._everyone_knows(dataset, known)
            # Every rank is in this epoch: its first batch is checked too (see run).
            self._check_first = verdict is not None
        if verdict is None and not self._met:
            self._solo = True  # not every rank iterates this loader: never wait for it again
            logger.warning(
                "not every rank iterates this loader (no answer within %d s): balancing by "
                "counts, without ending epochs together",
                _wait_s(),
            )
            return False
        if verdict is None:  # every rank iterates it, one came late: counts, as restored
            logger.warning(
                "a rank came over %d s late to epoch %d: it balances by counts",
                _wait_s(),
                dataset.epoch,
            )
            free = restored
        self._met = True
        # Every rank knows the counts (a counts file stays): no more meetings to ask.
        self._counted = self._counted or (free and verdict is True and not restored)
        self._free = free and (restored or not verdict)
        if not (self._free or together):
            return False
        if self._group is None:  # every rank is here: safe to make the group
            self._group = _new_group()
        if not self._free:
            return True
        dataset.__dict__["_count_free"] = dataset.epoch
        if torch_dist.get_rank() == 0:
            logger.info(
                "epoch %d runs without sample counts: the ranks end it together (an index "
                "or sizes.json beside the shards balances it exactly)",
                dataset.epoch,
            )
        return True

    def run(self, batches: Iterator[Any], dataset: Any) -> Iterator[Any]:
        """``batches`` until any rank runs out (then this rank's remaining batches are read
        and dropped: a stateful loader's state then says the epoch ended, as it says on the
        rank that ran out, and a count-free epoch notes the count of every shard it began);
        then the counts noted are pooled.

        The first batch is checked too when the ranks met through the store for this epoch
        (every one of them is in it): a count-free epoch, a restored one, a loader's first;
        a rank may have no batch at all there (a restore at the last step of an epoch whose
        other ranks had batches left, a rank whose whole shards hold less than a batch).
        Otherwise it goes without a check (every rank has one, but in a freak case), so that
        a look at one batch on one rank alone (``next(iter(loader))``) takes no part in the
        ranks' collective steps."""
        check = self._check_first
        for batch in batches:
            if check and not self._all(True):
                for _ in batches:
                    pass
                break
            check = True
            yield batch
        else:
            self._all(False)
        if self._free:
            self._pool(_split_of(dataset))

    def carried(self, dataset: Any) -> dict[str, int] | None:
        """During (or right after) a count-free epoch, the counts this node noted so far, to
        travel with a checkpoint: a job restored on other nodes (or with another counts
        directory) then balances the next epoch by every count, as the job it continues
        would have. From one rank per node (they share the node's notes); None otherwise."""
        split = _split_of(dataset)
        if not self._free or split is None or WorkerInfo.detect().local_rank != 0:
            return None
        path, _ = counts_file(split.urls)
        return {**saved_counts(path), **observed(seen_file(path))}

    def take(self, dataset: Any, seen: dict[str, int], *, ended: bool = False) -> None:
        """Note counts carried by a checkpoint (:meth:`carried`) on this node, as if read
        here: the restored epoch pools them with the ones it notes itself. ``ended``: saved
        after that epoch's end, which pooled them: they are the counts the job it continues
        balances its next epoch by, and go to the counts file at once."""
        split = _split_of(dataset)
        if split is None or not seen:
            return
        path, keys = counts_file(split.urls)
        carried = {key: int(seen[key]) for key in set(keys) & set(seen)}
        if ended:  # every rank writes them (the same, under a lock): none may look first
            save_counts(path, carried)
            split._counts = None
            return
        if WorkerInfo.detect().local_rank != 0:
            return  # (one rank per node notes them)
        for key, count in carried.items():
            observe(seen_file(path), key, count)

    def _pg(self) -> Any:
        if self._group is None or self._group.pg is None:  # (None: torch's default group)
            raise RuntimeError("no group of cloudshards' to talk through (not met, or left)")
        return self._group.pg

    def _all(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MIN, group=self._pg())
        return bool(value.item())

    def _pool(self, split: Any) -> None:
        path, _ = counts_file(split.urls)
        seen = observed(seen_file(path))
        pooled: list[Any] = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(pooled, seen, group=self._pg())
        merged: dict[str, int] = {}
        for one in pooled:
            merged.update(one or {})
        save_counts(path, merged)
        split._counts = None  # ask the counts file again next epoch

    def _everyone_knows(self, dataset: Any, known: bool) -> bool | None:
        """Whether every rank knows the counts; None when some rank did not come in time.

        One verdict for all ranks: the last rank to arrive sets it to "go", a rank that waited
        in vain to "abandon", whichever comes first (an atomic compare-and-set), so a rank
        arriving late can never decide to end the epoch together with ranks that gave up."""
        store = _store()
        if store is None:
            return None
        rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
        digest = dataset._fingerprint()[0][:16]
        if self._id is None:  # the n-th loader over this data to meet: the same on every rank
            self._id = next(_loaders.setdefault(digest, itertools.count()))
        prefix = f"cloudshards/count-free/{digest}/{self._id}/{dataset.epoch}/{next(self._rounds)}"
        store.set(f"{prefix}/{rank}", "1" if known else "0")
        decision = f"{prefix}/verdict"
        if store.add(f"{prefix}/arrived", 1) == world:
            store.compare_set(decision, "", "go")
        try:
            store.wait([decision], datetime.timedelta(seconds=_wait_s()))
        except Exception as exc:  # a rank that never came: not all ranks iterate this loader
            logger.debug("no verdict from every rank: %s", type(exc).__name__)
        if store.compare_set(decision, "", "abandon") != b"go":
            return None
        return all(store.get(f"{prefix}/{other}") == b"1" for other in range(world))


def _wait_s() -> int:
    return config.env_int("RANKS_WAIT_S", DECIDE_TIMEOUT_S)


#: Per data fingerprint, how many of this process's loaders over it have met the other ranks.
_loaders: dict[str, Iterator[int]] = {}

#: Stages that can drop samples whatever their handler.
_DROPPING = frozenset({"_select", "_rsample", "_slice"})


def _may_drop(steps: Sequence[Any], *, reader_seen: bool = False) -> bool:
    """Whether a stage after the shard reader can drop samples: a select, rsample or slice, a
    stage whose handler continues past an error, or a generator of the user's own
    (``.compose(f)``, ``pipelinefilter(f)``), which may filter. (The reader makes up what it
    drops itself; a map that returns None is not looked for.)"""
    from cloudshards.datasetstages import _ShardReader

    for step in steps:
        if isinstance(step, _ShardReader):
            reader_seen = True
            continue
        if not reader_seen:
            continue
        function = getattr(step, "f", step)
        if getattr(function, "__name__", "") in _DROPPING:
            return True
        if not str(getattr(function, "__module__", "")).startswith("cloudshards"):
            return True  # the user's own stage
        handler = getattr(step, "handler", None) or (getattr(step, "kw", None) or {}).get("handler")
        if handler is not None and handler is not reraise_exception:
            return True
    return False


class _Group:
    """A gloo group made here; :func:`_leave_groups` lets go of it at exit."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg


_groups: list[_Group] = []  # this process's groups, to leave at exit
_groups_pid: list[int] = []  # the process that registered _leave_groups


def _new_group() -> _Group:
    """A gloo group of every rank (each rank calls this at the same point of the job)."""
    group = _Group(torch_dist.new_group(backend="gloo", timeout=_job_timeout()))
    if _groups_pid != [os.getpid()]:  # the first here (a forked child's are its parent's)
        _groups_pid[:] = [os.getpid()]
        _groups.clear()
        atexit.register(_leave_groups)
    _groups.append(group)
    return group


def _leave_groups() -> None:
    """Destroy this process's groups before the interpreter finalizes.

    A gloo group alive at finalization can abort the process: its worker thread, releasing a
    finished collective, takes the GIL to drop a Python object the collective captured (torch's
    thread-local state); once the interpreter is finalizing, that thread is made to exit inside
    a C++ destructor, and the process ends in "terminate called without an active exception".
    Letting go of the group here (atexit runs before finalization) joins those threads while
    they can still take the GIL: torch releases the GIL to destroy a group.
    """
    if _groups_pid != [os.getpid()]:
        return  # a forked child: the groups are its parent's
    while _groups:
        group = _groups.pop()
        pg, group.pg = group.pg, None
        try:
            if torch_dist.is_initialized() and pg in torch_dist.distributed_c10d._world.pg_map:
                torch_dist.destroy_process_group(pg)
        except Exception as exc:  # exiting anyway: the group goes with the reference below
            logger.debug("could not destroy a gloo group at exit: %s", exc)
        del pg


def _job_timeout() -> datetime.timedelta | None:
    """The timeout the job gave its default process group, for the group made here (torch's
    own default otherwise)."""
    try:
        from torch.distributed import distributed_c10d

        group = distributed_c10d._get_default_group()
        device = torch.device("cuda" if group._get_backend_name() == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except Exception:  # a torch without these internals: its default
        return None


def _distributed() -> bool:
    return bool(
        torch_dist.is_available()
        and torch_dist.is_initialized()
        and torch_dist.get_world_size() > 1
    )


def _store() -> Any:
    """The job's rendezvous store (torchrun's), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # not exposed by this torch, or no default group
        return None


def _split_of(dataset: Any) -> Any:
    """The balancing stage of a cloudshards dataset (WebDataset's), or None."""
    from cloudshards.datasetstages import _Split

    for step in getattr(dataset, "pipeline", []):
        if isinstance(step, _Split):
            return step
    return None


def _balanced(split: Any, dataset: Any) -> bool:
    """Whether this epoch is balanced across ranks (several ranks as the dataset sees them,
    no with_epoch: that one counts the items the pipeline yields, after any filter)."""
    if getattr(dataset, "nsamples", -1) > 0:
        return False
    if split.balance == "auto":
        ranks = effective_info(getattr(dataset, "_ranks", None), dataset.replication)
        return ranks.world_size > 1
    return split.balance in ("drop", "pad")
