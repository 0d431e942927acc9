"""A program written for webdataset 1.0.2's submodules runs unchanged on cloudshards.

``PROGRAM`` is modelled on open_clip's ``training/data.py``: ``url_opener`` +
``tar_file_expander`` + its own grouping, ``PipelineStage`` subclasses, ``_shuffle`` from
``webdataset.filters``, ``wds.shardlists.expand_urls`` and ``wds.utils.pytorch_worker_seed``.
It imports nothing but webdataset, torch and the standard library. It runs in subprocesses:
with real webdataset on local files (the reference), and after
``cloudshards.install_as_webdataset()`` on ``s3://`` (moto) with the node cache on, with two
DataLoader workers started by fork and by spawn. The samples must be the same, in order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import RemoteDataset

import cloudshards

PROGRAM = '''
"""Training data as open_clip builds it, for webdataset 1.0.2 (nothing cloudshards-specific)."""

import hashlib
import json
import random
import sys

import torch.utils.data
import webdataset as wds
from webdataset.filters import _shuffle
from webdataset.tariterators import base_plus_ext, tar_file_expander, url_opener, valid_sample


def log_and_continue(exn):
    print(f"skipped: {exn!r}", file=sys.stderr)
    return True


def group_by_keys_nothrow(data, keys=base_plus_ext, lcase=True, suffixes=None, handler=None):
    """open_clip's grouping: it reads item["fname"] of every item (1.0.2's {} marker breaks it)."""
    current_sample = None
    for filesample in data:
        assert isinstance(filesample, dict)
        fname, value = filesample["fname"], filesample["data"]
        prefix, suffix = keys(fname)
        if prefix is None:
            continue
        if lcase:
            suffix = suffix.lower()
        if (
            current_sample is None
            or prefix != current_sample["__key__"]
            or suffix in current_sample
        ):
            if valid_sample(current_sample):
                yield current_sample
            current_sample = dict(__key__=prefix, __url__=filesample["__url__"])
        if suffixes is None or suffix in suffixes:
            current_sample[suffix] = value
    if valid_sample(current_sample):
        yield current_sample


class GroupByKeys(wds.PipelineStage):
    """The same grouping as a stage that also accepts webdataset 1.0.2's end-of-shard marker."""

    def __init__(self, handler=log_and_continue):
        self.handler = handler

    def run(self, files):
        current = None
        for item in files:
            if item == {}:  # webdataset 1.0.2 ends every shard with {}
                if valid_sample(current):
                    yield current
                current = None
                continue
            prefix, suffix = base_plus_ext(item["fname"])
            if prefix is None:
                continue
            if current is None or prefix != current["__key__"]:
                if valid_sample(current):
                    yield current
                current = {"__key__": prefix, "__url__": item["__url__"]}
            current[suffix.lower()] = item["data"]
        if valid_sample(current):
            yield current


def tarfile_to_samples_nothrow(src, handler=log_and_continue):
    streams = url_opener(src, handler=handler)
    files = tar_file_expander(streams, handler=handler)
    return group_by_keys_nothrow(files, handler=handler)


def tarfile_to_samples_stage(src, handler=log_and_continue):
    streams = url_opener(src, handler=handler)
    return GroupByKeys(handler).run(tar_file_expander(streams, handler=handler))


class detshuffle2(wds.PipelineStage):
    """open_clip's shard shuffle: seeded by seed + epoch, the same on every worker."""

    def __init__(self, bufsize=1000, initial=100, seed=0, epoch=-1):
        self.bufsize = bufsize
        self.initial = initial
        self.seed = seed
        self.epoch = epoch

    def run(self, src):
        self.epoch += 1
        rng = random.Random()
        rng.seed(self.seed + self.epoch if self.seed >= 0 else wds.utils.pytorch_worker_seed())
        return _shuffle(src, self.bufsize, self.initial, rng)


class SampleShuffle(wds.PipelineStage):
    """A sample shuffle seeded per worker, so runs can be compared."""

    def __init__(self, bufsize, initial, seed):
        self.bufsize, self.initial, self.seed = bufsize, initial, seed

    def run(self, src):
        rng = random.Random(self.seed + wds.utils.pytorch_worker_seed())
        return _shuffle(src, self.bufsize, self.initial, rng)


def has_fields(sample):
    return "cls" in sample and "json" in sample


