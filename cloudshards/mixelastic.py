"""Elastic restores of a mix by counts (:class:`~cloudshards.WeightedMix` with ``counts``).

The old consumers' mix states say how many samples each took of each dataset; the epoch has
``Q_i`` of dataset ``i`` left in all (its count's quota per old consumer, less what each
took). Each new consumer gets a share of every ``Q_i`` (so the proportions hold on every
rank), with equal totals per rank (see :func:`~cloudshards.stages.division.consumer_counts`),
and each dataset restores its own states elastically (its remaining samples divided over the
new world, each once), from which the new consumer takes its share. A dataset that some old
consumer had already read again (upsampled, a second pass) starts its epoch afresh instead:
its samples repeat anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cloudshards.dist import WorkerInfo
from cloudshards.stages.division import consumer_counts
from cloudshards.stages.elastic import ELASTIC_KEY

__all__ = ["apportion", "elastic_restore"]


def apportion(remaining: Sequence[int], totals: Sequence[int]) -> list[list[int]]:
    """Each consumer's samples of each dataset: ``remaining[i]`` of dataset ``i`` divided as
    evenly as can be, each consumer's sum ``totals[h]`` (the extra samples of each dataset go
    round the consumers that still need some; what no consumer needs is left out)."""
    consumers = len(totals)
    base = [count // consumers for count in remaining]
    result = [list(base) for _ in range(consumers)]
    need = [total - sum(base) for total in totals]
    for h in range(consumers):
        while need[h] < 0:  # fewer than the even share: from its largest dataset
            largest = max(range(len(base)), key=lambda i: result[h][i])
            result[h][largest] -= 1
            need[h] += 1
    turn = 0
    for number, count in enumerate(remaining):
        for _ in range(count % consumers):
            for _ in range(consumers):
                h, turn = turn, (turn + 1) % consumers
                if need[h] > 0:
                    result[h][number] += 1
                    need[h] -= 1
                    break
    return result


def elastic_restore(
    counts: Sequence[int],
    old: Sequence[Mapping[str, Any]],
    layout: tuple[int, int],
    info: WorkerInfo,
    batch: int,
) -> tuple[list[int], dict[str, Any]]:
    """This consumer's quotas for the rest of the epoch, and the mix state to start from
    (each dataset's elastic restore as its source state). ``old``: every old consumer's mix
    state (``{}`` for one that took nothing, ``{"ended": 1}`` for one whose share ran out),
    ``layout``: the old (ranks, workers)."""
    world, workers = layout
    quotas = [count // (world * workers) for count in counts]
    remaining = [0] * len(counts)
    sources: dict[str, list[Any]] = {str(i): [] for i in range(len(counts))}
    fresh: set[int] = set()
    for state in old:
        if state.get("ended"):
            continue  # its share ran out: nothing left
        taken = state.get("taken", [0] * len(counts))
        old_quotas = state.get("quotas", quotas)
        for number in range(len(counts)):
            remaining[number] += max(0, int(old_quotas[number]) - int(taken[number]))
            if int(state.get("passes", [0] * len(counts))[number]) > 0:
                fresh.add(number)
            saved = state.get("sources", {}).get(str(number))
            if isinstance(saved, Mapping):
                sources[str(number)].append(saved)
    totals, _ = consumer_counts(sum(remaining), info.world_size, info.num_workers, batch, "drop")
    shares = apportion(remaining, totals)
    mine = shares[info.global_worker]
    restore = {
        "alive": list(range(len(counts))),
        "taken": [0] * len(counts),
        "credits": [0.0] * len(counts),
        "passes": [0] * len(counts),
        "quotas": mine,
        "sources": {
            # Each dataset divides what it had left giving every new consumer at least its
            # share of the mix's count: it never runs short (which would read it again).
            key: {ELASTIC_KEY: states, "sizes": [share[int(key)] for share in shares]}
            for key, states in sources.items()
            if states and int(key) not in fresh
        },
    }
    return mine, restore
