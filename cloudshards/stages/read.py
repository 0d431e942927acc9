"""Shards to samples: open each shard, stream its tar members, group them into samples.

``read_shards`` and ``open_shards`` are also behind webdataset's ``tarfile_samples`` and
``url_opener``, which live in :mod:`cloudshards.webdataset.tariterators`.
Resumption: exact (:class:`ShardReader`'s state: shards begun, samples delivered from the last).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

from cloudshards import config
from cloudshards.balance import observe
from cloudshards.cache import ShardCache
from cloudshards.cache.membertable import MemberTable, table_samples
from cloudshards.errors import ConfigError
from cloudshards.finalize import close_safely
from cloudshards.grouping import group_members
from cloudshards.handlers import reraise_exception
from cloudshards.redact import redact_url
from cloudshards.source import (
    FetchOptions,
    OpenOptions,
    ShardPrefetcher,
    ShardSource,
    local_path,
)
from cloudshards.stages.positions import (
    number_of,
    positioned,
    selected,
    selecting,
    skipping,
)
from cloudshards.stages.shortfall import (
    Shortfall,
    more_after,
    owed_by,
    reader_state,
    restore_point,
    warn_uncounted,
)
from cloudshards.tar import iter_members
from cloudshards.types import ExceptionHandler, NameFilter, Sample

__all__ = [
    "ShardReader",
    "env_cache",
    "open_shards",
    "read_shards",
]

logger = logging.getLogger(__name__)


def open_shards(
    src: Iterable[dict[str, Any]],
    *,
    handler: ExceptionHandler = reraise_exception,
    options: OpenOptions | None = None,
    cache: ShardCache | None = None,
    fetch: FetchOptions | None = None,
) -> Generator[tuple[dict[str, Any], ShardSource], None, None]:
    """Yield ``(shard, stream)`` for each shard dict in ``src``, keeping the next ones in flight.

    Remote shards are prefetched and read with parallel ranged GETs and retries as ``fetch``
    says (default :meth:`FetchOptions.from_env`); with a ``cache`` they open through the node
    cache. A shard that fails to open goes to ``handler``: it raises, returns True to skip the
    shard, or False to stop. Configuration errors (unknown protocol, missing backend) always
    raise. The caller closes each stream.
    """
    options = options or OpenOptions()
    fetch = fetch or FetchOptions.from_env()
    prefetcher = ShardPrefetcher(src, options=options, fetch=fetch, cache=cache)
    for shard, opened in prefetcher:
        if not isinstance(opened, BaseException):
            yield shard, opened
            continue
        if isinstance(opened, ConfigError) or not isinstance(opened, Exception):
            raise opened
        if not handler(opened):
            return
        logger.debug("skipped shard %s after open error", redact_url(shard["url"]))


def read_shards(
    src: Iterable[dict[str, Any]],
    *,
    handler: ExceptionHandler = reraise_exception,
    options: OpenOptions | None = None,
    name_filter: NameFilter | None = None,
    cache: ShardCache | None = None,
    fetch: FetchOptions | None = None,
) -> ShardReader:
    """Yield the samples of each shard in ``src`` (dicts with a ``url``), in order.

    A shard that fails to open or parse goes to ``handler``: it raises, returns True to skip
    the rest of that shard (for a member over the size limit, only its sample) and go on, or
    False to stop. Every sample of a damaged shard that is complete before the damage is
    delivered first (see :func:`~cloudshards.grouping.group_members`); a sample the damage
    may have cut short never is. Configuration errors (unknown protocol, missing backend)
    always raise.
    With a ``cache``, shards open through the node cache. Remote shards are prefetched and
    read with parallel ranged GETs as ``fetch`` says (default :meth:`FetchOptions.from_env`).

    Returns a :class:`ShardReader`: an iterator that a pipeline saves and restores (its
    ``state_key`` is ``"reader"``).
    """
    return ShardReader(src, handler, options, name_filter, cache, fetch)


class ShardReader(Iterator[Sample]):
    """The running shard reader: the samples of each shard in order, and its position.

    Its position is (shards begun, samples read from the last one: delivered, or lost to a
    member too large), counted over the shards its source yields in this pass; balancing's
    per-shard ``skip``/``take`` apply within each shard. Iterating it iterates one generator
    (no method call per sample); :meth:`state_dict` reads the counters that generator keeps.

    Resumption: exact (state ``{"shards": n, "samples": m}``: the first ``n - 1`` shards are
    skipped without opening them, and the first ``m`` samples of the next without reading
    their data).
    """

    state_key = "reader"

    def __init__(
        self,
        src: Iterable[dict[str, Any]],
        handler: ExceptionHandler,
        options: OpenOptions | None,
        name_filter: NameFilter | None,
        cache: ShardCache | None,
        fetch: FetchOptions | None,
    ) -> None:
        self._src = src
        self._handler = handler
        self._options = options
        self._name_filter = name_filter
        self._cache = cache
        self._fetch = fetch
        #: [shards begun, samples read from the last]; updated by the generator.
        self._position = [0, 0]
        #: Shortfall's [repeats put off, given since the last sample, 1 in a balanced shard].
        self._repeats = [0, 0, 0]
        self._quiet = False  # read the sample at the resume point again, without delivering it
        self._resume: tuple[int, int] | None = None
        self._select: dict[int, frozenset[int]] | None = None
        #: In select mode, the URL of each shard number selected (once it is reached).
        self.selected_urls: dict[int, str] = {}
        self._it: Iterator[Sample] | None = None

    @property
    def position(self) -> list[int]:
        """The live ``[shards begun, samples delivered from the last]``: right after a sample
        is delivered, it is that sample's (shard number + 1, sample number + 1) in this pass
        (a shuffle buffer downstream notes it for each item it takes)."""
        return self._position

    def select(self, places: Iterable[tuple[int, int]]) -> None:
        """Deliver only the samples at ``places`` ((shard number, sample number) as
        :attr:`position` numbers them), in that numbering's order; the other shards are not
        opened, the other samples' data not read where the shard can skip it (to read a
        restored shuffle buffer's samples again). Before iterating."""
        if self._it is not None:
            raise RuntimeError("a ShardReader selects samples before it starts reading")
        wanted: dict[int, set[int]] = {}
        for shard, sample in places:
            wanted.setdefault(shard, set()).add(sample)
        self._select = {shard: frozenset(samples) for shard, samples in wanted.items()}

    def __iter__(self) -> Iterator[Sample]:
        if self._it is None:
            # The generator must not refer back to this object: a cycle would keep it (and
            # its open shard) alive after the chain is dropped, until the cyclic GC runs.
            self._it = _read(
                self._src,
                self._handler,
                self._options,
                self._name_filter,
                self._cache,
                self._fetch,
                self._resume,
                self._position,
                self._repeats,
                self._quiet,
                self._select,
                self.selected_urls,
            )
        return self._it

    def __next__(self) -> Sample:
        return next(self.__iter__())

    def close(self) -> None:
        """Stop reading (closes the open shard and the prefetcher's threads)."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def state_dict(self) -> dict[str, Any]:
        """``{"shards": shards begun, "samples": delivered from the last}``; ``{}`` before any
        (and in a balanced shard where to read again: see :func:`reader_state`)."""
        return reader_state(self._position, self._repeats)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after what :meth:`state_dict` said was delivered (before iterating)."""
        if self._it is not None:
            raise RuntimeError("a ShardReader is restored before it starts reading")
        self._resume, self._quiet = restore_point(state, self._repeats)


