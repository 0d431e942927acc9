"""webdataset 1.0.2's ``webdataset.compat``: ``WebDataset``, ``WebLoader`` and the fluent API.

These are cloudshards' classes (:mod:`cloudshards.dataset`, :mod:`cloudshards.pipeline`); see
docs/migrating.md for where they differ from webdataset on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from cloudshards.dataset import WebDataset, WebLoader
from cloudshards.datasetstages import _EmptyCheck
from cloudshards.handlers import reraise_exception
from cloudshards.pipeline import DataPipeline, FluidInterface, FluidWrapper
from cloudshards.stages.base import pipelinefilter
from cloudshards.webdataset.tariterators import group_by_keys, tar_file_expander

__all__ = [
    "DataPipeline",
    "FluidInterface",
    "FluidWrapper",
    "WebDataset",
    "WebLoader",
    "check_empty",
    "group_by_keys",
    "pipelinefilter",
    "reraise_exception",
    "tar_file_expander",
]


def check_empty(source: Iterable[Any]) -> Iterator[Any]:
    """Pass samples through; raise ValueError if there were none (webdataset's check)."""
    return _EmptyCheck(-1)(source)
