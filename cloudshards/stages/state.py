"""Pipeline state: the fingerprint of a stage layout, and the nesting of stage states.

A pipeline's ``state_dict()`` is plain data (version 2)::

    {
        "version": 2,
        "fingerprint": "<sha256 of the pipeline's seed, epoch limits and stage configs>",
        "layout": ["ShardList:1a2b3c4d", "_Split:...", ...],  # one short hash per stage
        "epoch": 3,                     # the epoch this state is in
        "seed": 123,                    # the effective seed of that epoch (None: not started)
        "consumer": [rank, world_size, worker, num_workers],
        "stages": {                     # each stateful stage's state, under its own key
            "passes": {"repetition": 0, "yielded": 17},
            "reader": {"shards": 3, "samples": 2},
            "shuffle": {"rng": [...], "buffer": [[2, 7], ...], "pulled": 29, "done": False},
        },
    }

Stages at their start report ``{}`` and are left out of ``"stages"``. Version 1 (one flat dict:
``repetition``, ``yielded``, ``shards``, ``samples``) is read by :func:`upgrade`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cloudshards.dist import derive_seed
from cloudshards.stages.base import automatic_snapshot, stateful_key

__all__ = [
    "STATE_VERSION",
    "LiveEpoch",
    "StageRegistry",
    "check_consumer",
    "describe_stage",
    "fingerprint",
    "legacy_fingerprint",
    "mismatch_message",
    "pipeline_fingerprint",
    "plain",
    "upgrade",
    "validated",
]

logger = logging.getLogger(__name__)

STATE_VERSION = 2

_SCALARS = (str, int, float, bool, type(None))


def plain(value: Any) -> Any:
    """``value`` as JSON-able data for a fingerprint: scalars, lists and string-keyed dicts
    stay; a callable (a function, a decoder) becomes ``"<callable>"``, since fixing a ``map``
    function must not invalidate a checkpoint; anything else (an RNG) ``"<TypeName>"``."""
    if isinstance(value, _SCALARS):
        return value
    if callable(value):
        return "<callable>"
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return {key: plain(item) for key, item in value.items()}
    return f"<{type(value).__name__}>"


def describe_stage(stage: Any) -> list[Any]:
    """What the fingerprint covers of one stage: its class name (a function's or class's own
    name when the stage is one) and its configuration
    (``stage_config()``; without one, its ``urls`` list if it has one, as version 1 did, and
    its ``balance`` mode if it has one: the splitter of :class:`~cloudshards.WebDataset`)."""
    if isinstance(stage, type) or inspect.isroutine(stage):
        # A class or a generator function used as a stage: by its own name.
        return [getattr(stage, "__qualname__", type(stage).__name__)]
    config = getattr(stage, "stage_config", None)
    if callable(config):
        return [type(stage).__name__, plain(dict(config()))]
    result: list[Any] = [type(stage).__name__]
    urls = getattr(stage, "urls", None)
    if isinstance(urls, list):
        result.append(plain(urls))
    balance = getattr(stage, "balance", None)
    if isinstance(balance, str):
        result.append({"balance": balance})
    limit = getattr(stage, "sample_limit", None)
    if limit is not None:  # only when set: the fingerprints of earlier states stay
        result.append({"sample_limit": plain(limit)})
    return result


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(head: Mapping[str, Any], stages: Iterable[Any]) -> tuple[str, list[str]]:
    """(fingerprint, layout) of a pipeline: ``head`` holds its own configuration (seed, epoch
    limits); the layout names each stage with a short hash of its description, so that a
    mismatch can say which stage differs."""
    described = [describe_stage(stage) for stage in stages]
    layout = [f"{part[0]}:{_digest(part)[:8]}" for part in described]
    return _digest([plain(dict(head)), described]), layout


def legacy_fingerprint(name: str, stages: Iterable[Any]) -> str:
    """Version 1's fingerprint: class names and ``urls`` lists only."""
    parts: list[Any] = [name]
    for stage in stages:
        # A stage that replaced another keeps the old class name here (``.decode()``'s).
        parts.append(getattr(stage, "v1_name", type(stage).__name__))
        urls = getattr(stage, "urls", None)
        if isinstance(urls, list):
            parts.append(urls)
    return str(derive_seed(*parts))


