"""A ranged GET cut mid-body keeps what arrived: the retry asks for the rest only, a range
that fails for good hands its received bytes on with the error, and nothing is spliced from
an answer that is not the range asked for. (End to end, through real servers and a proxy
that cuts: ``integration/test_faults.py``.)"""

from __future__ import annotations

import io
import pickle
from typing import Any

import pytest

from cloudshards.errors import ShardOpenError
from cloudshards.source import FetchOptions, IOStats
from cloudshards.source.retries import PartialBodyError, RangeIgnoredError
from cloudshards.source.stream import status_error
from cloudshards.source.transport import fetch_range

DATA = bytes(range(256)) * 1024  # 256 KiB, every byte telling where it is
FAST = FetchOptions(retries=5, backoff_s=0.001, max_backoff_s=0.001)


class CuttingSource:
    """A store object whose every answer is cut after ``cut_after`` bytes (a link that drops
    long transfers), or at object byte ``never`` (a byte it never sends). A whole-answer read
    loses what arrived; a streamed one (``cat_range_salvage``) raises it with the cut."""

    url = "mem://bucket/shard.tar"

    def __init__(
        self,
        cut_after: int | None = None,
        never: int | None = None,
        whole: bool = False,
        etag: str | None = '"v1"',
    ) -> None:
        self.cut_after, self.never, self.whole, self.etag = cut_after, never, whole, etag
        self.asked: list[tuple[str, int, int]] = []
        self.conditions: list[str | None] = []

    def _end(self, start: int, end: int) -> int:
        stop = end if self.cut_after is None else min(end, start + self.cut_after)
        return stop if self.never is None or not start <= self.never < stop else self.never

    def cat_range(self, start: int, end: int, timeout: float | None = None) -> bytes:
        self.asked.append(("whole", start, end))
        if self._end(start, end) < end:
            raise ConnectionError("connection cut")
        return DATA[start:end]

    def cat_range_salvage(
        self, start: int, end: int, timeout: float | None = None, **kw: Any
    ) -> bytes:
        self.asked.append(("streamed", start, end))
        self.conditions.append(kw.get("expect_etag"))
        if self.whole and start > 0:
            raise RangeIgnoredError(DATA)  # a server that ignores Range on this try
        stop = self._end(start, end)
        if stop < end:
            raise PartialBodyError(DATA[start:stop], ConnectionError("cut"), self.etag, len(DATA))
        return DATA[start:end]

    def info(self, timeout: float | None = None) -> dict[str, int]:
        return {"size": len(DATA)}

    def cat(self) -> bytes:
        return DATA

    def open(self, block_bytes: int) -> io.BytesIO:
        return io.BytesIO(DATA)


def test_a_retry_asks_only_for_what_did_not_arrive() -> None:
    source = CuttingSource(cut_after=40_000)
    stats = IOStats()
    got = fetch_range(source, 10_000, 110_000, size=len(DATA), options=FAST, stats=stats)
    assert bytes(got) == DATA[10_000:110_000]
    # The first try reads the whole answer (the fast path) and loses it; then streamed tries,
    # each starting where the last one was cut.
    assert source.asked == [
        ("whole", 10_000, 110_000),
        ("streamed", 10_000, 110_000),
        ("streamed", 50_000, 110_000),
        ("streamed", 90_000, 110_000),
    ]
    assert stats.retries == 3
    assert stats.bytes == 100_000
    # After the first piece, only answers of the object that piece came from.
    assert source.conditions == [None, '"v1"', '"v1"']


@pytest.mark.parametrize("etag", [None, 'W/"v1"'])
def test_without_a_strong_etag_nothing_is_kept(etag: str | None) -> None:
    # Nothing would tell another version's rest from this one's: every try reads it all.
    source = CuttingSource(cut_after=40_000, etag=etag)
    options = FetchOptions(retries=2, backoff_s=0.001, max_backoff_s=0.001)
    with pytest.raises(ShardOpenError) as info:
        fetch_range(source, 10_000, 110_000, size=len(DATA), options=options, stats=IOStats())
    assert info.value.received == b""
    assert [start for _, start, _ in source.asked] == [10_000, 10_000, 10_000]


class ChangingSource(CuttingSource):
    """The object is replaced after the first streamed answer was cut: later answers name
    another ETag (refused on their headers, as a 412); whole reads work after the first."""

    def cat_range(self, start: int, end: int, timeout: float | None = None) -> bytes:
        if any(kind == "whole" for kind, _, _ in self.asked):
            self.asked.append(("whole", start, end))
            return DATA[start:end]
        return super().cat_range(start, end, timeout)

    def cat_range_salvage(
        self, start: int, end: int, timeout: float | None = None, **kw: Any
    ) -> bytes:
        if kw.get("expect_etag") == '"v1"':
            self.asked.append(("refused", start, end))
            raise status_error("HTTP 412 Precondition Failed", 412)
        return super().cat_range_salvage(start, end, timeout, **kw)


def test_a_refused_etag_starts_the_range_over() -> None:
    source = ChangingSource(cut_after=40_000)
    got = fetch_range(source, 10_000, 110_000, size=len(DATA), options=FAST, stats=IOStats())
    assert bytes(got) == DATA[10_000:110_000]
    # Read whole again from its start, in the same try: no piece of the replaced object in it.
    assert source.asked == [
        ("whole", 10_000, 110_000),
        ("streamed", 10_000, 110_000),
        ("refused", 50_000, 110_000),
        ("whole", 10_000, 110_000),
    ]


