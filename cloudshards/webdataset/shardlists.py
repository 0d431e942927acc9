"""webdataset 1.0.2's ``webdataset.shardlists``: shard sources and node/worker splitters.

Also :class:`MultiShardSample` (YAML or dict dataset specs), which cloudshards exports at the
top level. Differences from 1.0.2: ``ResampledShards`` is deterministic by default, and
``MultiShardSample`` is not obsolete and draws from a seed shared by all ranks.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import random
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import braceexpand

from cloudshards.dist import derive_seed
from cloudshards.errors import ConfigError
from cloudshards.imagedecode import import_optional
from cloudshards.shards import (
    ResampledShardList,
    ResampledShards,
    SimpleShardList,
    _resampled,
    non_empty,
    resampled,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from cloudshards.stages.base import current_context, make_rng, pipelinefilter
from cloudshards.urls import expand_urls as _expand_urls
from cloudshards.webdataset.pytorch import IterableDataset
from cloudshards.webdataset.utils import is_iterable, obsolete

__all__ = [
    "DirectoryShardList",
    "MSSource",
    "MultiShardSample",
    "ResampledShardList",
    "ResampledShards",
    "SimpleShardList",
    "check_pid_is_running",
    "default_rng",
    "envlookup",
    "envsubst",
    "expand",
    "expand_source",
    "expand_urls",
    "get_pid_from_filename",
    "is_iterable",
    "non_empty",
    "obsolete",
    "pipelinefilter",
    "resampled",
    "resampled_",
    "shardspec",
    "single_node_only",
    "split_by_node",
    "split_by_worker",
    "without_last_extension",
]

logger = logging.getLogger(__name__)

resampled_ = _resampled

#: webdataset's module RNG; nothing in cloudshards draws from it.
default_rng = random.Random()


def envlookup(m: re.Match[str]) -> str:
    """The value of ``WDS_<name>`` for a ``${name}`` match.

    Raises:
        ConfigError: The variable is not set.
    """
    key = "WDS_" + m.group(1)
    if key not in os.environ:
        raise ConfigError(f"missing environment variable {key}")
    return os.environ[key]


def envsubst(s: str) -> str:
    """Replace each ``${name}`` in ``s`` by the environment variable ``WDS_<name>``."""
    return re.sub(r"\$\{(\w+)\}", envlookup, s)


def expand_urls(urls: str) -> list[str]:
    """Expand a shard spec: ``::``-separated parts, ``${name}`` from ``WDS_name``, braces.

    No globbing, as in webdataset (``cloudshards.urls.expand_urls`` also globs).
    """
    return _expand_urls(urls, glob=False)


def expand_source(source: Any, max_urls: int = int(1e9)) -> list[str]:
    """A brace spec expanded, a list as is, or up to ``max_urls`` items of an iterable."""
    if isinstance(source, str):
        return expand_urls(source)
    if isinstance(source, list):
        return source
    if is_iterable(source):
        return list(itertools.islice(source, max_urls))
    raise ValueError(f"cannot handle {type(source)}")


def expand(s: str) -> str:
    """Expand ``~`` and environment variables."""
    return os.path.expanduser(os.path.expandvars(s))


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
        ConfigError: Unknown keys, several buckets for one dataset, or ``choose`` larger
            than the dataset.
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


def shardspec(spec: str) -> MultiShardSample | SimpleShardList:
    """A :class:`MultiShardSample` for a ``.yaml`` path, else a :class:`SimpleShardList`."""
    if spec.endswith(".yaml"):
        return MultiShardSample(spec)
    return SimpleShardList(spec)


def check_pid_is_running(pid: int) -> bool:
    """True when a process with this id exists."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def without_last_extension(fname: str) -> str:
    """``a/b.tar.x`` -> ``a/b.tar``."""
    return re.sub(r"\.[^.]*$", "", fname)


def get_pid_from_filename(fname: str) -> int | None:
    """The pid in a claimed name ``shard.tar._<pid>_``, or None."""
    match = re.match(r"^(.*)\._(\d+)_$", fname)
    return int(match.group(2)) if match else None


class DirectoryShardList(IterableDataset):  # type: ignore[type-arg]
    """Shards appearing in a local directory, claimed by renaming (a work queue).

    Each claimed shard is renamed ``NAME._PID_`` while in use, then (``mode``) renamed back
    (``"resample"``), renamed ``NAME._done_`` (``"keep"``) or deleted (``"unlink"``). Claims of
    dead processes are recycled. Stops after ``timeout`` seconds, or when the directory is
    empty and ``poll`` is None.
    """

    def __init__(
        self,
        path: str,
        pattern: str = "*.{tar,tgz,tar.tgz}",
        poll: float | None = 1,
        timeout: float = 1e12,
        mode: str = "resample",
        select: str = "random",
        fate: Any = None,
    ) -> None:
        if not path.endswith("/") or not os.path.isdir(path):
            raise ConfigError(f"{path!r} must be an existing directory ending with '/'")
        self.path = path
        self.poll = poll
        self.pattern = pattern
        self.mode = mode
        self.select = select
        self.fate = fate
        self.timeout = timeout

    def recycle(self, activename: str) -> None:
        """Release a claimed shard as ``mode`` says."""
        if self.mode == "unlink":
            os.unlink(activename)
        elif self.mode == "keep":
            os.rename(activename, without_last_extension(activename) + "._done_")
        elif self.mode == "resample":
            os.rename(activename, without_last_extension(activename))

    def cleanup_files_without_processes(self) -> None:
        """Recycle shards claimed by processes that no longer run."""
        for fname in glob.glob(os.path.join(self.path, "*._*_")):
            pid = get_pid_from_filename(fname)
            if pid is not None and not check_pid_is_running(pid):
                self.recycle(fname)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rng = make_rng("directory")
        last = time.time()
        while time.time() - last < self.timeout:
            candidates = sorted(
                f for p in braceexpand.braceexpand(self.path + self.pattern) for f in glob.glob(p)
            )
            if not candidates:
                if self.poll is None:
                    return
                time.sleep(self.poll)
                continue
            if self.select == "oldest":
                candidate = min(candidates, key=lambda fn: os.stat(fn).st_mtime)
            elif self.select == "random":
                candidate = rng.choice(candidates)
            else:
                raise ConfigError(f"unknown selection strategy {self.select!r}")
            activename = candidate + f"._{os.getpid()}_"
            try:
                os.rename(candidate, activename)
            except FileNotFoundError:  # another process claimed it first
                time.sleep(self.poll or 0)
                continue
            yield {"url": activename}
            self.recycle(activename)
            self.cleanup_files_without_processes()
