"""webdataset's dataset specs: several datasets' shards, from a YAML file or a dict, mixed anew
each epoch (:class:`MultiShardSample`; ``WebDataset("spec.yaml")`` reads one)."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import braceexpand
from torch.utils.data import IterableDataset

from cloudshards.dist import derive_seed
from cloudshards.errors import ConfigError
from cloudshards.imagedecode import import_optional
from cloudshards.stages.base import current_context
from cloudshards.urls import substitute_env

__all__ = ["MSSource", "MultiShardSample", "expand"]

logger = logging.getLogger(__name__)


def expand(s: str) -> str:
    """Expand ``~`` and each ``${NAME}`` from ``WDS_NAME``, the rule of every shard spec.

    Not every variable, as webdataset 1.0.2's ``os.path.expandvars`` does: a spec file from
    someone else could then put ``${AWS_SECRET_ACCESS_KEY}`` into a URL it sends requests to.

    Raises:
        ConfigError: A ``${NAME}`` whose ``WDS_NAME`` is not set.
    """
    return os.path.expanduser(substitute_env(s))


@dataclass
class MSSource:
    """One dataset of a :class:`MultiShardSample` spec."""

    name: str = ""
    perepoch: int = -1
    resample: bool = False
    urls: list[str] = field(default_factory=list)


class MultiShardSample(IterableDataset):  # type: ignore[type-arg]
    """Shards of several datasets from a YAML file or a dict, mixed anew each epoch.

    The spec: ``{"prefix": str, "buckets": str, "datasets": [{"name": str, "buckets": str,
    "shards": brace spec or list, "resample": n, "choose": n}, ...]}``. Each epoch takes
    every shard of a dataset, or ``resample`` draws with replacement, or ``choose`` distinct
    shards at random; then it shuffles the whole list. Yields ``{"url": url}`` dicts.

    The RNG: ``set_epoch(seed)`` seeds it as in webdataset; otherwise each epoch draws from
    the pipeline's (seed, epoch), identical on every rank, so a node splitter after it splits
    one list. Unlike webdataset 1.0.2, it needs no ``ALLOW_OBSOLETE=1``.

    Args:
        fname: Path of a YAML spec (needs PyYAML) or the spec as a dict.

    Raises:
        ConfigError: Unknown keys, several buckets for one dataset, ``choose`` larger than
            the dataset, or a ``${NAME}`` whose ``WDS_NAME`` is unset (see :func:`expand`).
    """

    def __init__(self, fname: str | Mapping[str, Any]) -> None:
        super().__init__()
        self.epoch = -1
        self.rng: random.Random | None = None
        self.sources: list[MSSource] = []
        self.parse_spec(fname)

    def parse_spec(self, fname: str | Mapping[str, Any]) -> None:
        """Read the spec into :attr:`sources`."""
        if isinstance(fname, Mapping):
            spec = fname
        else:
            yaml = import_optional("yaml", "reading YAML dataset specs")
            with open(fname) as stream:
                spec = yaml.safe_load(stream)
        _check_keys(spec, {"prefix", "datasets", "buckets"}, "spec")
        prefix = expand(spec.get("prefix", ""))
        self.sources = []
        for ds in spec["datasets"]:
            _check_keys(ds, {"buckets", "name", "shards", "resample", "choose"}, "dataset")
            buckets = ds.get("buckets", spec.get("buckets", []))
            buckets = [expand(s) for s in ([buckets] if isinstance(buckets, str) else buckets)]
            if len(buckets) > 1:
                raise ConfigError(f"{buckets}: one bucket per dataset is supported")
            bucket = buckets[0] if buckets else ""
            name = ds.get("name", "@" + bucket)
            shards = ds["shards"]
            urls = [
                prefix + os.path.join(bucket, u)
                for url in ([shards] if isinstance(shards, str) else shards)
                for u in braceexpand.braceexpand(expand(url))
            ]
            resample = ds.get("resample", -1)
            nsample = ds.get("choose", -1)
            if nsample > len(urls):
                raise ConfigError(f"choose={nsample} is larger than the {len(urls)} shards")
            if nsample > 0 and resample > 0:
                raise ConfigError("specify only one of resample or choose")
            self.sources.append(MSSource(name=name, urls=urls, perepoch=nsample, resample=resample))
            logger.info("MultiShardSample %s: %d shards, choose %d", name, len(urls), nsample)

    def set_epoch(self, seed: int) -> None:
        """Draw from ``random.Random(seed)`` from now on (webdataset's meaning)."""
        self.rng = random.Random(seed)

    def _epoch_rng(self) -> random.Random:
        if self.rng is not None:
            return self.rng
        self.epoch += 1
        context = current_context()
        if context is None:
            return random.Random(derive_seed("multishard", 0, self.epoch))
        # Not make_rng: that differs per rank and worker, and every rank needs the same list.
        return random.Random(
            derive_seed("multishard", context.seed, context.epoch, context.repetition)
        )

    def get_shards_for_epoch(self) -> list[str]:
        """This epoch's shard URLs."""
        rng = self._epoch_rng()
        result: list[str] = []
        for source in self.sources:
            if source.resample > 0:
                chosen = rng.choices(source.urls, k=int(source.resample))
            elif source.perepoch > 0:
                chosen = list(source.urls)
                rng.shuffle(chosen)
                chosen = chosen[: source.perepoch]
            else:
                chosen = list(source.urls)
            result += chosen
        rng.shuffle(result)
        return result

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for shard in self.get_shards_for_epoch():
            yield {"url": shard}


def _check_keys(spec: Any, allowed: set[str], what: str) -> None:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"dataset spec: {what} must be a mapping, got {type(spec).__name__}")
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ConfigError(f"dataset spec: unknown {what} keys {unknown}; allowed {sorted(allowed)}")
