"""webdataset 1.0.2's ``webdataset.pipeline``: ``DataPipeline``.

cloudshards' ``DataPipeline``: fluent methods return new pipelines, and each ``iter()`` is an
epoch with its own (seed, epoch) context.
"""

from __future__ import annotations

from typing import Any

from cloudshards.pipeline import DataPipeline
from cloudshards.stages.base import PipelineStage
from cloudshards.webdataset.pytorch import IterableDataset

__all__ = ["DataPipeline", "PipelineStage", "add_length_method"]


def add_length_method(obj: Any) -> Any:
    """Give ``obj`` a ``__len__`` returning ``obj.size`` by changing its class, as webdataset."""

    def length(self: Any) -> int:
        return int(self.size)

    combined = type(
        obj.__class__.__name__ + "_Length", (obj.__class__, IterableDataset), {"__len__": length}
    )
    obj.__class__ = combined
    return obj