def upgrade(state: Mapping[str, Any]) -> dict[str, Any]:
    """A version 1 state in version 2's shape (its fingerprint is checked by the caller)."""
    stages: dict[str, Any] = {}
    if state.get("repetition") or state.get("yielded"):
        stages["passes"] = {
            "repetition": int(state.get("repetition", 0)),
            "yielded": int(state.get("yielded", 0)),
        }
    if state.get("shards"):
        stages["reader"] = {"shards": int(state["shards"]), "samples": int(state["samples"])}
    result = {key: state[key] for key in ("epoch", "seed", "consumer") if key in state}
    return {**result, "version": STATE_VERSION, "stages": stages}


def validated(state: Any, now: tuple[str, list[str]], legacy: Callable[[], str]) -> dict[str, Any]:
    """``state`` in version 2's shape, checked against this pipeline's fingerprint and layout
    (``now``; ``legacy()``: its version 1 fingerprint, for an old state).

    Raises:
        StateMismatchError: Another dataset or configuration, or not a pipeline state.
    """
    from cloudshards.errors import StateMismatchError

    version = state.get("version") if isinstance(state, dict) else None
    if version == 1:
        if state.get("fingerprint") != legacy():
            raise StateMismatchError(mismatch_message(None, []))
        return upgrade(state)
    if version == STATE_VERSION:
        if state.get("fingerprint") != now[0]:
            raise StateMismatchError(mismatch_message(state.get("layout"), now[1]))
        wrong = _position_wrong(state)
        if wrong:  # its fingerprint matches: damaged, or edited by hand
            raise StateMismatchError(
                f"a pipeline state whose {wrong} is out of range or not a count"
            )
        return dict(state)
    raise StateMismatchError(f"not a cloudshards pipeline state: {state!r:.200}")


def _position_wrong(state: Mapping[str, Any]) -> str | None:
    """Which of ``state``'s epoch, consumer and reader position is not as saved; None: none."""

    def counts(*values: Any) -> bool:
        return all(type(value) is int and value >= 0 for value in values)

    consumer, stages = state.get("consumer"), state.get("stages")
    if type(state.get("epoch")) is not int:
        return f"epoch ({state.get('epoch')!r:.40})"
    if not isinstance(consumer, list | tuple) or len(consumer) != 4 or not counts(*consumer):
        return f"consumer ({consumer!r:.60})"
    reader = stages.get("reader", {}) if isinstance(stages, dict) else None
    if not isinstance(reader, dict) or not counts(
        *(reader.get(k, 0) for k in ("shards", "samples"))
    ):
        return f"reader position ({reader!r:.60})"
    return None


def check_consumer(state: Mapping[str, Any], info: Any) -> None:
    """Refuse a state saved by another rank/worker layout than ``info``'s (a WorkerInfo)."""
    saved = list(state["consumer"])
    now = [info.rank, info.world_size, info.worker, info.num_workers]
    if saved != now:
        from cloudshards.errors import StateMismatchError

        raise StateMismatchError(
            f"state saved by rank {saved[0]}/{saved[1]}, worker {saved[2]}/{saved[3]} "
            f"cannot resume rank {now[0]}/{now[1]}, worker {now[2]}/{now[3]}: restore "
            "with the same number of ranks and DataLoader workers, or restore every rank's "
            "state at once (an elastic restore, see docs/distributed.md)"
        )


