"""The per-node shard cache: entry names, hits and misses, one download per node across
processes, crash safety, the byte budget, a full disk, early stops, clear/info and the CLI.

Shards are served by the ``slowfile://`` fake store (tests/fakes.py), whose open log counts
every fetch from the "store" across processes.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import errno
import functools
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import pickle
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fakes
import pytest
from torch.utils.data import DataLoader

import cloudshards as wds
from cloudshards.cache import ShardCache, cache_info, clear_cache, entry_name
from cloudshards.cache.follow import FollowStream
from cloudshards.cache.keys import store_endpoint as _endpoint
from cloudshards.cache.lock import is_locked
from cloudshards.cache.tee import TeeStream
from cloudshards.cli import main as cli_main
from cloudshards.source import FetchOptions, OpenOptions, open_source

SampleList = list[tuple[str, dict[str, bytes]]]

# --- ranks: processes that read shards through one cache ----------------------------------
#
# Forked from the test process (imports are inherited: a rank starts in milliseconds instead
# of re-importing torch), each runs `_rank` with a config dict and writes a JSON result.


def _barrier(directory: str | None, label: str, worker_id: int | None = None) -> None:
    """Say "ready", then wait for the test to let every party go at once."""
    if not directory:
        return
    if worker_id is not None:
        label = f"{label}-w{worker_id}"
    Path(directory, f"ready-{label}").touch()
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(directory, "go")):
        if time.monotonic() > deadline:
            raise TimeoutError("barrier: no go")
        time.sleep(0.005)


def _encode(sample: dict[str, Any]) -> list[Any]:
    fields = {k: base64.b64encode(v).decode() for k, v in sample.items() if not k.startswith("__")}
    return [sample["__key__"], fields]


def _rank(config: dict[str, Any]) -> dict[str, Any]:
    """Read ``config["urls"]`` through the cache at ``config["cache_dir"]``.

    ``mode="open"``: ``ShardCache.open`` each URL and hash its bytes. Otherwise iterate a
    ``WebDataset`` (``workers`` DataLoader workers, or in this process with splitting off),
    optionally with file writes limited to ``fsize_limit`` bytes (a full disk).
    """
    result: dict[str, Any] = {}
    if config.get("mode") == "open":
        cache = ShardCache(config["cache_dir"])
        _barrier(config.get("barrier"), config["name"])
        result["sha256"] = []
        for url in config["urls"]:
            stream = cache.open(url)
            try:
                result["sha256"].append(hashlib.sha256(fakes.read_all(stream)).hexdigest())
            finally:
                stream.close()
        result["stats"] = cache.stats.as_dict()
        return result
    num_workers = config.get("workers", 0)
    split: dict[str, Any] = {} if num_workers else {"nodesplitter": None, "workersplitter": None}
    ds = wds.WebDataset(
        config["urls"],
        shardshuffle=False,
        cache_dir=config["cache_dir"],
        cache_size=config.get("cache_size", -1),
        **split,
    )
    loader: Iterable[dict[str, Any]] = ds
    if num_workers:
        init = functools.partial(_barrier, config.get("barrier"), config["name"])
        loader = DataLoader(ds, batch_size=None, num_workers=num_workers, worker_init_fn=init)
    else:
        _barrier(config.get("barrier"), config["name"])
    limit = config.get("fsize_limit")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit:  # a disk that fills up: writes past `limit` bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        result["samples"] = [_encode(sample) for sample in loader]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    result["stats"] = cache_of(ds).stats.as_dict()
    return result


def _rank_main(config: dict[str, Any], env: dict[str, str]) -> None:
    """Entry point of a forked rank: its environment, a log file, the result file."""
    os.environ.update(env)
    log = logging.FileHandler(config["err"])
    log.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    log.setLevel(logging.WARNING)
    logging.getLogger().addHandler(log)
    try:
        result = _rank(config)
        Path(config["out"]).write_text(json.dumps(result))
    except BaseException:
        with open(config["err"], "a") as f:
            f.write(traceback.format_exc())
        log.close()
        os._exit(1)
    log.close()


# --- helpers ------------------------------------------------------------------------------


@dataclass
class Store:
    """The fake store of one test: its open log."""

    log: Path

    def opens(self) -> dict[str, int]:
        """Opens per local path so far (all processes)."""
        return dict(fakes.opens(self.log))

    def count(self, path: Path) -> int:
        return fakes.opens(self.log)[str(path)]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """``slowfile://`` registered, knobs cleared, the open log in tmp_path."""
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    log = tmp_path / "opens.log"
    monkeypatch.setenv(fakes.OPEN_LOG_ENV, str(log))
    return Store(log)


@dataclass
class Rank:
    """A forked rank process (see ``_rank``)."""

    process: multiprocessing.process.BaseProcess
    out: Path
    err: Path

    def alive(self) -> bool:
        return self.process.exitcode is None

    def log(self) -> str:
        """Its WARNING records and, if it failed, its traceback."""
        return self.err.read_text(errors="replace") if self.err.exists() else ""

    def result(self, timeout: float = 100.0) -> dict[str, Any]:
        self.process.join(timeout)
        code = self.process.exitcode
        assert code == 0, f"rank exited with {code}:\n{self.log()[-4000:]}"
        value: dict[str, Any] = json.loads(self.out.read_text())
        return value

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        self.process.kill()
        self.process.join(30)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Callable[..., Rank]]:
    """Factory: ``start(name, urls=[...], cache_dir=..., env={...}, **config)`` forks a rank;
    leftovers are killed at teardown."""
    started: list[Rank] = []
    context = multiprocessing.get_context("fork")

    def start(name: str, *, env: dict[str, str] | None = None, **config: Any) -> Rank:
        out, err = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
        config = {"name": name, "out": str(out), "err": str(err), **config}
        process = context.Process(target=_rank_main, args=(config, env or {}), name=name)
        process.start()
        rank = Rank(process, out, err)
        started.append(rank)
        return rank

    yield start
    for rank in started:
        if rank.alive():
            rank.kill()


