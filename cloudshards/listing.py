"""Glob listings shared by the processes of one job on a node.

Every rank builds its dataset, and so lists a glob (``s3://bucket/train-*.tar``), itself: 8
ranks per node list a bucket of 10^5 objects 8 times, and ranks that list while shards are
being written can disagree on the list (and so on the shard order). Within one job (torchrun's
``TORCHELASTIC_RUN_ID``, SLURM's ``SLURM_JOB_ID``), the first process on the node to list a
glob saves the result beside the node's sample counts (``CLOUDSHARDS_COUNTS_DIR``); the others
wait for it and read it. The file name is a hash of the glob and its options: no URL or
credential appears in it. Outside a job every call lists.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from cloudshards import config

__all__ = ["job_id", "shared_listing"]

#: Variables that name the running job, in order of preference.
_JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def job_id() -> str | None:
    """The running job's id (torchrun or SLURM), or None outside a job."""
    for name in _JOB_VARIABLES:
        value = os.environ.get(name)
        if value and value != "none":
            return f"{name}={value}"
    return None


def shared_listing(
    url: str, storage_options: Mapping[str, Any] | None, list_glob: Callable[[], list[str]]
) -> list[str]:
    """``list_glob()``'s result, listed once per node and job (see the module's doc)."""
    job = job_id()
    if job is None:
        return list_glob()
    key = json.dumps([job, url, repr(sorted((storage_options or {}).items()))])
    directory = config.counts_dir() / "listings"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return list_glob()
    path = directory / hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    with open(str(path) + ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads(path.read_text())
            if isinstance(saved, list) and all(isinstance(u, str) for u in saved):
                return saved
        result = list_glob()
        with contextlib.suppress(OSError):
            fd, temp = tempfile.mkstemp(dir=directory, prefix=".listing-")
            with os.fdopen(fd, "w") as handle:
                json.dump(result, handle)
            os.replace(temp, path)
        return result