class StageRegistry:
    """The stateful iterators of one pass over the data, by key, in chain order.

    ``track(it)`` is called on each iterator a stage returns while the chain is built; a
    stateful one is registered and, when ``saved`` has its key, restored.
    """

    __slots__ = ("_saved", "iterators")

    def __init__(
        self, saved: Mapping[str, Any] | None = None, fixed: Mapping[str, Any] | None = None
    ) -> None:
        #: ``fixed``: the pipeline's own stateful parts (its epoch limiter), restored by it.
        self.iterators: dict[str, Any] = dict(fixed or {})
        self._saved = saved

    @property
    def restores(self) -> bool:
        """Whether this pass restores saved stage states."""
        return bool(self._saved)

    def track(self, it: Any) -> None:
        """Register ``it`` if it is a stage's stateful iterator (and restore it)."""
        key = stateful_key(it)
        if key is None:
            return
        unique, n = key, 0
        while unique in self.iterators:
            n += 1
            unique = f"{key}.{n}"
        self.iterators[unique] = it
        if self._saved is not None and unique in self._saved:
            it.load_state_dict(self._saved[unique])

    def close(self) -> None:
        """Close the registered iterators that can be (a shard reader: its open shard and
        its prefetcher's threads), now rather than when the collector frees them."""
        for it in self.iterators.values():
            close = getattr(it, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # the error being raised matters more
                    logger.debug("closing %s: %s", type(it).__name__, exc)

    def state_dict(self) -> dict[str, Any]:
        """Each registered iterator's state under its key (those at their start left out)."""
        result: dict[str, Any] = {}
        for key, it in self.iterators.items():
            state = it.state_dict()
            if state:
                result[key] = state
        return result


def mismatch_message(saved: Any, now: list[str]) -> str:
    """The error for a fingerprint mismatch, naming the stage that differs when the saved
    layout says (``saved``: the state's ``layout``; ``now``: this pipeline's)."""
    message = (
        "this state was saved by a different dataset or configuration (other shards or "
        "stages); refusing to resume from it"
    )
    return message + _difference(saved, now)


def _difference(saved: Any, now: list[str]) -> str:
    if not isinstance(saved, list):
        return ""
    if len(saved) != len(now):
        return f" (it has {len(saved)} stages, this pipeline {len(now)})"
    for number, (before, after) in enumerate(zip(saved, now, strict=True)):
        if before != after:
            name = after.split(":")[0]
            return f" (stage {number}, {name}, is configured differently)"
    return " (the seed or the epoch length, with_epoch/repeat, differ)"


class LiveEpoch:
    """The running epoch, for ``state_dict``: its effective seed and its stages' registry.

    Pickled (a pipeline handed to DataLoader workers while it runs), it becomes a snapshot:
    the running iterators cannot travel, their states at that moment do.
    """

    __slots__ = ("epoch", "info", "plan", "registry", "seed")

    def __init__(
        self, epoch: int, seed: int | None, info: Any, passes: Any, plan: Any = None
    ) -> None:
        self.epoch = epoch
        self.seed = seed
        self.info = info
        #: An elastic restore's part of this consumer's state (``{"plan": ...}`` or
        #: ``{"limit": n}``), saved with it.
        self.plan = plan
        self.registry: StageRegistry | _Snapshot = StageRegistry(None, {passes.state_key: passes})

    def freeze(self) -> None:
        """Keep the stages' states as they are now and release their running iterators
        (which hold the open shards and the prefetcher's threads)."""
        if isinstance(self.registry, _Snapshot):
            return
        try:
            with automatic_snapshot():
                states = self.registry.state_dict()
        except Exception:  # e.g. while the epoch is torn down at interpreter exit
            states = {}
        self.registry = _Snapshot(states)

    def __reduce__(self) -> tuple[Any, ...]:
        with automatic_snapshot():
            states = self.registry.state_dict()
        return (_thawed, (self.epoch, self.seed, self.info, states, self.plan))


class _Snapshot:
    """Stage states frozen when a running epoch was pickled."""

    __slots__ = ("states",)

    def __init__(self, states: dict[str, Any]) -> None:
        self.states = states

    def state_dict(self) -> dict[str, Any]:
        return dict(self.states)


def _thawed(
    epoch: int, seed: int | None, info: Any, states: dict[str, Any], plan: Any = None
) -> LiveEpoch:
    live = LiveEpoch.__new__(LiveEpoch)
    live.epoch, live.seed, live.info, live.plan = epoch, seed, info, plan
    live.registry = _Snapshot(states)
    return live


def pipeline_fingerprint(pipeline: Any) -> tuple[str, list[str]]:
    """What a state must match: the pipeline's seed and epoch limits, and each stage's class
    and configuration (``stage_config()``); with the layout (a short hash per stage) that
    says which one differs. Cached on the pipeline while its stages and settings stay."""
    from cloudshards.stages.epoch import EpochLimiter

    settings = (pipeline.seed, pipeline.repetitions, pipeline.nsamples)
    key = (tuple(map(id, pipeline.pipeline)), *settings)
    cached = pipeline.__dict__.get("_fingerprint_cache")
    if cached is not None and cached[0] == key:
        return cached[1]  # type: ignore[no-any-return]
    head = {
        "pipeline": type(pipeline).__name__,
        "seed": pipeline.seed,
        "passes": EpochLimiter(pipeline.repetitions, pipeline.nsamples).stage_config(),
    }
    result = fingerprint(head, pipeline.pipeline)
    pipeline.__dict__["_fingerprint_cache"] = (key, result)
    return result