def test_a_range_failing_for_good_hands_on_what_arrived() -> None:
    source = CuttingSource(never=70_000)
    options = FetchOptions(retries=2, backoff_s=0.001, max_backoff_s=0.001)
    with pytest.raises(ShardOpenError) as info:
        fetch_range(source, 10_000, 110_000, size=len(DATA), options=options, stats=IOStats())
    assert info.value.received == DATA[10_000:70_000]
    assert info.value.offset == 70_000  # the byte the store never sent, not the range's start
    assert "gave up after 3 attempts" in str(info.value)
    # The bytes travel to the reader, not with the error through a DataLoader's pipe.
    assert pickle.loads(pickle.dumps(info.value)).received == b""


def test_an_answer_that_is_not_the_rest_is_never_spliced() -> None:
    source = CuttingSource(cut_after=40_000, whole=True)
    stats = IOStats()
    with pytest.raises(RangeIgnoredError) as info:
        fetch_range(source, 10_000, 110_000, size=len(DATA), options=FAST, stats=stats)
    assert info.value.body == DATA  # the whole object, for the caller to stream from
    assert stats.bytes == len(DATA)  # received, though never joined: counted


class BreakingAtTheEnd(CuttingSource):
    """Every streamed answer breaks off after its last byte has arrived."""

    def cat_range_salvage(
        self, start: int, end: int, timeout: float | None = None, **kw: Any
    ) -> bytes:
        self.asked.append(("streamed", start, end))
        cut = ConnectionError("reset at the end")
        raise PartialBodyError(DATA[start:end], cut, '"v1"', len(DATA))


def test_an_answer_breaking_off_after_its_last_byte_is_complete() -> None:
    # On the last try allowed, too.
    source = BreakingAtTheEnd(cut_after=0)
    options = FetchOptions(retries=1, backoff_s=0.001, max_backoff_s=0.001)
    got = fetch_range(source, 0, 50_000, size=len(DATA), options=options, stats=IOStats())
    assert bytes(got) == DATA[:50_000]
    assert source.asked == [("whole", 0, 50_000), ("streamed", 0, 50_000)]


def test_an_object_shorter_than_its_first_range_ends_where_its_answer_said() -> None:
    # The first part asks for 64 KiB of an object of unknown size: the streamed answer carried
    # all 30,000 bytes and broke off before its end was confirmed; the size it gave ends it.
    short = BreakingAtTheEnd(cut_after=0)
    data = DATA[:30_000]

    def salvage(start: int, end: int, timeout: float | None = None, **kw: Any) -> bytes:
        short.asked.append(("streamed", start, end))
        raise PartialBodyError(data[start:], ConnectionError("cut"), '"v1"', len(data))

    short.cat_range_salvage = salvage  # type: ignore[method-assign]
    got = fetch_range(short, 0, 65_536, size=None, options=FAST, stats=IOStats())
    assert bytes(got) == data
    assert short.asked == [("whole", 0, 65_536), ("streamed", 0, 65_536)]


class ConditionalSource:
    """An object behind If-Match (``conditional``): the first try is cut before its body, the
    first streamed one after 1,000 bytes; every answer names ``answers_etag``."""

    url = "http://example.invalid/shard.tar"
    conditional = True

    def __init__(self, answers_etag: str) -> None:
        self.answers_etag = answers_etag
        self.salvages: list[dict[str, Any]] = []

    def cat_range(self, start: int, end: int, timeout: float | None = None, **kw: Any) -> bytes:
        raise ConnectionError("cut before the body")

    def cat_range_salvage(
        self, start: int, end: int, timeout: float | None = None, **kw: Any
    ) -> bytes:
        self.salvages.append(kw)
        expect = kw.get("expect_etag")
        if expect is not None and self.answers_etag != expect:
            raise status_error("another object answered", 412)
        if len(self.salvages) == 1:
            cut = ConnectionError("cut")
            raise PartialBodyError(DATA[start : start + 1000], cut, self.answers_etag, len(DATA))
        return DATA[start:end]


@pytest.mark.parametrize("send", [True, False], ids=["If-Match sent", "If-Match refused"])
def test_a_retry_is_checked_against_the_shards_etag_before_anything_is_kept(send: bool) -> None:
    """The first streamed retry of a part, with nothing kept yet, must be refused when it
    names another object than the shard's ETag (a store ignoring If-Match spliced a replaced
    object in); with the shard's own ETag it is joined as usual, whether If-Match is sent or
    (a proxy refusing it) only checked."""
    from cloudshards.source.transport import IfMatch

    for answers, ok in (('"v1"', True), ('"v2"', False)):
        source = ConditionalSource(answers)
        condition = IfMatch('"v1"')
        condition.send = send
        if ok:
            got = fetch_range(
                source, 0, 50_000, size=len(DATA), options=FAST, stats=IOStats(),
                if_match=condition,
            )  # fmt: skip
            assert bytes(got) == DATA[:50_000]
        else:
            with pytest.raises(ShardOpenError):
                fetch_range(
                    source, 0, 50_000, size=len(DATA), options=FAST, stats=IOStats(),
                    if_match=condition,
                )  # fmt: skip
        assert source.salvages[0]["expect_etag"] == '"v1"'