def wait_for(
    condition: Callable[[], bool], what: str, ranks: Iterable[Rank] = (), timeout: float = 90
) -> None:
    """Poll ``condition``; fail early if a rank died, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        for rank in ranks:
            assert rank.alive(), f"{rank.process.name} exited before {what}:\n{rank.log()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def release(barrier: Path, count: int, ranks: list[Rank]) -> None:
    """Wait until ``count`` parties wait at the barrier, then let them all go at once."""
    wait_for(lambda: len(list(barrier.glob("ready-*"))) >= count, "the barrier", ranks)
    (barrier / "go").touch()


def samples_of(source: Iterable[dict[str, Any]]) -> SampleList:
    """``(key, fields)`` of each sample, without the ``__url__``-style metadata."""
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in source]


def decode(result: dict[str, Any]) -> SampleList:
    """Samples written by a rank."""
    return [
        (key, {k: base64.b64decode(v) for k, v in fields.items()})
        for key, fields in result["samples"]
    ]


def by_key(samples: SampleList) -> SampleList:
    return sorted(samples, key=lambda s: s[0])


def urls_of(paths: Iterable[Path]) -> list[str]:
    return [fakes.url_of(p) for p in paths]


def data_dir(cache_dir: Path) -> Path:
    return cache_dir / "data"


def data_files(cache_dir: Path) -> list[str]:
    """Everything in the cache's data directory (entries and partial files)."""
    directory = data_dir(cache_dir)
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def data_bytes(cache_dir: Path) -> int:
    """Bytes on disk in the cache's data directory, partial files included."""
    total = 0
    for name in data_files(cache_dir):
        with contextlib.suppress(FileNotFoundError):  # committed or evicted meanwhile
            total += (data_dir(cache_dir) / name).stat().st_size
    return total


def cache_of(ds: wds.WebDataset) -> ShardCache:
    assert ds.cache is not None
    return ds.cache


def take(ds: wds.WebDataset, count: int) -> SampleList:
    """The first ``count`` samples; then the iterator is closed, as when a consumer breaks out
    of its loop and drops it."""
    it = iter(ds)
    assert isinstance(it, Generator)
    try:
        return samples_of(itertools.islice(it, count))
    finally:
        it.close()


def zero_stats(**counts: int) -> dict[str, int]:
    base = dict.fromkeys(
        ("hits", "misses", "waits", "uncached", "bytes_network", "bytes_disk", "evictions"), 0
    )
    return {**base, **counts}


