"""Keeping ranks in step when balanced shards give fewer samples than they were given.

Balancing (:mod:`cloudshards.balance`) hands each reader ``take`` samples of each shard so that
every rank yields the same number; a reader that yields fewer hangs DDP at the epoch's end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from cloudshards.errors import ShardError
from cloudshards.redact import redact_url
from cloudshards.types import Sample

__all__ = ["Shortfall", "more_after", "owed_by", "reader_state", "restore_point", "warn_uncounted"]

logger = logging.getLogger(__name__)


def owed_by(shard: dict[str, Any]) -> int | None:
    """The samples ``shard`` owes its reader: balancing's ``take``, or the chosen samples of an
    elastic restore's piece; None when it owes no count (an unbalanced shard, or a shuffle
    buffer's samples read again: ``select_places``)."""
    chosen = shard.get("select")
    if chosen is None:
        return shard.get("take")
    return None if "select_places" in shard else len(chosen)


class Shortfall:
    """What balanced shards (see :func:`owed_by`) failed to give a reader: a shard with fewer
    samples than its count, one cut short by an error the handler let pass, one that never
    opened. Every rank must still yield the same number of samples (unequal counts hang DDP),
    so the shortfall repeats the last sample read, right after the shard; before any sample
    was read, at the end of the pass. A reader that read none at all raises rather than hang.

    While it repeats, the reader's ``position`` is ``[*place, *resume]``: the repeated
    sample's place (a shuffle buffer notes it: a restore reads that sample again) and where
    the repeats have got to. A checkpoint taken then resumes just before the repeated sample:
    the restored reader reads it again without delivering it, meets the same shortfall, and
    skips the repeats already given (see :func:`reader_state`).
    """

    def __init__(self, position: list[int], repeats: list[int], skip: int = 0) -> None:
        self.position = position
        #: [repeats put off to the end, repeats given since the last sample read, 1 while
        #: in a balanced shard]: the reader's state (see reader_state).
        self.repeats = repeats
        self.skip = skip  # repeats a restored reader gave before its checkpoint
        self.last: Sample | None = None
        self.place = (0, 0)
        self.first_url: str | None = None
        self.stopped = False  # a handler said stop: nothing more is made up

    def note(self, sample: Sample, number: int) -> None:
        """``sample`` (as delivered) was the last one the reader read, sample ``number`` (+ 1)
        of its current shard."""
        self.last = sample
        self.place = (self.position[0], number)
        self.repeats[1] = 0

    def pad(self, shard: dict[str, Any], short: int) -> Iterator[Sample]:
        """Make up ``short`` samples that ``shard`` did not give (now, or at the end)."""
        if short <= 0:
            return
        self.first_url = self.first_url or shard["url"]
        logger.warning(
            "%s gave %d fewer samples than balancing gave it (it has fewer samples than its "
            "count said, or a read error was let pass); repeating %s to keep ranks in step",
            redact_url(shard["url"]),
            short,
            "the last sample read" if self.last is not None else "a later sample at the end",
        )
        if self.last is None:
            self.repeats[0] += short
            return
        yield from self._repeat(short, advance=True)

    def unopened(self, entries: Iterable[tuple[dict[str, Any], int, int]]) -> Iterator[Sample]:
        """Make up the shards of ``entries`` (shard, number, samples skipped, as the reader
        numbered them) that never opened: the handler let their errors pass."""
        for shard, number, begun in entries:
            self.position[:] = [number + 1, begun]
            yield from self.pad(shard, owed_by(shard) or 0)

    def settle(self) -> Iterator[Sample]:
        """At the end of the pass: the repeats put off."""
        if not self.repeats[0]:
            return
        if self.last is None:
            raise ShardError(
                f"none of the {self.repeats[0]} samples balanced to this reader could be read "
                "(every shard of its share failed, see the warnings); its rank cannot be kept "
                "in step with the others, so it stops here rather than hang",
                url=self.first_url,
            )
        yield from self._repeat(self.repeats[0], advance=False)

    def _repeat(self, count: int, advance: bool) -> Iterator[Sample]:
        position, last, repeats = self.position, self.last, self.repeats
        assert last is not None
        resume = position[-2:]
        for _ in range(count):
            if advance:
                resume[1] += 1
                repeats[1] += 1
                if self.skip:  # given before the checkpoint this reader was restored from
                    self.skip -= 1
                    continue
            else:
                repeats[0] -= 1
            position[:] = [*self.place, *resume]
            yield dict(last)
        position[:] = resume


def reader_state(position: list[int], repeats: list[int]) -> dict[str, Any]:
    """A shard reader's state: ``{"shards": shards begun, "samples": delivered from the
    last}`` (``{}`` before any), its ``position`` and :class:`Shortfall`'s ``repeats``.

    In a balanced shard also ``"again"``, the place of the last sample read, and ``"given"``,
    the repeats of it delivered since: a restore reads that sample again (without delivering
    it), so that a shortfall after it repeats the same sample; ``"owed"``: repeats put off."""
    owed, given, balanced = repeats
    again: list[int] | None = None
    if len(position) > 2:  # repeating a sample
        again, (shards, samples) = position[:2], position[2:]
    else:
        shards, samples = position
        if balanced and samples > 0:  # the last item was the real sample there
            again, given = [shards, samples], 0
    if not shards:
        return {}
    state: dict[str, Any] = {"shards": shards, "samples": samples}
    if again is not None:
        state.update(again=again, given=given)
    if owed:
        state["owed"] = owed
    return state


def restore_point(
    state: Mapping[str, Any], repeats: list[int]
) -> tuple[tuple[int, int] | None, bool]:
    """Where a reader restored from :func:`reader_state`'s ``state`` resumes (shard number,
    samples to skip in it), and whether it reads the first sample there again quietly; sets
    ``repeats`` (owed, given) from it."""
    repeats[:] = [int(state.get("owed", 0)), int(state.get("given", 0)), 0]
    again = state.get("again")
    if again is not None:  # just before that sample
        return (int(again[0]) - 1, int(again[1]) - 1), True
    shards = int(state.get("shards", 0))
    return ((shards - 1, int(state.get("samples", 0))) if shards > 0 else None), False


_UNCOUNTED_WARNED: set[str] = set()


def warn_uncounted(url: str, count: int) -> None:
    """A shard holds more samples than the counts that balance it (rewritten since it was
    counted: a counts file keys a remote shard by its URL alone). Balancing reads only the
    counted ones, the same on every rank, so it goes on; the user is told how to count again."""
    if url not in _UNCOUNTED_WARNED:
        _UNCOUNTED_WARNED.add(url)
        logger.warning(
            "%s holds more samples than the %d its count says (rewritten since it was "
            "counted?): each epoch reads %d of them. To read them all, delete this node's "
            "counts (CLOUDSHARDS_COUNTS_DIR, default ~/.cache/cloudshards/counts) on every "
            "node, or give sample_counts= or an index",
            redact_url(url),
            count,
            count,
        )


def more_after(samples: Iterator[Sample]) -> bool:
    """Whether a shard holds a sample past its counted end (a look only: a failure there is
    not the epoch's, whose samples were all delivered)."""
    try:
        return next(samples, None) is not None
    except Exception as exc:
        logger.debug("past a shard's counted end: %s", type(exc).__name__)
        return False
