"""In-memory replay of a pipeline's first pass: the ``.mcached()`` stage, and the refusal of
``.lmdb_cached()`` (which would pickle samples into LMDB)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

from cloudshards.errors import UnsupportedError
from cloudshards.stages.base import PipelineStage

__all__ = ["LMDB_INSTEAD", "Cached", "refuse_lmdb"]

#: What to use instead of webdataset's LMDB sample cache.
LMDB_INSTEAD = (
    "it pickles samples into LMDB; cache shards per node with cache_dir=... (or "
    "CLOUDSHARDS_CACHE_DIR), or keep decoded samples in memory with filters.Cached"
)


class Cached(PipelineStage):
    """Keep the first pass's samples in memory and replay them on later passes (per process)."""

    def __init__(self) -> None:
        super().__init__()
        self.cached: list[Any] | None = None

    def run(self, source: Iterable[Any]) -> Iterator[Any]:
        """Pass ``source`` through and remember it, or replay what was remembered."""
        if self.cached is not None:
            yield from self.cached
            return
        temp = []
        for sample in source:
            temp.append(sample)
            yield sample
        self.cached = temp


def refuse_lmdb() -> NoReturn:
    """Raise :class:`UnsupportedError` for webdataset's ``LMDBCached``, saying what to use."""
    raise UnsupportedError(
        f"webdataset's filters.LMDBCached is not supported by cloudshards; {LMDB_INSTEAD} "
        "(docs/migrating.md)"
    )