def flocked(path: Path) -> bool:
    """Whether a process holds a flock on ``path``, from /proc/locks (a try-lock to find out
    would itself take the lock for a moment, and could make a downloader lose it)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(
        "FLOCK" in line and key in line.split()
        for line in Path("/proc/locks").read_text().splitlines()
    )


# --- entry names ---------------------------------------------------------------------------

SIGNED = [
    "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20240101&"
    "X-Amz-Date=20240101T000000Z&X-Amz-Expires=600&X-Amz-SignedHeaders=host&"
    "X-Amz-Signature=0123456789abcdef",
    "?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=svc&X-Goog-Signature=cafebabe",
    "?sv=2022-11-02&se=2030-01-01&sp=r&sig=c2VjcmV0",
    "?token=s3cr3t-t0ken",
    "?X-Amz-Security-Token=FwoGZX&X-Amz-Signature=abc",
]


def test_entry_name_is_a_hash_plus_a_readable_suffix() -> None:
    name = entry_name("s3://bucket/train/shard-000001.tar")
    digest, suffix = name.split("-", 1)
    assert re.fullmatch(r"[0-9a-f]{32}", digest)
    assert suffix == "shard-000001.tar"
    assert entry_name("s3://bucket/train/shard-000001.tar") == name  # stable
    assert entry_name("s3://bucket/valid/shard-000001.tar") != name  # same basename
    assert entry_name("s3://other/train/shard-000001.tar") != name
    assert entry_name("s3a://bucket/train/shard-000001.tar") == name  # protocol alias
    assert entry_name("gcs://b/x.tar") == entry_name("gs://b/x.tar")


@pytest.mark.parametrize("query", SIGNED)
def test_signed_urls_of_one_object_share_one_entry(query: str) -> None:
    base = "https://store.example/bucket/shard-000007.tar"
    name = entry_name(base + query)
    assert name == entry_name(base)
    assert "=" not in name
    assert "&" not in name
    assert "?" not in name


def test_non_signing_query_parameters_name_a_different_object() -> None:
    base = "https://store.example/bucket/shard.tar"
    versioned = entry_name(base + "?versionId=2")
    assert versioned != entry_name(base)
    assert versioned != entry_name(base + "?versionId=3")
    assert versioned == entry_name(base + "?versionId=2&X-Amz-Signature=abc&token=t")


@pytest.mark.parametrize("name", ["st", "sp", "sr", "se", "sv", "expires", "policy"])
def test_names_a_signature_covers_pick_the_object_of_an_unsigned_url(name: str) -> None:
    """Azure SAS and CloudFront sign parameters with generic names; on an unsigned URL the
    same names are the object's own (two objects once shared an entry, and one was served for
    the other)."""
    base = "https://store.example/shard.tar"
    assert entry_name(f"{base}?{name}=0") != entry_name(f"{base}?{name}=1")
    signed = "sig=c2VjcmV0"  # an Azure SAS: they change with each signing
    assert entry_name(f"{base}?{name}=0&{signed}") == entry_name(f"{base}?{name}=1&{signed}")


def test_credentials_in_the_url_never_reach_the_name() -> None:
    for url, bare in [
        ("s3://AKIAUSERKEY:pa55w0rd@bucket/shard.tar", "s3://bucket/shard.tar"),
        ("https://alice:hunter2@store.example/b/shard.tar", "https://store.example/b/shard.tar"),
        ("https://alice:p@ss@store.example/b/shard.tar", "https://store.example/b/shard.tar"),
    ]:
        name = entry_name(url)
        assert name == entry_name(bare)
        for secret in ("AKIAUSERKEY", "pa55w0rd", "alice", "hunter2", "p@ss"):
            assert secret not in name


def test_a_different_endpoint_is_a_different_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "s3://bucket/shard.tar"
    names = {
        entry_name(url),
        entry_name(url, "http://minio-a:9000"),
        entry_name(url, "http://minio-b:9000"),
    }
    assert len(names) == 3
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    default = entry_name(url, _endpoint(url, OpenOptions()))
    assert default == entry_name(url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://localhost:9000")
    from_env = entry_name(url, _endpoint(url, OpenOptions()))
    assert from_env not in (default, entry_name(url, "http://other:9000"))
    options = OpenOptions(storage_options={"s3": {"endpoint_url": "http://other:9000"}})
    assert entry_name(url, _endpoint(url, options)) == entry_name(url, "http://other:9000")


def test_endpoint_in_storage_options_caches_separately(
    make_shards: Any, store: Store, tmp_path: Path
) -> None:
    shards = make_shards([2])
    cache_dir = tmp_path / "cache"
    for storage_options in (None, {"endpoint_url": "http://a"}, {"endpoint_url": "http://b"}):
        for _ in range(2):
            ds = wds.WebDataset(
                urls_of(shards.paths),
                shardshuffle=False,
                cache_dir=str(cache_dir),
                storage_options=storage_options,
            )
            assert samples_of(ds) == shards.samples
    assert len(data_files(cache_dir)) == 3
    assert store.opens() == {str(shards.paths[0]): 3}


HOSTILE = [
    "slowfile:///../../etc/passwd",
    "s3://b/../../x",
    "s3://b/" + "../" * 40 + "etc/shadow",
    "http://h/%2e%2e/%2f",
    "http://h/..%2f..%2f..%2fetc%2fpasswd",
    "s3://b/..",
    "s3://b/.",
    "s3://b/",
    "s3://b",
    "gs://b/dir/",
    "http://h/" + "a" * 5000 + ".tar",
    "http://h/" + "é" * 3000,
    "s3://b/na\x00me.tar",
    "s3://b/line\nbreak\r.tar",
    "s3://b/tab\tand\x7fdel\x1b[31m.tar",
    "s3://b/ünïcödé-名前-🙂.tar",
    "s3://b/back\\slash\\..\\..\\x.tar",
    "https://user:SECRETPASS@h/x.tar?X-Amz-Signature=SECRETSIG&token=SECRETTOKEN",
    "s3://b/x.tar#SECRETFRAGMENT",
]


@pytest.mark.parametrize("url", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_urls_name_a_file_inside_the_cache(url: str, tmp_path: Path) -> None:
    cache_dir = os.path.realpath(tmp_path / "cache")
    name = entry_name(url)
    assert name
    assert "/" not in name
    assert "\\" not in name
    assert "\x00" not in name
    assert name not in (".", "..")
    assert re.fullmatch(r"[A-Za-z0-9._-]+", name)
    assert len(name) + len(".partial") <= 255  # a valid file name on every file system
    for sub, suffix in (("data", ""), ("data", ".partial"), ("meta", ".json"), ("locks", ".lock")):
        path = os.path.realpath(os.path.join(cache_dir, sub, name + suffix))
        assert os.path.commonpath([cache_dir, path]) == cache_dir
        assert os.path.dirname(path) == os.path.join(cache_dir, sub)
    assert "SECRET" not in name


def test_secrets_and_dot_dots_stay_out_of_files_and_logs(
    make_shards: Any, store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    shards = make_shards([3])
    source = shards.paths[0]
    odd = source.parent / "we\nird\x01 名.tar?X-Amz-Signature=SECRETSIG&token=SECRETTOKEN"
    odd.write_bytes(source.read_bytes())
    urls = [
        f"slowfile://{source.parent}/../{source.parent.name}/../../{source.parent.parent.name}"
        f"/{source.parent.name}/{source.name}",
        fakes.url_of(odd),
    ]
    cache_dir = tmp_path / "cache"
    cache = ShardCache(cache_dir)
    for url in urls * 2:  # miss, then hit
        stream = cache.open(url)
        try:
            assert fakes.read_all(stream) == source.read_bytes()
        finally:
            stream.close()
    assert cache.stats.misses == 2
    assert cache.stats.hits == 2
    root = os.path.realpath(cache_dir)
    seen = 0
    for directory, _, files in os.walk(cache_dir):
        for file in files:
            path = os.path.realpath(os.path.join(directory, file))
            assert os.path.commonpath([root, path]) == root
            assert "SECRET" not in file
            assert b"SECRET" not in Path(path).read_bytes(), path
            seen += 1
    assert seen >= 6  # two entries, their metadata and locks, a stats file
    assert sorted(data_files(cache_dir)) == sorted(entry_name(u) for u in urls)
    messages = [r.getMessage() for r in caplog.records]
    assert messages, "expected DEBUG records from opening shards"
    assert not [m for m in messages if "SECRET" in m]


# --- hits and misses -----------------------------------------------------------------------


def _iterate_once(ds: Any) -> None:
    for _ in ds:
        pass


def test_first_epoch_downloads_once_second_epoch_hits(
    make_shards: Any, store: Store, tmp_path: Path
) -> None:
    shards = make_shards([3, 4, 5])
    urls = urls_of(shards.paths)
    sizes = [p.stat().st_size for p in shards.paths]
    total = sum(sizes)
    uncached = samples_of(wds.WebDataset(urls, shardshuffle=False))
    assert uncached == shards.samples
    assert store.opens() == {str(p): 1 for p in shards.paths}

    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds) == uncached
    assert store.opens() == {str(p): 2 for p in shards.paths}
    assert cache_of(ds).stats.as_dict() == zero_stats(misses=3, bytes_network=total)
    assert data_files(cache_dir) == sorted(entry_name(u) for u in urls)
    for url, path in zip(urls, shards.paths, strict=True):
        assert (data_dir(cache_dir) / entry_name(url)).read_bytes() == path.read_bytes()

    assert samples_of(ds) == uncached
    assert store.opens() == {str(p): 2 for p in shards.paths}  # no new fetch
    expected = zero_stats(hits=3, misses=3, bytes_network=total, bytes_disk=total)
    assert cache_of(ds).stats.as_dict() == expected

    info = wds.cache_info(cache_dir)
    assert info["entries"] == 3
    assert info["bytes"] == total
    assert info["partial"] == 0
    assert info["counters"] == expected

    # Another process reads everything from the cache: its counters add up in cache_info.
    child = multiprocessing.get_context("fork").Process(target=_iterate_once, args=(ds,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert store.opens() == {str(p): 2 for p in shards.paths}
    counters = wds.cache_info(cache_dir)["counters"]
    assert counters == {**expected, "hits": 6, "bytes_disk": 2 * total}


def test_local_paths_bypass_the_cache(make_shards: Any, tmp_path: Path) -> None:
    shards = make_shards([2, 3])
    cache_dir = tmp_path / "cache"
    for urls in (shards.spec(), [f"file://{p}" for p in shards.paths]):
        ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir))
        assert samples_of(ds) == shards.samples
        assert cache_of(ds).stats.as_dict() == zero_stats()
    assert data_files(cache_dir) == []


def test_an_opaque_stores_etag_is_never_taken_for_an_md5(
    make_shards: Any, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slowfile:// stands for an opaque store (as HTTP servers and CDNs are): its ETag is not
    verified nor recorded, whether it is the body's MD5 or 32 other hex digits. Checksums that
    are verified (GCS ``md5Hash``, S3 ETags of SSE-S3 objects): tests/cache/test_cache_safety.py."""
    shards = make_shards([3, 3])
    urls = urls_of(shards.paths)
    cache_dir = tmp_path / "cache"
    for etag, url, samples in (
        ("md5", urls[0], shards.samples[:3]),
        ("0123456789abcdef0123456789abcdef", urls[1], shards.samples[3:]),
    ):
        monkeypatch.setenv(fakes.ETAG_ENV, etag)
        ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
        assert samples_of(ds) == samples
        meta = json.loads((cache_dir / "meta" / f"{entry_name(url)}.json").read_text())
        assert meta["checksum"] is None
    assert data_files(cache_dir) == sorted(entry_name(u) for u in urls)


