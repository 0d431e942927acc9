"""webdataset 1.0.2's ``webdataset.extradatasets``: small dataset wrappers.

``with_epoch`` and ``with_length`` are cloudshards' working versions (1.0.2's cannot be
iterated); ``repeatedly`` works both as a dataset and as a pipeline stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from cloudshards.stages.base import PipelineStage
from cloudshards.stages.epoch import repeatedly as _repeatedly
from cloudshards.webdataset.pytorch import IterableDataset
from cloudshards.wrappers import with_epoch, with_length

__all__ = ["MockDataset", "PipelineStage", "repeatedly", "with_epoch", "with_length"]


class MockDataset(IterableDataset):  # type: ignore[type-arg]
    """Yield the same ``sample`` ``length`` times."""

    def __init__(self, sample: Any, length: int) -> None:
        super().__init__()
        self.sample = sample
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.length):
            yield self.sample


class repeatedly(IterableDataset, PipelineStage):  # type: ignore[type-arg]
    """Iterate ``source`` (or, as a stage, its input) again and again.

    Stops after ``nepochs`` passes or ``nbatches`` items; ``length`` is its ``len()``.
    """

    def __init__(
        self,
        source: Iterable[Any] | None,
        nepochs: int | None = None,
        nbatches: int | None = None,
        length: int | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.nepochs = nepochs
        self.nbatches = nbatches
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        if self.source is None:
            raise TypeError(
                "repeatedly(None, ...) is a pipeline stage; give it a source to iterate"
            )
        return self.invoke(self.source)

    def invoke(self, source: Iterable[Any]) -> Iterator[Any]:
        """Repeat ``source``."""
        return _repeatedly(source, nepochs=self.nepochs, nbatches=self.nbatches)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("repeatedly() has no length; pass length=...")
        return self.length
