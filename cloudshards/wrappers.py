"""Dataset wrappers with webdataset's function-style names: ``with_epoch(ds, n)``,
``with_length(ds, n)``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import IterableDataset

__all__ = ["with_epoch", "with_length"]


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