# --- many processes, one node --------------------------------------------------------------


SLOW = {fakes.DELAY_ENV: "0.05", fakes.CHUNK_ENV: "2048"}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_opens_download_each_shard_once(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    """ShardCache.open itself, from 4 processes at once: one downloads, the others follow."""
    shards = make_shards([5, 5, 5], payload_bytes=2000)
    cache_dir = tmp_path / "cache"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [
        ranks(
            f"rank{i}",
            mode="open",
            urls=urls_of(shards.paths),
            cache_dir=str(cache_dir),
            barrier=str(barrier),
            env=SLOW,
        )
        for i in range(4)
    ]
    release(barrier, 4, procs)
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards.paths]
    stats = []
    for proc in procs:
        result = proc.result()
        assert result["sha256"] == digests
        stats.append(result["stats"])
    assert store.opens() == {str(p): 1 for p in shards.paths}
    assert sum(s["misses"] for s in stats) == 3
    assert sum(s["waits"] for s in stats) > 0
    assert sum(s["hits"] + s["misses"] + s["waits"] for s in stats) == 12
    assert data_files(cache_dir) == sorted(entry_name(u) for u in urls_of(shards.paths))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_download_per_node_across_processes_and_workers(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    shards = make_shards([5, 5, 5, 5], payload_bytes=2000)
    urls = urls_of(shards.paths)
    cache_dir = tmp_path / "cache"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [
        ranks(
            f"rank{i}",
            urls=urls,
            cache_dir=str(cache_dir),
            workers=2,
            barrier=str(barrier),
            env=SLOW,
        )
        for i in range(4)
    ]
    release(barrier, 8, procs)  # 4 processes x 2 DataLoader workers
    results = [p.result() for p in procs]
    for result in results:
        assert by_key(decode(result)) == by_key(shards.samples)
    assert store.opens() == {str(p): 1 for p in shards.paths}
    assert data_files(cache_dir) == sorted(entry_name(u) for u in urls)
    info = cache_info(cache_dir)
    assert info["partial"] == 0
    counters = info["counters"]
    assert counters["misses"] == 4
    assert counters["bytes_network"] == sum(p.stat().st_size for p in shards.paths)
    assert counters["waits"] > 0, f"no process followed a download in flight: {counters}"
    # Every one of the 16 shard reads is accounted for by some process's saved counters.
    assert counters["hits"] + counters["misses"] + counters["waits"] == 16, counters


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_nodes_fetch_each_shard_once_each(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    shards = make_shards([4, 4, 4], payload_bytes=2000)
    urls = urls_of(shards.paths)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [
        ranks(
            f"node{node}-rank{rank}",
            urls=urls,
            cache_dir=str(tmp_path / f"node{node}"),
            barrier=str(barrier),
            env=SLOW,
        )
        for node in range(2)
        for rank in range(2)
    ]
    release(barrier, 4, procs)
    for proc in procs:
        assert decode(proc.result()) == shards.samples
    assert store.opens() == {str(p): 2 for p in shards.paths}
    for node in range(2):
        assert data_files(tmp_path / f"node{node}") == sorted(entry_name(u) for u in urls)


# --- crashes and followers -----------------------------------------------------------------

#: A downloader slow enough to be caught mid-shard: small ranged parts fetched one at a time
#: (0.05 s per 8 KiB), so part of the shard is on disk long before the end.
CRAWL = {
    fakes.DELAY_ENV: "0.05",
    fakes.CHUNK_ENV: "8192",
    "CLOUDSHARDS_PART_BYTES": "65536",
    "CLOUDSHARDS_CONCURRENCY": "1",
}


def _partial_started(partial: Path) -> Callable[[], bool]:
    def started() -> bool:
        try:
            return partial.stat().st_size > 0
        except FileNotFoundError:
            return False

    return started


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_downloader_leaves_nothing_that_looks_complete(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    shards = make_shards([20], payload_bytes=30_000)
    url, path = fakes.url_of(shards.paths[0]), shards.paths[0]
    cache_dir = tmp_path / "cache"
    name = entry_name(url)
    partial = data_dir(cache_dir) / f"{name}.partial"
    victim = ranks("victim", urls=[url], cache_dir=str(cache_dir), env=CRAWL)
    wait_for(_partial_started(partial), "the download to start", [victim])
    victim.kill()

    assert data_files(cache_dir) == [f"{name}.partial"]  # no complete-looking entry
    assert partial.stat().st_size < path.stat().st_size
    assert not is_locked(str(cache_dir / "locks" / f"{name}.lock"))
    info = cache_info(cache_dir)
    assert info["entries"] == 0
    assert info["partial"] == 1
    fetched = store.count(path)

    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds) == shards.samples
    assert cache_of(ds).stats.hits == 0
    assert cache_of(ds).stats.misses == 1
    assert store.count(path) == fetched + 1
    assert data_files(cache_dir) == [name]  # the stale partial was reused, then committed
    assert (data_dir(cache_dir) / name).read_bytes() == path.read_bytes()
    assert samples_of(ds) == shards.samples
    assert cache_of(ds).stats.hits == 1
    assert store.count(path) == fetched + 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_follower_takes_over_when_the_downloader_is_killed(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    shards = make_shards([20], payload_bytes=30_000)
    url, path = fakes.url_of(shards.paths[0]), shards.paths[0]
    cache_dir = tmp_path / "cache"
    name = entry_name(url)
    downloader = ranks("downloader", urls=[url], cache_dir=str(cache_dir), env=CRAWL)
    wait_for(_partial_started(data_dir(cache_dir) / f"{name}.partial"), "a download", [downloader])
    fetched: list[int] = []

    def kill_downloader(sample: dict[str, Any]) -> dict[str, Any]:
        if not fetched:  # we are following; now the downloader dies
            downloader.kill()
            fetched.append(store.count(path))
        return sample

    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds.map(kill_downloader)) == shards.samples
    assert cache_of(ds).stats.waits == 1
    assert store.count(path) == fetched[0] + 1  # the follower fetched it once more
    assert data_files(cache_dir) == [name]
    assert (data_dir(cache_dir) / name).read_bytes() == path.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_follower_waits_for_a_download_that_is_slow_to_start(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    """The downloader holds the lock while the store takes its time to answer (a slow first
    byte, a retried request): a second process must wait for it, not fail or fetch again."""
    shards = make_shards([5], payload_bytes=2000)
    url, path = fakes.url_of(shards.paths[0]), shards.paths[0]
    cache_dir = tmp_path / "cache"
    lock = cache_dir / "locks" / f"{entry_name(url)}.lock"
    downloader = ranks(
        "downloader",
        mode="open",
        urls=[url],
        cache_dir=str(cache_dir),
        env={fakes.OPEN_DELAY_ENV: "2"},
    )
    wait_for(lambda: flocked(lock), "the download lock", [downloader])
    cache = ShardCache(cache_dir)
    stream = cache.open(url)
    try:
        assert fakes.read_all(stream) == path.read_bytes()
    finally:
        stream.close()
    assert downloader.result()["sha256"] == [hashlib.sha256(path.read_bytes()).hexdigest()]
    assert store.opens() == {str(path): 1}
    assert cache.stats.misses == 0  # it followed the download, or found it complete


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_followers_counters_are_saved_for_cache_info(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    shards = make_shards([5], payload_bytes=30_000)
    url, path = fakes.url_of(shards.paths[0]), shards.paths[0]
    cache_dir = tmp_path / "cache"
    name = entry_name(url)
    downloader = ranks("downloader", urls=[url], cache_dir=str(cache_dir), env=CRAWL)
    wait_for(_partial_started(data_dir(cache_dir) / f"{name}.partial"), "a download", [downloader])
    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds) == shards.samples
    assert decode(downloader.result()) == shards.samples
    size = path.stat().st_size
    follower = cache_of(ds).stats
    assert follower.waits == 1
    assert 0 < follower.bytes_disk <= size  # what its tar reader consumed
    assert store.opens() == {str(path): 1}
    counters = cache_info(cache_dir)["counters"]
    assert counters["misses"] == 1
    assert counters["bytes_network"] == size
    assert counters["waits"] == 1, f"the follower's counters are missing: {counters}"
    assert counters["bytes_disk"] == follower.bytes_disk


# --- corrupt entries -----------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "meta-size", "meta-missing"])
def test_corrupt_entry_is_detected_and_refetched(
    damage: str,
    make_shards: Any,
    store: Store,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shards = make_shards([4], payload_bytes=1000)
    url, path = fakes.url_of(shards.paths[0]), shards.paths[0]
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds) == shards.samples
    entry = data_dir(cache_dir) / entry_name(url)
    meta = cache_dir / "meta" / f"{entry_name(url)}.json"
    if damage == "truncate":
        os.truncate(entry, entry.stat().st_size // 2)
    elif damage == "meta-size":
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "size": 12345}))
    else:
        meta.unlink()
    caplog.set_level(logging.WARNING)
    assert samples_of(ds) == shards.samples
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "corrupt or truncated" in warnings[0].getMessage()
    assert store.count(path) == 2
    assert entry.read_bytes() == path.read_bytes()
    assert json.loads(meta.read_text())["size"] == path.stat().st_size
    assert samples_of(ds) == shards.samples
    assert store.count(path) == 2  # the repaired entry is a hit


# --- budget --------------------------------------------------------------------------------


def test_budget_keeps_the_cache_under_its_size(
    make_shards: Any, store: Store, tmp_path: Path
) -> None:
    shards = make_shards([4] * 5, payload_bytes=1500)
    sizes = {p.stat().st_size for p in shards.paths}
    assert len(sizes) == 1
    size = sizes.pop()
    budget = 2 * size + size // 2  # room for two shards
    cache_dir = tmp_path / "cache"
    observed: list[int] = []

    def observe(sample: dict[str, Any]) -> dict[str, Any]:
        observed.append(data_bytes(cache_dir))
        return sample

    urls = urls_of(shards.paths)
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), cache_size=budget)
    assert samples_of(ds.map(observe)) == shards.samples
    assert len(observed) == 20
    assert max(observed) <= budget
    assert data_bytes(cache_dir) <= budget
    stats = cache_of(ds).stats
    assert stats.misses == 5
    assert stats.evictions == 3
    assert stats.hits == 0
    assert data_files(cache_dir) == sorted(entry_name(u) for u in urls[3:])  # most recent
    assert store.opens() == {str(p): 1 for p in shards.paths}

    observed.clear()
    assert samples_of(ds.map(observe)) == shards.samples
    assert max(observed) <= budget
    assert data_bytes(cache_dir) <= budget


