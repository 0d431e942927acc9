"""Opening a remote shard as a :class:`~cloudshards.source.parts.PartStream`: its first GET
and its size lookup (one request where the transport's answer carries the size), and the
parts planned from the link (:mod:`cloudshards.source.adapt`)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from cloudshards.source import adapt
from cloudshards.source.options import FetchOptions, OpenOptions
from cloudshards.source.parts import _UNRANGED_HOSTS, PartStream
from cloudshards.source.resumable import ResumableStream, open_remote
from cloudshards.source.retries import IOStats, RangeIgnoredError, retry
from cloudshards.source.transport import fetch_first, fetch_range, object_at

__all__ = ["open_parts", "open_sized_parts", "plan_parts"]


def open_parts(
    url: str,
    options: OpenOptions,
    fetch: FetchOptions,
    *,
    executor: cf.ThreadPoolExecutor,
    stats: IOStats,
    shard_index: int | None = None,
    cancel: threading.Event | None = None,
) -> PartStream | ResumableStream:
    """Look up the shard's size and start its first ranged GETs (one resumable streaming GET
    for hosts known to ignore Range)."""
    stats.add(shards=1)

    def stream(start: int = 0) -> ResumableStream:
        return open_remote(
            url, options, fetch=fetch, stats=stats, shard_index=shard_index, start=start
        )

    if adapt.host_key(url) in _UNRANGED_HOSTS:
        return stream()
    source = object_at(url, options, stall_timeout_s=fetch.stall_timeout_s)

    plan = plan_parts(url, fetch)
    first: cf.Future[Any]
    details: cf.Future[dict[str, Any]]
    if hasattr(source, "cat_first"):
        # One GET brings the first part and the size (obstore: the answer's metadata).
        first, details = cf.Future(), cf.Future()
        both = executor.submit(
            fetch_first,
            source,
            plan.first_bytes,
            lambda info: _settle(details, info, None),
            options=fetch,
            stats=stats,
            cancel=cancel,
        )
        both.add_done_callback(partial(_split_first, first, details, plan.first_bytes))
    else:
        # The first part goes out with the size lookup: one round trip to first byte, and
        # the reader starts on it without waiting for the lookup.
        first = executor.submit(
            fetch_range,
            source,
            0,
            plan.first_bytes,
            size=None,
            options=fetch,
            stats=stats,
            cancel=cancel,
        )
        lookup = partial(_lookup, source, fetch, stats)
        details = executor.submit(
            retry, lookup, url=url, offset=0, options=fetch, stats=stats, what="HEAD",
            cancel=cancel,
        )  # fmt: skip
    return PartStream(
        source,
        details,
        executor=executor,
        options=fetch,
        stats=stats,
        shard_index=shard_index,
        cancel=cancel,
        first_part=first,
        open_tail=stream,
        plan=_probing(url, fetch, plan),  # claimed once the requests are out
    )


def _lookup(source: Any, fetch: FetchOptions, stats: IOStats) -> dict[str, Any]:
    """The object's metadata (size, ETag): one request."""
    stats.add(requests=1)
    return source.info(timeout=fetch.stall_timeout_s)  # type: ignore[no-any-return]


def _settle(future: cf.Future[Any], value: Any, error: BaseException | None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except cf.InvalidStateError:
        pass  # settled already (details on a retry), or cancelled by a closed stream


def _split_first(
    first: cf.Future[bytes],
    details: cf.Future[dict[str, Any]],
    requested: int,
    both: cf.Future[tuple[bytes, dict[str, Any]]],
) -> None:
    """Settle the first part and the metadata from the combined GET (``details`` usually is
    already, from the answer's headers); the part fails with RangeIgnoredError when the
    whole object came back."""
    if both.cancelled():
        first.cancel()
        details.cancel()
        return
    error = both.exception()
    if error is not None:
        _settle(first, None, error)
        _settle(details, None, error)
        return
    data, info = both.result()
    size = info.get("size")
    whole = size is not None and len(data) == int(size) > requested
    _settle(first, None if whole else data, RangeIgnoredError(data) if whole else None)
    _settle(details, info, None)


def open_sized_parts(
    url: str,
    options: OpenOptions,
    fetch: FetchOptions,
    *,
    executor: cf.ThreadPoolExecutor,
    stats: IOStats,
    size: int,
    check_size: Callable[[int], None],
    shard_index: int | None = None,
) -> PartStream:
    """Ranged GETs of an object whose size is known already (from an index): one metadata
    request first, whose size goes to ``check_size`` (which raises to refuse the object)."""
    source = object_at(url, options, stall_timeout_s=fetch.stall_timeout_s)
    began = time.perf_counter()
    # Retried like every request, and its failure a redacted ShardOpenError naming the shard.
    lookup = partial(_lookup, source, fetch, stats)
    details = retry(lookup, url=url, offset=0, options=fetch, stats=stats, what="HEAD")
    # A store that answered this fast may be measured alone (see adapt's probe).
    quick = time.perf_counter() - began <= adapt.PROBE_FIRST_BYTE_S
    if details.get("size") is not None:
        check_size(int(details["size"]))
    remember = getattr(source, "remember", None)  # a transport that pins generations
    if remember is not None:
        remember(details)
    plan = plan_parts(url, fetch)
    stream = PartStream(
        source,
        {**details, "size": size},
        executor=executor,
        options=fetch,
        stats=stats,
        shard_index=shard_index,
        plan=_probing(url, fetch, plan) if quick else plan,
    )
    stream.start()
    return stream


def plan_parts(url: str, fetch: FetchOptions) -> adapt.PartPlan:
    """The parts of the next shard of ``url``: as the settings fix them, or as the link and
    its reader measured so far size them (adaptive settings)."""
    plan = adapt.fixed_plan(fetch.part_bytes, fetch.concurrency)
    if fetch.adaptive:
        plan = adapt.plan(url, fetch.part_bytes, fetch.concurrency, plan.first_bytes)
    return plan


def _probing(url: str, fetch: FetchOptions, plan: adapt.PartPlan) -> adapt.PartPlan:
    """``plan``, for the shard that measures a connection alone if it is the host's first
    in this process (adaptive settings only; see :mod:`cloudshards.source.adapt`)."""
    if fetch.adaptive and adapt.claim_probe(url):
        return dataclasses.replace(plan, probe=True)
    return plan
