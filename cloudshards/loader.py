"""A checkpointable DataLoader for multi-rank training: one checkpoint restores every rank.

torchdata's ``StatefulDataLoader`` saves each DataLoader worker's dataset state, which is what
an exact resume needs (see docs/distributed.md). In a multi-rank job every rank has its own
state, but frameworks write one checkpoint: PyTorch Lightning saves rank 0's
(``trainer.save_checkpoint`` runs on every rank, only rank 0 writes) and hands that same file to
every rank on restore, so the other ranks would get rank 0's position. :class:`StatefulLoader`
gathers every rank's state into the one it returns (``torch.distributed.all_gather_object``),
and on restore each rank takes its own.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as torch_dist

from cloudshards.countfree import CountFree
from cloudshards.dist import effective_info
from cloudshards.errors import StateMismatchError
from cloudshards.pipeline import DataPipeline
from cloudshards.process import SettledFork
from cloudshards.stages.elastic import ELASTIC_KEY

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "cloudshards.StatefulLoader needs torchdata (pip install 'cloudshards[resume]')"
    ) from exc

__all__ = ["StatefulLoader"]

#: The key of a state that holds every rank's.
RANKS_KEY = "cloudshards_ranks"
#: The key of the sample counts a rank's state carries from a count-free epoch.
SEEN_KEY = "cloudshards_counts_seen"
#: In a loader's state: Lightning had cut this pass at its known length (limit_train_batches);
#: the next pass, as in the run that saved it, is the next epoch, from its start.
CUT_KEY = "cloudshards_pass_cut"


class StatefulLoader(SettledFork, StatefulDataLoader):  # type: ignore[misc]
    """torchdata's ``StatefulDataLoader`` (same arguments) whose ``state_dict()`` holds every
    rank's state when ``torch.distributed`` runs on more than one rank, so that a single
    checkpoint (Lightning's, or one file saved by rank 0) restores each rank exactly.

    ``state_dict()`` is then a collective call: every rank must call it at the same step, as
    Lightning does when it checkpoints (and as a loop does that saves on every rank). With
    ``all_ranks=False`` (or one rank) it is ``StatefulDataLoader``'s own state.

    ``load_state_dict()`` takes either form: a gathered state gives each rank its own part; a
    single rank's state is loaded as it is. States saved by another number of ranks or
    workers restore elastically (``{"cloudshards_ranks": [each rank's state]}``, as
    ``state_dict()`` gathers them): the dataset in each new worker takes its share of the
    epoch's remaining samples (see :mod:`cloudshards.stages.elastic`), and the loader starts
    afresh.

    ``prefetched``: how many batches the training loop fetches ahead of the step it trains
    (``state_dict()`` then describes the position after the batches actually trained), or
    None (the default) to tell: PyTorch Lightning's data fetcher, when it iterates this
    loader, says how many it fetches ahead (one in its fit loop; otherwise a restore would
    skip the batch fetched but not trained); any other loop, none. Fetching ahead costs a
    copy of the loader's state per batch.
    """

    def __init__(
        self, *args: Any, all_ranks: bool = True, prefetched: int | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._count_free = CountFree()
        self.all_ranks = all_ranks
        self.prefetched = prefetched
        #: States before each of the last ``prefetched`` batches was fetched (oldest first).
        self._before: deque[dict[str, Any]] | None = None
        #: The Lightning data fetcher iterating this loader, if one does: it tells how many of
        #: those batches it holds untrained (none where it knows the loader's length).
        self._fetcher: weakref.ref[Any] | None = None

    def _iter_lagging(self) -> Any:
        iterator = super().__iter__()
        fetcher = None if self.prefetched is not None else _lightning_fetcher()
        self._fetcher = None if fetcher is None else weakref.ref(fetcher)
        if self.prefetched is not None:
            ahead = self.prefetched
        else:
            ahead = 0 if fetcher is None else max(0, int(fetcher.prefetch_batches))
        if ahead <= 0:
            return iterator
        self._before = deque(maxlen=ahead)
        return self._lagging(iterator, self._before)

    def _untrained(self, before: deque[dict[str, Any]]) -> int:
        """How many of the batches fetched last are not trained yet: what the Lightning
        fetcher holds (it fetches nothing ahead where it knows the length, and it learns that
        only after this loader's iterator is made), else all of them."""
        fetcher = None if self._fetcher is None else self._fetcher()
        held = getattr(fetcher, "batches", None)
        return len(before) if not isinstance(held, list) else min(len(held), len(before))

    def _lagging(self, iterator: Iterator[Any], before: deque[dict[str, Any]]) -> Iterator[Any]:
        while True:
            before.append(StatefulDataLoader.state_dict(self))
            try:
                batch = next(iterator)
            except StopIteration:
                # Ran out: nothing fetched is left untrained, so the state is the finished one
                # (Lightning checkpoints at the epoch's end after its fetcher hit the end).
                before.clear()
                return
            yield batch

    def state_dict(self) -> dict[str, Any]:
        # With batches fetched ahead: the state before the oldest of those not trained yet.
        before = self._before
        untrained = self._untrained(before) if before else 0
        state: dict[str, Any] = before[-untrained] if before and untrained else super().state_dict()
        fetcher = None if self._fetcher is None else self._fetcher()
        if getattr(fetcher, "length", None) is not None and getattr(fetcher, "done", False):
            state = {**state, CUT_KEY: True}  # Lightning's epoch of a known length is over

        world = _world_size()
        if not self.all_ranks or world <= 1:
            return state
        seen = self._count_free.carried(self.dataset)
        if seen:  # a count-free epoch: the counts noted so far travel with it
            state = {**state, SEEN_KEY: seen}
        gathered: list[Any] = [None] * world
        torch_dist.all_gather_object(gathered, state)
        return {RANKS_KEY: gathered, "world_size": world}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        states = list(state_dict[RANKS_KEY]) if RANKS_KEY in state_dict else [state_dict]
        seen: dict[str, int] = {}
        for state in states:
            seen.update(state.get(SEEN_KEY) or {})
        states = [{k: v for k, v in state.items() if k != SEEN_KEY} for state in states]
        found = [one for state in states for one in _pipeline_states(state)]
        layouts = {(int(one["consumer"][1]), int(one["consumer"][3])) for one in found}
        cut = bool(found) and all(state.get(CUT_KEY) for state in states)
        ended = cut or (bool(found) and all(state.get("_iterator_finished") for state in states))
        if seen:
            self._count_free.take(self.dataset, seen, ended=ended)
        # A count-free epoch restored mid-way runs on count-free; one that had ended is over:
        # the next epoch is balanced by the counts its state carries, as the job's next was.
        self._count_free.restored = not ended and any(one.get("count_free") for one in found)
        # Saved after the epoch's last batch but before the loop asked for one more: every
        # consumer's share ran out, and the loader was not told yet.
        spent = bool(found) and all(one.get("ended") is not None for one in found)
        elastic = bool(layouts) and layouts != {self._layout()}
        if (ended or (spent and elastic)) and isinstance(self.dataset, DataPipeline):
            # Saved after the epoch ended (Lightning's end-of-epoch checkpoint): nothing of it
            # is left, on any layout; the next epoch starts afresh, as torchdata starts it.
            # (Spent, on the same layout, torchdata's restore of the workers says so itself.)
            self.dataset.set_epoch(_next_epoch(found))
        if elastic:
            if ended or spent:
                # Spent: the loop is still in that epoch, which has nothing left: its next
                # pass yields nothing, as torchdata's own restore gives on the same layout.
                self._spent = spent and not ended
                self._before = None
                return
            self._restore_elastic(found)
            return
        restored = [int(one["epoch"]) for one in found if one.get("seed") is not None]
        if restored and not ended and isinstance(self.dataset, DataPipeline):
            self.dataset.set_epoch(max(restored))  # the epoch the workers resume; then on
        if RANKS_KEY in state_dict:
            world = _world_size()
            if len(states) != world:
                why = (
                    "but its datasets' states say the same layout"
                    if isinstance(self.dataset, DataPipeline)
                    else "and a map-style dataset's epoch (its sampler's order) restores only "
                    "on the same number of ranks"
                )
                raise StateMismatchError(
                    f"this checkpoint holds the loader states of {len(states)} ranks; this "
                    f"job has {world}, {why}"
                )
            state_dict = states[torch_dist.get_rank() if world > 1 else 0]
        self._before = None
        if cut:  # nothing of the cut pass goes on: the loader starts afresh, at the next epoch
            return
        super().load_state_dict(dict(state_dict))

    def _layout(self) -> tuple[int, int]:
        """(ranks, workers per rank) of this loader's dataset as its states name them."""
        dataset = self.dataset
        info = effective_info(getattr(dataset, "_ranks", None), getattr(dataset, "replication", 1))
        return info.world_size, max(1, int(self.num_workers))

    def _restore_elastic(self, states: list[dict[str, Any]]) -> None:
        """Give the dataset every old consumer's state: each new worker takes its share of
        what their epoch had left. The loader itself starts afresh."""
        load = getattr(self.dataset, "load_state_dict", None)
        if not callable(load):
            raise StateMismatchError("an elastic restore needs a cloudshards dataset")
        batch = int(self.batch_size or 1) if not self.drop_last else 1
        load({ELASTIC_KEY: states, "batch": batch})
        self._before = None
        self._elastic_pending = True

    def __iter__(self) -> Any:
        if self.__dict__.pop("_spent", False):
            return iter(())  # the rest of an epoch restored after its last batch: nothing
        dataset = self.dataset
        if isinstance(dataset, DataPipeline):
            # The passes so far: a missing set_epoch is worth a warning from the second on.
            dataset.__dict__["_loader_passes"] = dataset.__dict__.get("_loader_passes", 0) + 1
            if self.num_workers > 0 and not self.persistent_workers:
                self._keep_epoch_in_step(dataset)
        # Before the workers start: whether the ranks end the epoch together, and whether it
        # runs without sample counts (cloudshards.countfree).
        free = isinstance(dataset, DataPipeline) and self._count_free.begin(
            dataset, self.num_workers
        )
        iterator = self._iter_lagging()
        if getattr(self, "_elastic_pending", False) and self.num_workers > 0:
            # The workers have their copy of the dataset (with the restore); the next epoch's
            # copies must not restore again.
            self._elastic_pending = False
            if isinstance(dataset, DataPipeline):
                dataset._resume = None
        return self._count_free.run(iterator, dataset) if free else iterator

    def _keep_epoch_in_step(self, dataset: DataPipeline) -> None:
        """Fresh (non-persistent) workers copy the dataset each pass, so its epoch would never
        move: without a ``set_epoch`` since the last pass, a pass runs the epoch after the last
        one's (as a pass without workers, or with persistent ones, counts it itself), so each
        epoch reshuffles. An epoch the user set (``set_epoch``; a restored one) wins."""
        ran = self.__dict__.get("_ran_epoch")
        if ran is not None and not dataset._epoch_from_user:
            dataset._push_epoch(ran + 1)
        self._ran_epoch = dataset.epoch
        dataset._epoch_from_user = False  # taken: the next pass counts on unless set again


def _next_epoch(found: list[dict[str, Any]]) -> int:
    """The epoch after the one these consumers' states were saved in, once it ended: a
    consumer's last state may be from before its share ran out (its epoch, then) or after
    (``ended``: the epoch it finished)."""
    return 1 + max(
        int(state["ended"]) if state.get("ended") is not None else int(state["epoch"])
        for state in found
    )


def _pipeline_states(state: Any) -> list[dict[str, Any]]:
    """Every cloudshards pipeline state inside a loader's state (one per worker; a worker's
    may sit at any depth of the loader's own format)."""
    if isinstance(state, Mapping):
        if "fingerprint" in state and "consumer" in state and "version" in state:
            return [dict(state)]
        return [one for value in state.values() for one in _pipeline_states(value)]
    if isinstance(state, (list, tuple)):
        return [one for value in state for one in _pipeline_states(value)]
    return []


def _lightning_fetcher() -> Any:
    """The Lightning data fetcher iterating this loader (found on the call stack: the object
    with ``prefetch_batches`` in its loops), or None outside Lightning. Lightning restores a
    stateful loader's state but does not say what it fetched ahead, so it is read here."""
    frame: Any = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            break
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith(("lightning.pytorch.loops", "pytorch_lightning.loops")):
            fetcher = frame.f_locals.get("self")
            if getattr(fetcher, "prefetch_batches", None) is not None:
                return fetcher
        frame = frame.f_back
    return None


def _world_size() -> int:
    if torch_dist.is_available() and torch_dist.is_initialized():
        return int(torch_dist.get_world_size())
    return 1