def test_entry_in_use_is_never_evicted(make_shards: Any, store: Store, tmp_path: Path) -> None:
    shards = make_shards([4] * 5, payload_bytes=1500)
    size = shards.paths[0].stat().st_size
    budget = 2 * size + size // 2
    urls = urls_of(shards.paths)
    cache_dir = tmp_path / "cache"
    first = wds.WebDataset(urls[:1], shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(first) == shards.samples[:4]

    held = ShardCache(cache_dir, max_bytes=budget).open(urls[0])  # a hit, held open
    try:
        head = held.read(1000)
        observed: list[int] = []
        rest_ds = wds.WebDataset(
            urls[1:], shardshuffle=False, cache_dir=str(cache_dir), cache_size=budget
        )

        def observe(sample: dict[str, Any]) -> dict[str, Any]:
            observed.append(data_bytes(cache_dir))
            return sample

        samples = samples_of(rest_ds.map(observe))
        assert samples == shards.samples[4:]
        assert cache_of(rest_ds).stats.evictions > 0
        assert max(observed) <= budget
        assert entry_name(urls[0]) in data_files(cache_dir)
        assert head + fakes.read_all(held) == shards.paths[0].read_bytes()
    finally:
        held.close()
    assert store.count(shards.paths[0]) == 1


def test_shard_over_budget_streams_uncached_with_one_warning(
    make_shards: Any, store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    shards = make_shards([6, 6], payload_bytes=2000)
    size = shards.paths[0].stat().st_size
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(
        urls_of(shards.paths), shardshuffle=False, cache_dir=str(cache_dir), cache_size=size // 2
    )
    assert samples_of(ds) == shards.samples
    assert samples_of(ds) == shards.samples
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "budget" in warnings[0]
    assert cache_of(ds).stats.uncached == 4
    assert cache_of(ds).stats.misses == 0
    assert data_files(cache_dir) == []
    assert store.opens() == {str(p): 2 for p in shards.paths}


# --- a full disk ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_full_disk_degrades_to_streaming_with_one_warning(
    make_shards: Any, store: Store, tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    shards = make_shards([5, 5, 5], payload_bytes=4000)
    limit = 16 << 10
    assert all(p.stat().st_size > limit for p in shards.paths)
    cache_dir = tmp_path / "cache"
    proc = ranks("full", urls=urls_of(shards.paths), cache_dir=str(cache_dir), fsize_limit=limit)
    result = proc.result()
    assert decode(result) == shards.samples
    full = [line for line in proc.log().splitlines() if "disk full" in line]
    assert len(full) == 1, proc.log()
    assert full[0].startswith("WARNING")
    assert result["stats"]["uncached"] == 3
    assert result["stats"]["misses"] == 0
    assert data_files(cache_dir) == []  # no entry, no partial file
    assert store.opens() == {str(p): 1 for p in shards.paths}


# --- early stop ----------------------------------------------------------------------------


def test_early_stop_abandons_a_large_remainder(
    make_shards: Any, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TeeStream, "DRAIN_MAX_BYTES", 8192)
    monkeypatch.setenv(fakes.CHUNK_ENV, "8192")
    # A store slow enough that the reader stops before its download (at the store's speed,
    # in the background) is complete: one part of 64 KiB at a time, each taking 0.1 s.
    monkeypatch.setenv(fakes.OPEN_DELAY_ENV, "0.1")
    monkeypatch.setenv("CLOUDSHARDS_CONCURRENCY", "1")
    monkeypatch.setenv("CLOUDSHARDS_PART_BYTES", "65536")
    shards = make_shards([30], payload_bytes=10_000)
    url = fakes.url_of(shards.paths[0])
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir), block_bytes=8192)
    assert take(ds, 3) == shards.samples[:3]
    assert data_files(cache_dir) == []  # neither an entry nor a partial file
    assert not is_locked(str(cache_dir / "locks" / f"{entry_name(url)}.lock"))
    assert samples_of(ds) == shards.samples  # the next reader downloads it whole
    assert data_files(cache_dir) == [entry_name(url)]
    assert store.count(shards.paths[0]) == 2


