"""webdataset 1.0.2's ``webdataset.shardlists``: shard sources and node/worker splitters.

Also :class:`MultiShardSample` (YAML or dict dataset specs, :mod:`cloudshards.multishard`),
which cloudshards exports at the top level. Differences from 1.0.2: ``ResampledShards`` is
deterministic by default, and ``MultiShardSample`` is not obsolete and draws from a seed
shared by all ranks.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import braceexpand

from cloudshards import config
from cloudshards.errors import ConfigError
from cloudshards.multishard import MSSource, MultiShardSample, expand
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
from cloudshards.stages.base import make_rng, pipelinefilter
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
    value = config.webdataset_var(key)
    if value is None:
        raise ConfigError(f"missing environment variable {key}")
    return value


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