def make_dataset(spec, seed, grouping):
    reader = tarfile_to_samples_nothrow if grouping == "openclip" else tarfile_to_samples_stage
    return wds.DataPipeline(
        wds.SimpleShardList(wds.shardlists.expand_urls(spec)),
        detshuffle2(bufsize=8, initial=4, seed=seed),
        wds.split_by_node,
        wds.split_by_worker,
        reader,
        SampleShuffle(bufsize=20, initial=5, seed=seed),
        wds.select(has_fields),
        wds.map_dict(json=json.loads, cls=int),
        wds.to_tuple("__key__", "cls", "json", "bin"),
    )


def main(argv):
    spec, seed, method, grouping = argv[0], int(argv[1]), argv[2], argv[3]
    loader = torch.utils.data.DataLoader(
        make_dataset(spec, seed, grouping),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=method,
    )
    for key, cls, meta, payload in loader:
        digest = hashlib.sha1(payload).hexdigest()
        print(json.dumps([key, cls, meta, digest]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
'''

#: The one-line switch in front of the unchanged program (an entry script of its own, so
#: spawned workers, which re-run the entry script's top level, turn the switch on too).
SWITCH = """
import sys

import cloudshards

cloudshards.install_as_webdataset()

import wds_program  # noqa: E402  (written for webdataset; imported after the switch)

if __name__ == "__main__":
    wds_program.main(sys.argv[1:])
"""

SEED = 17
_GET = re.compile(r'"GET (/[^ ?"]+)[^"]* HTTP/1\.[01]" (\d{3})')


def write_program(directory: Path) -> None:
    (directory / "wds_program.py").write_text(PROGRAM)
    (directory / "switch.py").write_text(textwrap.dedent(SWITCH))


def run(
    directory: Path, script: str, spec: str, method: str, grouping: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "CLOUDSHARDS_AS_WEBDATASET"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, script, spec, str(SEED), method, grouping],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=directory,
        env=environ,
        check=False,
    )


def samples(result: subprocess.CompletedProcess[str]) -> list[Any]:
    assert result.returncode == 0, result.stderr[-4000:]
    assert "skipped" not in result.stderr, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def object_gets(log: Path, offset: int) -> list[str]:
    """Paths of the successful GETs moto logged after ``offset``."""
    with log.open("rb") as f:
        f.seek(offset)
        text = re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode(errors="replace"))
    return [m.group(1) for m in _GET.finditer(text) if m.group(2).startswith("2")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, dataset: Any) -> list[Any]:
    """The program's samples with real webdataset 1.0.2 on the local shards."""
    directory = tmp_path_factory.mktemp("reference")
    write_program(directory)
    spec = str(dataset.root / dataset.brace)
    result = run(directory, "wds_program.py", spec, "fork", "stage", {})
    expected = samples(result)
    assert len(expected) == sum(len(keys) for keys in dataset.shard_keys)
    # open_clip's own grouping does not survive webdataset 1.0.2's end-of-shard marker.
    broken = run(directory, "wds_program.py", spec, "fork", "openclip", {})
    assert broken.returncode != 0
    assert "KeyError: 'fname'" in broken.stderr
    return expected


@pytest.mark.timeout(600)
def test_program_runs_unchanged_on_s3_with_the_node_cache(
    reference: list[Any], s3_dataset: RemoteDataset, tmp_path: Path
) -> None:
    write_program(tmp_path)
    cache_dir = tmp_path / "node-cache"
    env = {**s3_dataset.env, "CLOUDSHARDS_CACHE_DIR": str(cache_dir)}
    log = s3_dataset.server.process.log_path
    shard_paths = {f"/{u.split('://', 1)[1]}" for u in s3_dataset.shard_urls()}

    # Cold cache, forked workers, the program's own grouping stage.
    offset = log.stat().st_size
    result = run(tmp_path, "switch.py", s3_dataset.url, "fork", "stage", env)
    assert samples(result) == reference
    info = cloudshards.cache_info(cache_dir)
    assert info["entries"] == len(s3_dataset.local.shards), info
    cold = [p for p in object_gets(log, offset) if p in shard_paths]
    assert set(cold) == shard_paths

    # Warm cache, spawned workers, open_clip's grouping (which 1.0.2 breaks): no shard GETs.
    offset = log.stat().st_size
    result = run(tmp_path, "switch.py", s3_dataset.url, "spawn", "openclip", env)
    assert samples(result) == reference
    assert [p for p in object_gets(log, offset) if p in shard_paths] == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_program_runs_unchanged_on_local_files(
    reference: list[Any], dataset: Any, tmp_path: Path, method: str
) -> None:
    write_program(tmp_path)
    spec = str(dataset.root / dataset.brace)
    for grouping in ("stage", "openclip"):
        assert samples(run(tmp_path, "switch.py", spec, method, grouping, {})) == reference