@pytest.mark.timeout(60)
def test_a_follower_never_waits_on_the_pace_of_the_reader_that_downloads(
    make_shards: Any, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DDP in lockstep: rank A has read the start of a shard and waits in a collective for
    # rank B, which reads the end of the same shard through the cache. A's download must go
    # on without A's reader, or B waits for bytes nobody fetches (FollowStream.STALL_S, then
    # a second download of the shard).
    monkeypatch.setattr(FollowStream, "STALL_S", 20.0)
    monkeypatch.setenv(fakes.CHUNK_ENV, "8192")
    monkeypatch.setenv("CLOUDSHARDS_PART_BYTES", "65536")
    shards = make_shards([30], payload_bytes=10_000)
    url = fakes.url_of(shards.paths[0])
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir), block_bytes=8192)
    rank_a = iter(ds)
    assert samples_of(itertools.islice(rank_a, 1)) == shards.samples[:1]  # then A waits
    began = time.monotonic()
    rank_b = ShardCache(cache_dir).open(url)  # follows A's download
    try:
        assert fakes.read_all(rank_b) == shards.paths[0].read_bytes()
    finally:
        rank_b.close()
    assert time.monotonic() - began < FollowStream.STALL_S / 2
    assert store.count(shards.paths[0]) == 1  # one download, A's
    assert samples_of(rank_a) == shards.samples[1:]
    assert data_files(cache_dir) == [entry_name(url)]


