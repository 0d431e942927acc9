"""webdataset 1.0.2's ``webdataset.extradatasets``: small dataset wrappers.

``with_epoch`` and ``with_length`` (function-style wrappers: ``with_epoch(ds, n)``) are working
versions (1.0.2's cannot be iterated); ``repeatedly`` works both as a dataset and as a pipeline
stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from cloudshards.stages.base import PipelineStage
from cloudshards.stages.epoch import repeatedly as _repeatedly
from cloudshards.webdataset.pytorch import IterableDataset

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


class with_epoch(IterableDataset):  # type: ignore[type-arg]
    """Yield exactly ``length`` items per ``iter()``, continuing where the last epoch stopped
    and restarting the dataset when it runs out (an empty dataset ends the epoch)."""

    def __init__(self, dataset: Iterable[Any], length: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.length = length
        self.source: Iterator[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["source"] = None  # live iterators do not cross process boundaries
        return state

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.length):
            if self.source is None:
                self.source = iter(self.dataset)
            try:
                sample = next(self.source)
            except StopIteration:
                self.source = iter(self.dataset)
                try:
                    sample = next(self.source)
                except StopIteration:
                    return
            yield sample
        self.source = None


class with_length(IterableDataset):  # type: ignore[type-arg]
    """Give an iterable dataset a ``len()`` without changing what it yields."""

    def __init__(self, dataset: Iterable[Any], length: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def __len__(self) -> int:
        return self.length