def _read(
    src: Iterable[dict[str, Any]],
    handler: ExceptionHandler,
    options: OpenOptions | None,
    name_filter: NameFilter | None,
    cache: ShardCache | None,
    fetch: FetchOptions | None,
    resume: tuple[int, int] | None,
    position: list[int],
    repeats: list[int],
    quiet: bool = False,
    select: dict[int, frozenset[int]] | None = None,
    selected_urls: dict[int, str] | None = None,
) -> Iterator[Sample]:
    """:class:`ShardReader`'s generator: keeps ``position`` up to date as it delivers."""
    options = options or OpenOptions()
    numbered: deque[tuple[dict[str, Any], int, int]] = deque()
    if select is None:
        source = positioned(src, resume, numbered)
    else:
        source = selected(src, select, {} if selected_urls is None else selected_urls)
    shortfall = Shortfall(position, repeats, repeats[1] if quiet else 0)

    def opening(exn: BaseException) -> bool:  # a shard that fails to open: stop, or go on?
        go = handler(exn)
        shortfall.stopped = shortfall.stopped or not go
        return go

    shards = open_shards(source, handler=opening, options=options, cache=cache, fetch=fetch)
    try:
        samples = _read_opened(shards, handler, options, name_filter, position, numbered, shortfall)
        if quiet:
            next(samples, None)  # the sample being repeated at the checkpoint: delivered then
        yield from samples
    finally:
        shards.close()  # stops the prefetcher's threads now, not when garbage-collected


