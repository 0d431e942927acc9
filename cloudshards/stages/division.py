"""Dividing the rest of an epoch among new consumers: how many samples each gets (equal
batches per rank), and each one's contiguous run of the remaining pieces (see
:mod:`cloudshards.stages.elastic`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cloudshards.stages.base import FilterFunction
from cloudshards.stages.batch import _batched
from cloudshards.stages.spans import Span

__all__ = ["Piece", "batch_size", "closed", "consumer_counts", "cut", "length"]

#: A piece of a plan: (shard number in the shard list, spans of its sample numbers).
Piece = tuple[int, list[Span]]


def batch_size(steps: Sequence[Any], loader_batch: int) -> int:
    """Samples per batch the training loop sees: the pipeline's ``.batched`` sizes times the
    loader's (1 where nothing batches).

    1 also where a ``.batched(..., partial=False)`` drops short batches: a sample given to a
    short batch could complete it, a batch more on that rank, so every rank then gets the
    same number of samples from each of its workers (as with the loader's ``drop_last``)."""
    size = max(1, int(loader_batch))
    for step in steps:
        if isinstance(step, FilterFunction) and step.f is _batched:
            names = ("batchsize", "collation_fn", "partial")
            args = dict(zip(names, step.args, strict=False)) | step.kw
            if not args.get("partial", True):
                return 1
            size *= int(args.get("batchsize", 20))
    return size


def consumer_counts(
    total: int, ranks: int, workers: int, batch: int, mode: str | None
) -> tuple[list[int], int]:
    """Samples for each new consumer (rank-major) out of ``total``, and how many of the
    ``total`` are left out (< 0: that many repeated). ``mode`` None: as even as possible."""
    consumers = ranks * workers
    if mode is None:
        base, extra = divmod(total, consumers)
        return [base + (1 if h < extra else 0) for h in range(consumers)], 0
    per_rank, left = divmod(total, ranks)
    counts = [per_rank // workers + (1 if w < per_rank % workers else 0) for w in range(workers)]
    if left and batch > 1 and not any(c % batch for c in counts) and workers > 1 and counts[0]:
        # Every worker's batches are full: move a sample from worker 0 to worker 1 on every
        # rank (worker 0 keeps its batch count, worker 1 gains one, on every rank alike).
        counts[0] -= 1
        counts[1] += 1
    partial = [w for w in range(workers) if counts[w] % batch]
    result = [list(counts) for _ in range(ranks)]
    if left and partial:
        for rank in range(left):  # the extra sample fills a partial batch: no new batch
            result[rank][partial[0]] += 1
        left = 0
    elif left and mode == "pad":
        for rank in range(ranks):
            result[rank][0] += 1
        left -= ranks
    return [count for rank in result for count in rank], left


def closed(spans: list[Span], counts: list[int] | None, shard: int) -> list[Span]:
    if counts is None:
        return spans
    return [(start, counts[shard] if stop is None else stop) for start, stop in spans]


def length(spans: list[Span]) -> int:
    return sum(max(0, int(stop) - start) for start, stop in spans if stop is not None)


def cut(sequence: list[Piece], sizes: list[int], consumer: int) -> list[Piece]:
    """Consumer ``consumer``'s contiguous run of ``sizes[consumer]`` samples of ``sequence``
    (the runs of the consumers before it come first); where the sequence runs out, the run
    repeats its own first samples (``pad``)."""
    start = sum(sizes[:consumer])
    want = sizes[consumer]
    run: list[Piece] = []
    position = 0
    for shard, spans in sequence:
        for lo, hi in spans:
            assert hi is not None
            begin, end = max(lo, lo + start - position), min(hi, lo + start + want - position)
            if begin < end:
                last = run[-1][1][-1] if run and run[-1][0] == shard else None
                if last is not None and last[1] == begin:
                    run[-1][1][-1] = (last[0], end)
                elif last is not None and int(last[1] or 0) < begin:
                    run[-1][1].append((begin, end))  # spans stay in archive order
                else:
                    run.append((shard, [(begin, end)]))
            position += hi - lo
    short = want - sum(length(spans) for _, spans in run)
    if short > 0:
        first = run[0] if run else next(((s, p) for s, p in sequence if length(p)), None)
        if first is not None:
            run.append((first[0], [(first[1][0][0], first[1][0][0] + short)]))
    return run