def _own_download(cache: ShardCache, url: str, cancel: threading.Event, pool: Any) -> Any:
    """``url`` opened as the pipeline opens it: a download of its own, in the background."""
    fetch = FetchOptions(part_bytes=1 << 16, concurrency=2)
    return open_source(url, OpenOptions(), fetch=fetch, cache=cache, executor=pool, cancel=cancel)


def test_a_reader_closing_its_own_download_early_stops_it(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader that closes its shard early (a handler skipping a bad shard, balancing's cut)
    # while the iterator goes on: its download stops, as a stream it pulled would have.
    monkeypatch.setattr(TeeStream, "DRAIN_MAX_BYTES", 1 << 16)
    monkeypatch.setenv(fakes.OPEN_DELAY_ENV, "0.02")
    path = tmp_path / "big.tar"
    path.write_bytes(os.urandom(8 << 20))
    cache, cancel = ShardCache(tmp_path / "cache"), threading.Event()
    with cf.ThreadPoolExecutor(3) as pool:
        stream = _own_download(cache, fakes.url_of(path), cancel, pool)
        assert len(stream.read(1000)) == 1000
        stream.close()
        time.sleep(1.0)
        fetched = cache.stats.bytes_network
        time.sleep(0.5)
        assert cache.stats.bytes_network == fetched < 1 << 20  # stopped, early
        cancel.set()
        cache.join_downloads(cancel, 30)
    assert cache.stats.uncached == 1
    assert data_files(tmp_path / "cache") == []


def test_an_own_download_whose_commit_fails_is_not_fetched_again(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(os.urandom(1 << 20))
    cache, cancel = ShardCache(tmp_path / "cache"), threading.Event()

    def no_room(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache, "_write_meta", no_room)
    with cf.ThreadPoolExecutor(4) as pool:
        stream = _own_download(cache, fakes.url_of(path), cancel, pool)
        try:
            assert fakes.read_all(stream) == path.read_bytes()
        finally:
            stream.close()
        cancel.set()
        cache.join_downloads(cancel, 30)
    assert store.count(path) == 1
    assert cache.stats.uncached == 1
    assert cache.stats.misses == 0


def test_early_stop_counts_the_shard_as_uncached(
    make_shards: Any, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CacheStats: ``misses`` are shards downloaded and cached; ``uncached`` includes early
    stops."""
    monkeypatch.setattr(TeeStream, "DRAIN_MAX_BYTES", 8192)
    monkeypatch.setenv(fakes.CHUNK_ENV, "8192")
    # A store slow enough that the reader stops before its download (at the store's speed,
    # in the background) is complete: one part of 64 KiB at a time, each taking 0.1 s.
    monkeypatch.setenv(fakes.OPEN_DELAY_ENV, "0.1")
    monkeypatch.setenv("CLOUDSHARDS_CONCURRENCY", "1")
    monkeypatch.setenv("CLOUDSHARDS_PART_BYTES", "65536")
    shards = make_shards([30], payload_bytes=10_000)
    ds = wds.WebDataset(
        urls_of(shards.paths), shardshuffle=False, cache_dir=str(tmp_path / "c"), block_bytes=8192
    )
    assert take(ds, 1) == shards.samples[:1]
    assert cache_of(ds).stats.misses == 0
    assert cache_of(ds).stats.uncached == 1


def test_early_stop_drains_a_small_remainder_and_commits(
    make_shards: Any, store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fakes.CHUNK_ENV, "8192")
    shards = make_shards([30], payload_bytes=10_000)
    url, path = fakes.url_of(shards.paths[0]), shards.paths[0]
    assert path.stat().st_size < TeeStream.DRAIN_MAX_BYTES
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset([url], shardshuffle=False, cache_dir=str(cache_dir), block_bytes=8192)
    assert take(ds, 2) == shards.samples[:2]
    assert data_files(cache_dir) == [entry_name(url)]
    assert (data_dir(cache_dir) / entry_name(url)).read_bytes() == path.read_bytes()
    assert cache_of(ds).stats.misses == 1
    assert cache_of(ds).stats.bytes_network == path.stat().st_size
    assert samples_of(ds) == shards.samples
    assert cache_of(ds).stats.hits == 1
    assert store.count(path) == 1


# --- clear, info, the CLI, pickling --------------------------------------------------------


def _fill(cache_dir: Path, urls: list[str]) -> None:
    _iterate_once(wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir)))


def test_clear_cache_keeps_entries_in_use(make_shards: Any, store: Store, tmp_path: Path) -> None:
    shards = make_shards([2, 2, 2])
    urls = urls_of(shards.paths)
    cache_dir = tmp_path / "cache"
    _fill(cache_dir, urls)
    stale = data_dir(cache_dir) / f"{entry_name('s3://b/gone.tar')}.partial"
    stale.write_bytes(b"left by a crashed downloader")
    held = ShardCache(cache_dir).open(urls[0])
    try:
        assert clear_cache(cache_dir) == 2
        assert data_files(cache_dir) == [entry_name(urls[0])]
        held_name = entry_name(urls[0])
        assert sorted(os.listdir(cache_dir / "meta")) == [
            f"{held_name}.json",
            f"{held_name}.members.json",  # its member table (see _membertable)
        ]
        assert fakes.read_all(held) == shards.paths[0].read_bytes()
    finally:
        held.close()
    assert clear_cache(cache_dir) == 1
    assert data_files(cache_dir) == []
    assert clear_cache(tmp_path / "never-created") == 0


def test_cli_cache_info_and_clear(
    make_shards: Any, store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = make_shards([2, 3])
    cache_dir = tmp_path / "cache"
    _fill(cache_dir, urls_of(shards.paths))
    total = sum(p.stat().st_size for p in shards.paths)

    assert cli_main(["cache", "info", str(cache_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"directory: {cache_dir}" in out
    assert f"entries:   2 ({total:,} bytes)" in out
    assert "partial:   0 downloads in flight or interrupted" in out
    assert "misses:        2" in out
    assert "hits:          0" in out
    assert f"bytes_network: {total:,}" in out

    assert cli_main(["cache", "clear", str(cache_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"removed 2 entries from {cache_dir}")
    assert cli_main(["cache", "info", str(cache_dir)]) == 0
    assert "entries:   0 (0 bytes)" in capsys.readouterr().out.splitlines()

    for command in ("info", "clear"):
        assert cli_main(["cache", command, str(tmp_path / "missing")]) == 2
        assert "no cache directory" in capsys.readouterr().err

    run = subprocess.run(
        [sys.executable, "-m", "cloudshards.cli", "cache", "info", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    assert "no cache directory" in run.stderr


def test_shard_cache_pickles_without_its_stats(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", max_bytes=12345)
    cache.stats.hits = 7
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.directory == cache.directory
    assert clone.max_bytes == 12345
    assert clone._stats is None  # counters never travel: a worker counts its own
    # In one process, every cache object on a directory shares the process's counters (they
    # are saved to one file per process; separate objects would overwrite each other's).
    assert clone.stats is cache.stats
    other = ShardCache(tmp_path / "other")
    assert other.stats.as_dict() == zero_stats()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cached_dataset_runs_in_spawned_workers(
    make_shards: Any, store: Store, tmp_path: Path
) -> None:
    shards = make_shards([3, 3])
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(urls_of(shards.paths), shardshuffle=False, cache_dir=str(cache_dir))
    assert samples_of(ds) == shards.samples
    clone = pickle.loads(pickle.dumps(ds))
    assert cache_of(clone).directory == cache_of(ds).directory
    assert cache_of(clone)._stats is None
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="spawn",
        worker_init_fn=fakes.register,
    )
    assert by_key(samples_of(loader)) == by_key(shards.samples)
    assert store.opens() == {str(p): 1 for p in shards.paths}  # the workers hit the cache
    assert cache_info(cache_dir)["counters"]["hits"] == 2


def test_two_datasets_on_one_cache_count_together(
    make_shards: Any, store: Store, tmp_path: Path
) -> None:
    # Train and val sharing a cache directory in one process: cache_info counts both.
    shards = make_shards([2, 2, 2])
    cache_dir = tmp_path / "cache"
    urls = urls_of(shards.paths)
    _iterate_once(wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir)))
    _iterate_once(wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir)))
    counters = cache_info(cache_dir)["counters"]
    assert (counters["misses"], counters["hits"]) == (3, 3)


def test_every_stream_is_a_context_manager(make_shards: Any, store: Store, tmp_path: Path) -> None:
    # webdataset's FileCache yields real files, so its users write `with source["stream"]:`.
    shards = make_shards([2])
    url = urls_of(shards.paths)[0]
    cache = ShardCache(tmp_path / "cache")
    for _ in range(2):  # a download (tee), then a hit
        with cache.open(url) as stream:
            assert fakes.read_all(stream) == shards.paths[0].read_bytes()
        assert stream.closed
    from cloudshards.source import OpenOptions, open_remote

    with open_remote(url, OpenOptions()) as remote:
        assert fakes.read_all(remote) == shards.paths[0].read_bytes()
    assert remote.closed