def _read_opened(
    shards: Iterator[tuple[dict[str, Any], Any]],
    handler: ExceptionHandler,
    options: OpenOptions,
    name_filter: NameFilter | None,
    position: list[int],
    numbered: deque[tuple[dict[str, Any], int, int]],
    shortfall: Shortfall,
) -> Iterator[Sample]:
    dropped: list[tuple[dict[str, Any], int, int]] = []
    for shard, stream in shards:
        url = shard["url"]
        index = shard.get("shard_index")
        number = number_of(numbered, shard, dropped)
        if shortfall.stopped:  # a handler said stop: the pass ends here
            break
        yield from shortfall.unopened(dropped)
        dropped.clear()
        del position[2:]  # no longer repeating a sample (see Shortfall)
        position[0], position[1] = (position[0], 0) if number is None else number
        position[0] += 1
        begun = position[1]
        chosen = shard.get("select")
        owes = owed_by(shard)
        balanced = owes is not None
        shortfall.repeats[2] = balanced
        held: Sample | None = None
        held_at = lost = 0  # the number of the last sample held; samples dropped
        skip = shard.get("skip", 0)
        record: MemberTable | None = None
        try:
            members_filter: NameFilter | None
            if chosen is not None:
                members_filter = selecting(name_filter, chosen)
            else:
                members_filter = skipping(name_filter, skip) if skip else name_filter
            samples = _samples_by_table(stream, url, members_filter, options, index, handler)
            if samples is None:
                if hasattr(stream, "save_member_table"):
                    record = MemberTable()  # a complete parse lets later epochs slice by offset
                members = iter_members(
                    stream,
                    url=url,
                    name_filter=members_filter,
                    block_bytes=options.block_bytes,
                    max_member_bytes=options.member_limit(),
                    record=record,
                    skip_oversized=True,
                )
                samples = group_members(
                    members,
                    url=url,
                    shard_index=index,
                    name_filter=members_filter,
                    on_duplicate=handler,
                    on_oversize=handler,
                    max_sample_bytes=options.sample_limit(),
                    # webdataset 1.0.2's (a member table's shard is remote: it has none)
                    local_path=local_path(url),
                )
            whole: Iterator[Sample] | None = None  # a shard read to where its count ends
            if chosen is not None:  # stop after the last one: the rest is not needed
                samples = itertools.islice(samples, len(chosen))
                record = None
            elif "take" in shard:
                if shard.get("skip", 0) + shard["take"] == shard.get("count"):
                    whole = samples = iter(samples)
                samples = itertools.islice(samples, shard["take"])
            places = shard.get("select_places")
            if places is not None:  # selected samples: their own numbers, in order
                position[0] = places[0] + 1
                numbers = iter(places[1])
            for sample in samples:
                if places is None:
                    position[1] += 1
                else:
                    position[1] = next(numbers) + 1
                if not sample:  # dropped for a member too large (the handler went on)
                    lost += 1
                    continue
                if balanced:  # as delivered: what a shortfall repeats (stages may change it)
                    held, held_at = sample.copy(), position[1]
                yield sample
            if whole is not None and more_after(whole):
                warn_uncounted(url, shard["count"])
            if record is not None and record.complete:
                stream.save_member_table(record)
            if "observe" in shard and not (chosen or "take" in shard):
                # Read to its end (from a restored position too: the number counts from the
                # shard's first sample): its count.
                where, key = shard["observe"]
                observe(where, key, position[1])
        except ConfigError:
            raise
        except Exception as exn:
            # An error the handler already answered (duplicate, oversized member): not asked again.
            if getattr(exn, "handled", False) or not handler(exn):
                return
            logger.debug("skipped rest of shard %s after error", redact_url(url))
        finally:
            close_safely(stream.close)  # at once, unless the garbage collector closes us
        if owes is not None:
            if held is not None:
                shortfall.note(held, held_at)
            yield from shortfall.pad(shard, owes - (position[1] - begun) + lost)
    if shortfall.stopped:  # a handler said stop: the pass ends here
        return
    yield from shortfall.unopened(numbered)  # after the last one opened, none did
    numbered.clear()
    yield from shortfall.settle()


def _samples_by_table(
    stream: Any,
    url: str,
    name_filter: NameFilter | None,
    options: OpenOptions,
    shard_index: int | None,
    handler: ExceptionHandler,
) -> Iterator[Sample] | None:
    """A cached shard's samples sliced by its saved member table, or None to parse it."""
    member_table = getattr(stream, "member_table", None)
    if not callable(member_table):
        return None
    table = member_table()
    if table is None:
        return None
    stream.count_bytes(os.fstat(stream.fileno()).st_size)
    return table_samples(
        stream.fileno(),
        table,
        url=url,
        name_filter=name_filter,
        max_member_bytes=options.member_limit(),
        max_sample_bytes=options.sample_limit(),
        shard_index=shard_index,
        on_duplicate=handler,
        on_oversize=handler,
    )


def env_cache() -> ShardCache | None:
    """The node cache the environment names (``CLOUDSHARDS_CACHE_DIR`` or ``WDS_CACHE``)."""
    directory, max_bytes = config.cache_defaults()
    return None if directory is None else ShardCache(directory, max_bytes=max_bytes)
