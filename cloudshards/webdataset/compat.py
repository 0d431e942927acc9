"""webdataset 1.0.2's ``webdataset.compat``: ``WebDataset``, ``WebLoader`` and the fluent API.

These are cloudshards' classes (:mod:`cloudshards.compat`, :mod:`cloudshards.pipeline`); see
docs/migrating.md for where they differ from webdataset on purpose.
"""

from __future__ import annotations

from cloudshards.compat import WebDataset, WebLoader, check_empty
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
