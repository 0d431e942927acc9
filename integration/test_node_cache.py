"""The per-node shard cache against real servers and real processes.

Several Python processes (each with a 2-worker DataLoader) read the same shards through one
``cache_dir``; the server's own request record (nginx's access log, moto's werkzeug log, a
counting proxy in front of fake-gcs-server) shows how often each object crossed the network.
Where nginx's or moto's log is counted, the shards are a private copy read through the cloud
simulator (``cloudsim.py``), whose counters say when that log is complete (``ServerRecord``).
Also: two "nodes" (two cache dirs), a downloader killed with SIGKILL mid-shard, a byte budget
smaller than the dataset, and hostile URLs (path tricks, long names, signed-URL secrets).

Every process runs ``WebDataset(url, shardshuffle=False, nodesplitter=None, cache_dir=...)``:
with no node splitter (and no RANK/WORLD_SIZE in the environment) each process reads every
shard, and the default ``split_by_worker`` gives its two workers half each, so every process
sees the whole dataset exactly once per epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

import pytest
import torch.utils.data
from cloudsim_fixtures import cloudsim_process_factory  # noqa: F401
from servers import gcs_download_name

import cloudshards as wds
from cloudshards.cache import ShardCache, cache_info, entry_name

if TYPE_CHECKING:
    from cloudsim import CloudSimProcess
    from conftest import LocalDataset, RemoteDataset
    from servers import GCSServer, NginxServer, S3Server

NUM_PROCESSES = 4
NUM_WORKERS = 2
STARTUP_TIMEOUT_S = 120.0  # 4 processes importing torch on 2 busy cores
RUN_TIMEOUT_S = 120.0
SECRETS = ("SECRET123", "SECRET456", "SECRET789", "SECRET999")
# How long a server may take to log the requests the simulator has already forwarded to it.
LOG_TIMEOUT_S = 30.0
# Python >= 3.12 warns when forking a process that has threads (fsspec's IO loop, the sampler
# thread below); the DataLoader forks on purpose. Not a cloudshards warning.
FORK_WARNING = pytest.mark.filterwarnings(
    r"ignore:This process \(pid=\d+\) is multi-threaded, use of fork\(\):DeprecationWarning"
)

Sample = dict[str, bytes]

# ------------------------------------------------------------------------------ reader script

# Run by each reader process: build the dataset, signal "ready", wait at the barrier, read
# every sample, pickle what it saw. Optionally pause forever after N samples (to be killed).
READER_SCRIPT = r"""
import json, logging, os, pickle, sys, time
from pathlib import Path

cfg = json.loads(Path(sys.argv[1]).read_text())
if cfg["log_debug"]:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("LOG %(name)s %(levelname)s %(message)s"))
    lib = logging.getLogger("cloudshards")
    lib.setLevel(logging.DEBUG)
    lib.addHandler(handler)

import torch.utils.data
import cloudshards as wds


def wait_for(path, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {path}")
        time.sleep(0.01)


ds = wds.WebDataset(
    cfg["urls"],
    shardshuffle=False,
    nodesplitter=None,
    cache_dir=cfg["cache_dir"],
    cache_size=cfg["cache_size"],
    storage_options=cfg["storage_options"],
    block_bytes=cfg["block_bytes"],
)
if cfg["workers"]:
    source = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=cfg["workers"])
else:
    source = ds
Path(cfg["ready"]).touch()
if cfg["go"]:
    wait_for(cfg["go"], cfg["timeout_s"])
samples = []
for epoch in range(cfg["epochs"]):
    for sample in source:
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        samples.append((epoch, sample["__key__"], sample["__url__"], fields))
        if len(samples) == 1:
            Path(cfg["started"]).touch()
        if cfg["pause_after"] == len(samples):
            Path(cfg["paused"]).touch()
            time.sleep(cfg["timeout_s"])  # the test kills us here
            sys.exit("pause was not interrupted")
stats = ds.cache.stats.as_dict() if ds.cache is not None else {}
tmp = cfg["out"] + ".tmp"
with open(tmp, "wb") as f:
    pickle.dump({"samples": samples, "stats": stats}, f)
os.replace(tmp, cfg["out"])
"""


@dataclass
class ReaderResult:
    """What one reader process saw: (epoch, key, url, fields) per sample, its cache counters
    (main process only: workers keep their own) and its stderr."""

    samples: list[tuple[int, str, str, Sample]]
    stats: dict[str, int]
    stderr: str


@dataclass
class Reader:
    """One reader subprocess (its own session, so its DataLoader workers die with it)."""

    name: str
    popen: subprocess.Popen[bytes]
    workdir: Path

    def path(self, what: str) -> Path:
        return self.workdir / what

    def stderr(self) -> str:
        try:
            return self.path("stderr").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_file(self, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until the reader creates ``what``; fail at once if it exits first."""
        deadline = time.monotonic() + timeout_s
        while not self.path(what).exists():
            if self.popen.poll() is not None:
                pytest.fail(
                    f"{self.name} exited with {self.popen.returncode} before '{what}':\n"
                    f"{self.stderr()[-3000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} did not reach '{what}' in {timeout_s:.0f} s")
            time.sleep(0.02)

    def result(self, timeout_s: float = RUN_TIMEOUT_S) -> ReaderResult:
        """Wait for a clean exit and load what the reader saw."""
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"{self.name} did not finish in {timeout_s:.0f} s:\n{self.stderr()[-3000:]}"
            )
        assert code == 0, f"{self.name} exited with {code}:\n{self.stderr()[-3000:]}"
        with self.path("out.pickle").open("rb") as f:
            data = pickle.load(f)
        return ReaderResult(data["samples"], data["stats"], self.stderr())

    def kill(self) -> None:
        """SIGKILL the reader and everything in its session (its DataLoader workers)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


class ReaderPool:
    """Starts reader subprocesses; every one still running is killed at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.script = root / "reader.py"
        self.script.write_text(READER_SCRIPT)
        self.readers: list[Reader] = []

    def start(
        self,
        name: str,
        urls: str | list[str],
        cache_dir: Path,
        *,
        go: Path | None = None,
        workers: int = NUM_WORKERS,
        storage_options: Any = None,
        cache_size: int = -1,
        block_bytes: int | None = None,
        pause_after: int | None = None,
        epochs: int = 1,
        log_debug: bool = False,
    ) -> Reader:
        """Start one reader; with ``go`` it waits at that barrier file before reading."""
        workdir = self.root / name
        workdir.mkdir()
        cfg = {
            "urls": urls,
            "cache_dir": str(cache_dir),
            "cache_size": cache_size,
            "storage_options": storage_options,
            "block_bytes": block_bytes,
            "workers": workers,
            "epochs": epochs,
            "ready": str(workdir / "ready"),
            "started": str(workdir / "started"),
            "paused": str(workdir / "paused"),
            "go": str(go) if go is not None else None,
            "out": str(workdir / "out.pickle"),
            "pause_after": pause_after,
            "log_debug": log_debug,
            "timeout_s": STARTUP_TIMEOUT_S + RUN_TIMEOUT_S,
        }
        (workdir / "config.json").write_text(json.dumps(cfg))
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        with (workdir / "stdout").open("wb") as out, (workdir / "stderr").open("wb") as err:
            popen = subprocess.Popen(
                [sys.executable, str(self.script), str(workdir / "config.json")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        reader = Reader(name, popen, workdir)
        self.readers.append(reader)
        return reader

    def release(self, readers: Sequence[Reader], go: Path) -> None:
        """The barrier: once every reader is ready (torch imported, dataset built), let all go."""
        for reader in readers:
            reader.wait_for_file("ready")
        go.touch()

    def kill_all(self) -> None:
        for reader in self.readers:
            reader.kill()


@pytest.fixture
def readers(tmp_path: Path) -> Iterator[ReaderPool]:
    """Reader subprocesses for one test, all killed at teardown."""
    root = tmp_path / "readers"
    root.mkdir()
    pool = ReaderPool(root)
    try:
        yield pool
    finally:
        pool.kill_all()


# ------------------------------------------------------------------------------ helpers


def check_samples(
    samples: Sequence[tuple[int, str, str, Sample]], expected: dict[str, Sample], who: str
) -> None:
    """Every expected sample exactly once (per epoch), byte for byte."""
    for epoch in sorted({s[0] for s in samples}) or [0]:
        keys = Counter(key for e, key, _, _ in samples if e == epoch)
        duplicated = sorted(k for k, n in keys.items() if n > 1)
        missing = sorted(set(expected) - set(keys))
        unexpected = sorted(set(keys) - set(expected))
        assert not duplicated, f"{who}, epoch {epoch}: duplicated {duplicated[:5]}"
        assert not missing, f"{who}, epoch {epoch}: missing {missing[:5]}"
        assert not unexpected, f"{who}, epoch {epoch}: unexpected {unexpected[:5]}"
    corrupt = sorted({key for _, key, _, fields in samples if fields != expected[key]})
    assert not corrupt, f"{who}: samples with wrong bytes: {corrupt[:5]}"


class LoggedRequest(NamedTuple):
    """One request as the server logged it."""

    method: str
    path: str  # the request path, query string removed
    status: int
    sent: int | None  # body bytes sent (nginx); moto does not log them: None


@dataclass
class ServerRecord:
    """The requests under ``prefix`` that reached a server through a cloud simulator, as the
    server logged them, read once the log is complete.

    Why this is race-free, where waiting for the log to go quiet was not: the simulator
    counts a request before it forwards it, so before the client can have any answer to it.
    Tests ask only after every reader (thread, DataLoader worker, subprocess) has finished,
    so every request a client waited for is already in ``forwarded()``: an extra request
    cannot come after it. The server logs each request it answers when it likes (nginx as a
    response ends, in one of two worker processes; moto from the request's thread), so its
    log may lag that count but never stay below it: wait until it has caught up, however
    slowly, and fail (never pass) if it has not within LOG_TIMEOUT_S. More entries than
    forwarded requests means one bypassed the simulator: also a failure. ``prefix`` is the
    test's own, so no other test's request, however late it is logged, is counted.
    """

    sim: CloudSimProcess
    prefix: str
    read_log: Callable[[], list[LoggedRequest]]  # the server's entries under ``prefix``
    marked: int = 0  # requests before the last mark()

    def forwarded(self) -> int:
        """How many requests under ``prefix`` the simulator has forwarded."""
        by_path = self.sim.stats().by_path
        return sum(n for path, n in by_path.items() if path.startswith(self.prefix))

    def logged(self) -> list[LoggedRequest]:
        """Every request under ``prefix``, once the server's log holds all of them."""
        expected = self.forwarded()
        deadline = time.monotonic() + LOG_TIMEOUT_S
        while len(entries := self.read_log()) < expected:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the server logged {len(entries)} of the {expected} requests the "
                    f"simulator forwarded under {self.prefix}, in {LOG_TIMEOUT_S:.0f} s: "
                    f"{entries}"
                )
            time.sleep(0.01)
        assert len(entries) == expected, (
            f"the server logged {len(entries)} requests under {self.prefix}, the simulator "
            f"forwarded {expected}: some bypassed it? {entries}"
        )
        return entries

    def mark(self) -> None:
        """Start counting here (the requests so far all logged first)."""
        self.marked = len(self.logged())

    def since_mark(self) -> list[LoggedRequest]:
        """The requests since the last mark(), in the server's log order."""
        return self.logged()[self.marked :]


def nginx_record(server: NginxServer, sim: CloudSimProcess, prefix: str) -> ServerRecord:
    """nginx's access log from now on, for request paths under ``prefix``."""
    log = server.access_log_path
    offset = log.stat().st_size if log.exists() else 0

    def read() -> list[LoggedRequest]:
        with log.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        found = []
        for line in lines:  # the NginxServer format: status, request line, Range, body bytes
            status, request, _, sent = [*line.split("\t"), "", "", ""][:4]
            method, target = [*request.split(" "), ""][:2]
            path = target.split("?", 1)[0]
            if path.startswith(prefix):
                found.append(LoggedRequest(method, path, int(status or 0), int(sent or 0)))
        return found

    return ServerRecord(sim, prefix, read)


def moto_record(server: S3Server, sim: CloudSimProcess, prefix: str) -> ServerRecord:
    """moto's request log from now on, for request paths under ``prefix``."""
    log = server.process.log_path
    offset = log.stat().st_size

    def read() -> list[LoggedRequest]:
        return [r for r in moto_requests(log, offset) if r.path.startswith(prefix)]

    return ServerRecord(sim, prefix, read)


@dataclass(frozen=True)
class ProxiedCopy:
    """The six shards copied under a prefix of this test's own, reached through a cloud
    simulator (``remote``'s URLs and options point at it), and the server's record of them."""

    remote: RemoteDataset
    record: ServerRecord


@pytest.fixture
def http_copy(
    http_dataset: RemoteDataset, cloudsim_process: Callable[..., CloudSimProcess]
) -> ProxiedCopy:
    """The shards in a fresh directory on nginx, read through a simulator."""
    server: NginxServer = http_dataset.server
    local = http_dataset.local
    name = f"node-cache-{uuid.uuid4().hex[:8]}"
    (server.root / name).mkdir()
    for shard in local.shards:
        shutil.copyfile(local.root / shard, server.root / name / shard)
    sim = cloudsim_process(server.base_url)
    base = f"{sim.url}/{name}"
    remote = dataclasses.replace(http_dataset, base_url=base, url=f"{base}/{local.brace}")
    return ProxiedCopy(remote, nginx_record(server, sim, f"/{name}/"))


@pytest.fixture
def s3_copy(
    s3_dataset: RemoteDataset, cloudsim_process: Callable[..., CloudSimProcess]
) -> ProxiedCopy:
    """The shards under a fresh prefix of the bucket on moto, read through a simulator. The
    upload goes through it too: moto's log then holds exactly what the simulator counts."""
    import s3fs

    server: S3Server = s3_dataset.server
    local = s3_dataset.local
    sim = cloudsim_process(server.endpoint_url)
    assert s3_dataset.storage_options is not None
    options = {"s3": {**s3_dataset.storage_options["s3"], "endpoint_url": sim.url}}
    prefix = f"{urlsplit(s3_dataset.base_url).netloc}/node-cache-{uuid.uuid4().hex[:8]}"
    record = moto_record(server, sim, f"/{prefix}/")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options["s3"])
    fs.put([str(local.root / n) for n in local.shards], [f"{prefix}/{n}" for n in local.shards])
    env = {k: v.replace(server.endpoint_url, sim.url) for k, v in s3_dataset.env.items()}
    remote = dataclasses.replace(
        s3_dataset,
        base_url=f"s3://{prefix}",
        url=f"s3://{prefix}/{local.brace}",
        storage_options=options,
        env=env,
    )
    return ProxiedCopy(remote, record)


def gets_by_path(requests: Sequence[LoggedRequest]) -> dict[str, list[int]]:
    """Body bytes of every GET, by request path."""
    gets: dict[str, list[int]] = {}
    for request in requests:
        if request.method == "GET":
            gets.setdefault(request.path, []).append(request.sent or 0)
    return gets


def url_path(url: str) -> str:
    return urlsplit(url).path


def cache_files(cache_dir: Path) -> list[Path]:
    return [Path(d) / name for d, _, names in os.walk(cache_dir) for name in names]


def complete_entries(cache_dir: Path) -> dict[str, bytes]:
    data = cache_dir / "data"
    return {p.name: p.read_bytes() for p in data.iterdir() if not p.name.endswith(".partial")}


def assert_cache_holds(
    cache_dir: Path, url: str, source: Path, endpoint: str | None = None
) -> None:
    """The entry for ``url`` is complete, equals the source file, and no partial is left."""
    name = entry_name(url, endpoint)
    entry = cache_dir / "data" / name
    assert entry.is_file(), f"no complete entry for {url}: {sorted(os.listdir(entry.parent))}"
    assert entry.read_bytes() == source.read_bytes(), f"cache entry of {url} differs from source"
    meta = json.loads((cache_dir / "meta" / f"{name}.json").read_text())
    assert meta["size"] == source.stat().st_size
    partials = [p.name for p in (cache_dir / "data").iterdir() if p.name.endswith(".partial")]
    assert not partials, f"partial files left: {partials}"


# ------------------------------------------------------------------------------ one node


@pytest.mark.timeout(240)
def test_four_processes_one_cache_http(
    readers: ReaderPool, http_copy: ProxiedCopy, tmp_path: Path
) -> None:
    """4 processes x 2 workers read all shards from nginx through one cache: each shard is
    GET once (one response, exactly the file's bytes), every process sees every sample."""
    remote = http_copy.remote
    cache_dir = tmp_path / "cache"
    go = tmp_path / "go"
    group = [readers.start(f"p{i}", remote.url, cache_dir, go=go) for i in range(NUM_PROCESSES)]
    readers.release(group, go)
    for reader in group:
        check_samples(reader.result().samples, remote.local.samples, reader.name)

    # nginx logs the body bytes of every response: one download of a shard serves exactly
    # its size, whether in one GET or in several ranged ones.
    gets = gets_by_path(http_copy.record.logged())
    local = remote.local
    for url, name in zip(remote.shard_urls(), local.shards, strict=True):
        sent = gets.get(url_path(url), [])
        size = (local.root / name).stat().st_size
        assert sum(sent) == size, (
            f"{name}: nginx served {sum(sent)} bytes in {len(sent)} GETs = "
            f"{sum(sent) / size:.2f} x the object's {size} bytes, with one shared cache"
        )
    assert set(gets) == {url_path(u) for u in remote.shard_urls()}, sorted(gets)
    for url, name in zip(remote.shard_urls(), local.shards, strict=True):
        assert_cache_holds(cache_dir, url, local.root / name)

    counters = cache_info(cache_dir)["counters"]
    assert counters.get("misses") == len(local.shards), counters
    opened = counters.get("misses", 0) + counters.get("hits", 0) + counters.get("waits", 0)
    assert opened == NUM_PROCESSES * len(local.shards), (
        f"persisted counters account for {opened} shard opens, "
        f"{NUM_PROCESSES * len(local.shards)} happened: {counters}"
    )


_WERKZEUG_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def moto_requests(log: Path, offset: int) -> list[LoggedRequest]:
    """Each request moto logged after ``offset`` (no body sizes: moto does not log them).

    moto's server logs every request through werkzeug (``"GET /bucket/key HTTP/1.1" 206 -``)
    when it sends the response's status line, i.e. before the client has the body.
    """
    with log.open("rb") as f:
        f.seek(offset)
        # werkzeug colours its request lines when it thinks it writes to a terminal.
        text = _ANSI_ESCAPE.sub("", f.read().decode(errors="replace"))
    return [
        LoggedRequest(m.group(1), m.group(2).split("?", 1)[0], int(m.group(3)), None)
        for m in _WERKZEUG_LINE.finditer(text)
    ]


def _object_requests(requests: list[LoggedRequest]) -> Iterator[tuple[str, int]]:
    """(path, status) of each GET; fails on any error status."""
    errors = [r for r in requests if r.status >= 400]
    assert not errors, f"moto answered errors: {errors}"
    return ((r.path, r.status) for r in requests if r.method == "GET")


@pytest.mark.timeout(240)
def test_four_processes_one_cache_s3(
    readers: ReaderPool, s3_copy: ProxiedCopy, tmp_path: Path
) -> None:
    """The same with moto S3. moto logs requests but not body sizes, so the GETs of one
    uncached read (in this process, same options) are the yardstick: the 4 cached processes
    together must make exactly that many GETs of each object."""
    remote, record = s3_copy.remote, s3_copy.record
    local = remote.local
    record.mark()  # after the upload
    plain = wds.WebDataset(remote.url, shardshuffle=False, storage_options=remote.storage_options)
    check_samples(
        [(0, s["__key__"], s["__url__"], _fields(s)) for s in plain], local.samples, "uncached"
    )
    one_download = Counter(m for m, _ in _object_requests(record.since_mark()))
    assert set(one_download) == {f"/{urlsplit(u).netloc}{url_path(u)}" for u in remote.shard_urls()}

    record.mark()
    cache_dir = tmp_path / "cache"
    go = tmp_path / "go"
    group = [
        readers.start(f"p{i}", remote.url, cache_dir, go=go, storage_options=remote.storage_options)
        for i in range(NUM_PROCESSES)
    ]
    readers.release(group, go)
    for reader in group:
        check_samples(reader.result().samples, local.samples, reader.name)

    gets = Counter(m for m, _ in _object_requests(record.since_mark()))
    assert gets == one_download, (
        f"object GETs by 4 processes with one shared cache: {dict(gets)}; "
        f"one uncached read makes {dict(one_download)}"
    )
    assert remote.storage_options is not None
    endpoint = remote.storage_options["s3"]["endpoint_url"]
    for url, name in zip(remote.shard_urls(), local.shards, strict=True):
        assert_cache_holds(cache_dir, url, local.root / name, endpoint)


@pytest.mark.timeout(240)
def test_two_nodes_fetch_each_shard_twice(
    readers: ReaderPool, http_copy: ProxiedCopy, tmp_path: Path
) -> None:
    """Two "nodes" (two cache dirs, two processes each) read all shards at the same time:
    each shard crosses the network exactly once per node."""
    remote = http_copy.remote
    go = tmp_path / "go"
    group = [
        readers.start(f"node{node}-p{i}", remote.url, tmp_path / f"cache{node}", go=go)
        for node in range(2)
        for i in range(2)
    ]
    readers.release(group, go)
    for reader in group:
        check_samples(reader.result().samples, remote.local.samples, reader.name)

    gets = gets_by_path(http_copy.record.logged())
    local = remote.local
    assert set(gets) == {url_path(u) for u in remote.shard_urls()}, sorted(gets)
    for url, name in zip(remote.shard_urls(), local.shards, strict=True):
        sent = gets.get(url_path(url), [])
        size = (local.root / name).stat().st_size
        assert sum(sent) == 2 * size, (
            f"{name}: nginx served {sum(sent)} bytes in {len(sent)} GETs = "
            f"{sum(sent) / size:.2f} x the object's size, for two nodes"
        )
        for node in range(2):
            assert_cache_holds(tmp_path / f"cache{node}", url, local.root / name)


# ------------------------------------------------------------------------------ crash safety


@dataclass(frozen=True)
class BigShard:
    """One shard large enough that a slow reader is still mid-download when killed."""

    url: str
    path: Path
    keys: list[str]
    samples: dict[str, Sample]


@pytest.fixture(scope="module")
def big_shard(http_server: NginxServer, tmp_path_factory: pytest.TempPathFactory) -> BigShard:
    """A 3.8 MB shard of 400 samples served by nginx (under ``cache-crash/``)."""
    from conftest import make_dataset

    local = make_dataset(tmp_path_factory.mktemp("big"), sizes=(400, 2, 40), seed=7)
    target = http_server.root / "cache-crash"
    target.mkdir(parents=True, exist_ok=True)
    path = target / "big-000000.tar"
    shutil.copyfile(local.root / local.shards[0], path)
    keys = local.shard_keys[0]
    return BigShard(
        http_server.url_for("cache-crash/big-000000.tar"),
        path,
        keys,
        {k: local.samples[k] for k in keys},
    )


CRASH_BLOCK_BYTES = 16 << 10  # small reads: a slow consumer keeps the download slow
PAUSE_AFTER = 10  # samples the doomed downloader reads before it stalls


def start_stalled_downloader(
    readers: ReaderPool, url: str, cache_dir: Path, total_size: int
) -> Reader:
    """A reader that downloads ``url`` through the cache and stalls mid-shard holding the lock.

    Its download (in a background thread) keeps one 64 KiB part ahead of it while it reads,
    and holds on while it pauses (``CLOUDSHARDS_CACHE_IDLE_MS``: by default it would finish
    the shard 0.5 s into the pause)."""
    slow = {
        "CLOUDSHARDS_CACHE_IDLE_MS": "600000",
        "CLOUDSHARDS_PART_BYTES": str(64 << 10),
        "CLOUDSHARDS_CONCURRENCY": "1",
    }
    saved = {name: os.environ.get(name) for name in slow}
    os.environ.update(slow)
    try:
        downloader = readers.start(
            "downloader",
            url,
            cache_dir,
            workers=0,
            block_bytes=CRASH_BLOCK_BYTES,
            pause_after=PAUSE_AFTER,
        )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    downloader.wait_for_file("paused")
    partials = [p for p in (cache_dir / "data").iterdir() if p.name.endswith(".partial")]
    assert len(partials) == 1, f"expected one download in flight: {partials}"
    written = partials[0].stat().st_size
    assert 0 < written < total_size, f"not mid-download: {written} of {total_size} bytes"
    return downloader


@pytest.mark.timeout(180)
def test_killed_downloader_next_run_completes(
    readers: ReaderPool, big_shard: BigShard, tmp_path: Path
) -> None:
    """SIGKILL the downloading process mid-shard: nothing looks complete afterwards, the next
    run reads every sample intact and leaves a complete, correct entry."""
    cache_dir = tmp_path / "cache"
    size = big_shard.path.stat().st_size
    downloader = start_stalled_downloader(readers, big_shard.url, cache_dir, size)
    downloader.kill()
    assert downloader.popen.returncode == -signal.SIGKILL

    assert complete_entries(cache_dir) == {}, "a killed download must not look complete"
    info = cache_info(cache_dir)
    assert info["entries"] == 0, info

    rerun = readers.start("rerun", big_shard.url, cache_dir, workers=0)
    check_samples(rerun.result().samples, big_shard.samples, "rerun")
    assert_cache_holds(cache_dir, big_shard.url, big_shard.path)

    # And the entry is then served from disk, intact.
    again = readers.start("hit", big_shard.url, cache_dir, workers=0)
    result = again.result()
    check_samples(result.samples, big_shard.samples, "hit")
    assert result.stats["hits"] == 1, result.stats


@pytest.mark.timeout(180)
def test_follower_takes_over_killed_download(
    readers: ReaderPool, big_shard: BigShard, tmp_path: Path
) -> None:
    """A process following another's download (reading the growing file) finishes the shard
    itself when the downloader is SIGKILLed; the URL's signing secrets stay out of its logs."""
    cache_dir = tmp_path / "cache"
    size = big_shard.path.stat().st_size
    url = f"{big_shard.url}?X-Amz-Signature={SECRETS[0]}&token={SECRETS[1]}"
    downloader = start_stalled_downloader(readers, url, cache_dir, size)
    follower = readers.start("follower", url, cache_dir, workers=0, log_debug=True)
    follower.wait_for_file("started")  # it is reading the partial file the downloader writes
    downloader.kill()

    result = follower.result()
    check_samples(result.samples, big_shard.samples, "follower")
    assert result.stats["waits"] == 1, f"the follower did not follow: {result.stats}"
    assert_cache_holds(cache_dir, url, big_shard.path)
    for secret in SECRETS[:2]:
        leaked = [line for line in result.stderr.splitlines() if secret in line]
        assert not leaked, f"signing secret in the follower's log: {leaked}"


# ------------------------------------------------------------------------------ budget


def _read_all(stream: Any) -> bytes:
    chunks = []
    while chunk := stream.read(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@FORK_WARNING
@pytest.mark.timeout(120)
def test_budget_smaller_than_dataset(http_dataset: RemoteDataset, tmp_path: Path) -> None:
    """With a budget of ~60% of the dataset, two epochs over a 2-worker DataLoader: data/
    (entries + downloads in flight) never exceeds the budget, an entry held open by another
    reader is never evicted, entries are evicted, every sample is intact."""
    local = http_dataset.local
    sizes = {name: (local.root / name).stat().st_size for name in local.shards}
    budget = 400_000
    assert max(sizes.values()) * 2 < budget < sum(sizes.values()), sizes
    cache_dir = tmp_path / "cache"
    urls = http_dataset.shard_urls()

    # Hold shard 3 open (a cache hit holds a shared lock on its entry) during the epochs.
    held_index = 3
    held_url, held_name = urls[held_index], local.shards[held_index]
    first = wds.WebDataset([held_url], cache_dir=str(cache_dir), cache_size=budget)
    assert len(list(first)) == len(local.shard_keys[held_index])
    held_entry = cache_dir / "data" / entry_name(held_url)
    assert held_entry.is_file(), "the shard to hold was not cached"
    cache = ShardCache(cache_dir, max_bytes=budget)
    held = cache.open(held_url)
    assert cache.stats.hits == 1, cache.stats

    peak = 0
    held_missing = 0
    stop = threading.Event()

    def usage() -> int:
        seen: dict[int, int] = {}  # by inode: a file renamed mid-scan is counted once
        with os.scandir(cache_dir / "data") as it:
            for item in it:
                with contextlib.suppress(FileNotFoundError):
                    st = item.stat()
                    seen[st.st_ino] = st.st_size
        return sum(seen.values())

    def observe() -> None:
        nonlocal peak, held_missing
        peak = max(peak, usage())
        if not held_entry.exists():
            held_missing += 1

    def sampler() -> None:
        while not stop.is_set():
            observe()
            time.sleep(0.001)

    dataset = wds.WebDataset(
        http_dataset.url, shardshuffle=False, cache_dir=str(cache_dir), cache_size=budget
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=NUM_WORKERS)
    thread = threading.Thread(target=sampler, daemon=True)
    samples: list[tuple[int, str, str, Sample]] = []
    try:
        for epoch in range(2):
            it = iter(loader)  # forks the workers (the first time, before the sampler starts)
            if not thread.is_alive():
                thread.start()
            for sample in it:
                fields = {k: v for k, v in sample.items() if not k.startswith("__")}
                samples.append((epoch, sample["__key__"], sample["__url__"], fields))
                observe()
    finally:
        stop.set()
        thread.join(timeout=10)
    try:
        assert _read_all(held) == (local.root / held_name).read_bytes()
    finally:
        held.close()
    observe()

    check_samples(samples, local.samples, "budgeted loader")
    assert peak <= budget, f"data/ reached {peak} bytes, budget {budget}"
    assert held_missing == 0, "an entry in use was evicted"
    counters = cache_info(cache_dir)["counters"]
    assert counters.get("evictions", 0) > 0, f"nothing was evicted: {counters}"
    assert len(complete_entries(cache_dir)) < len(local.shards)


@pytest.mark.timeout(60)
def test_direct_open_under_budget_caches_http(
    http_dataset: RemoteDataset, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``ShardCache.open`` without a prefetched stream (the public API, and the path a follower
    takes over a dead download by) caches an http shard under a budget, length verified."""
    local = http_dataset.local
    url, name = http_dataset.shard_urls()[0], local.shards[0]
    cache_dir = tmp_path / "cache"
    cache = ShardCache(cache_dir, max_bytes=10 * (local.root / name).stat().st_size)
    stream = cache.open(url)
    try:
        assert _read_all(stream) == (local.root / name).read_bytes()
    finally:
        stream.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert cache.stats.misses == 1, f"not cached: {cache.stats}; warnings: {warnings}"
    assert_cache_holds(cache_dir, url, local.root / name)


# ------------------------------------------------------------------------------ hostile URLs


@dataclass(frozen=True)
class HostileCase:
    """A URL nginx serves: ``path`` is where the file lies under the server root, ``logged``
    the request path nginx logs for it, ``shard`` the dataset shard it is a copy of."""

    url: str
    path: str
    logged: str
    shard: int


@dataclass
class HostileSite:
    base: str
    cases: list[HostileCase] = field(default_factory=list)


@pytest.fixture(scope="module")
def hostile_site(http_server: NginxServer, dataset: LocalDataset) -> HostileSite:
    """Shard copies under ``cache-hostile/`` reachable by URLs that try to break out of a
    naive cache directory. nginx decodes ``%2F`` and resolves ``..`` itself, so each URL's
    last segment still reads ``..%2F..``, ``%2Fetc%2Fpasswd`` or ``..%5C`` to the cache."""
    root = http_server.root / "cache-hostile"
    base = http_server.url_for("cache-hostile")
    hostport = urlsplit(base).netloc
    signed = f"?X-Amz-Signature={SECRETS[0]}&token={SECRETS[1]}"
    long_name = "L" * 240 + ".tar"
    raw = [
        # unquoted by a naive cache: "../../cache-hostile/dotdot.tar"
        ("sub/..%2F..%2Fcache-hostile%2Fdotdot.tar", "dotdot.tar", 0),
        # unquoted: "/etc/passwd.tar", an absolute path that os.path.join would follow
        ("%2Fetc%2Fpasswd.tar", "etc/passwd.tar", 1),
        # a literal file "..\..\win.tar" (Windows separators)
        ("sub/..%5C..%5Cwin.tar", "sub/..\\..\\win.tar", 2),
        # dot segments: the HTTP client resolves them before sending; the cache sees them
        ("%2E%2E/%2E%2E/cache-hostile/dots.tar", "dots.tar", 3),
        # a 244-character name and a 3000-character query string
        (f"{long_name}?pad={'p' * 3000}", long_name, 4),
        # signing parameters in the query string
        (f"signed.tar{signed}", "signed.tar", 5),
    ]
    site = HostileSite(base)
    for relative, path, shard in raw:
        logged = "/cache-hostile/" + (path if "%2E" in relative else relative.split("?")[0])
        site.cases.append(HostileCase(f"{base}/{relative}", path, logged, shard))
    # credentials in the user info
    userinfo = f"http://user:{SECRETS[2]}@{hostport}/cache-hostile/userinfo.tar"
    site.cases.append(HostileCase(userinfo, "userinfo.tar", "/cache-hostile/userinfo.tar", 0))
    for case in site.cases:
        target = root / case.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(dataset.root / dataset.shards[case.shard], target)
    return site


def tree(root: Path, *excludes: Path) -> set[str]:
    """Every path under ``root``, not descending into ``excludes``."""
    found: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath) / d not in excludes]
        found.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return found


def check_hostile_cache(cache_dir: Path, cases: Sequence[HostileCase]) -> None:
    """All files are plain files inside the cache dir; no name or metadata holds a secret."""
    real_root = os.path.realpath(cache_dir)
    files = cache_files(cache_dir)
    entries = [f for f in files if f.parent.name == "data"]
    assert len(entries) == len(cases), f"one entry per URL expected: {entries}"
    for path in files:
        assert not path.is_symlink(), path
        real = os.path.realpath(path)
        assert os.path.commonpath([real_root, real]) == real_root, f"outside the cache: {real}"
        assert len(path.name) <= 255, path.name
        for secret in SECRETS:
            assert secret not in str(path), f"secret in a file name: {path}"
            if path.parent.name != "data":  # meta, locks, stats: never the URL's secrets
                assert secret.encode() not in path.read_bytes(), f"secret in {path}"


@pytest.mark.timeout(180)
def test_hostile_urls_stay_inside_and_keep_secrets(
    readers: ReaderPool,
    hostile_site: HostileSite,
    http_server: NginxServer,
    dataset: LocalDataset,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    cloudsim_process: Callable[..., CloudSimProcess],
) -> None:
    """Path tricks, long names and secrets in URLs: entries stay inside the cache dir, no file
    name, metadata file or cloudshards log record (in process at DEBUG, and a subprocess's
    stderr) shows a secret, every sample is intact, and a re-signed URL is a cache hit.
    (Read through a simulator, for a complete record of nginx's log: see ServerRecord.)"""
    caplog.set_level(logging.DEBUG)
    sim = cloudsim_process(http_server.base_url)  # before ``before``: it logs in tmp_path
    sandbox = tmp_path / "sandbox"
    cache_dir = sandbox / "a" / "b" / "cache"
    cache_dir.mkdir(parents=True)
    sub_cache = sandbox / "a" / "b" / "cache2"
    before = tree(tmp_path, cache_dir, readers.root)
    www_before = tree(http_server.root)
    cases = hostile_site.cases
    record = nginx_record(http_server, sim, "/cache-hostile/")
    nginx_at, sim_at = urlsplit(http_server.base_url).netloc, urlsplit(sim.url).netloc
    urls = [case.url.replace(nginx_at, sim_at, 1) for case in cases]

    def expected_by_url(samples: Sequence[tuple[int, str, str, Sample]]) -> None:
        for case, case_url in zip(cases, urls, strict=True):
            got = [(key, fields) for _, key, url, fields in samples if url == case_url]
            want = [(key, dataset.samples[key]) for key in dataset.shard_keys[case.shard]]
            assert got == want, f"wrong samples for {case_url[:100]}"

    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir))
    in_process = [(0, s["__key__"], s["__url__"], _fields(s)) for s in ds]
    expected_by_url(in_process)
    # Each URL's bytes crossed the network exactly once (in one or several ranged GETs).
    fetched = {path: sum(sent) for path, sent in gets_by_path(record.logged()).items()}
    root = http_server.root / "cache-hostile"
    expected = {case.logged: (root / case.path).stat().st_size for case in cases}
    assert fetched == expected, f"body bytes per path: {fetched}"

    # Re-signed (and re-credentialed) URLs name the same entries: no new GET.
    record.mark()
    resigned = [url.replace(SECRETS[0], SECRETS[3]).replace(SECRETS[2], SECRETS[3]) for url in urls]
    assert list(wds.WebDataset(resigned, shardshuffle=False, cache_dir=str(cache_dir)))
    assert gets_by_path(record.since_mark()) == {}, "a re-signed URL missed the cache"

    # A separate process with cloudshards logging at DEBUG on stderr, in a fresh cache.
    reader = readers.start("hostile", urls, sub_cache, workers=0, log_debug=True)
    result = reader.result()
    expected_by_url(result.samples)
    assert "LOG cloudshards" in result.stderr, "the subprocess logged nothing at DEBUG"

    for directory in (cache_dir, sub_cache):
        check_hostile_cache(directory, cases)
    new = sorted(tree(tmp_path, cache_dir, readers.root, sub_cache) - before)
    assert new == [], f"files created outside the cache dirs: {new}"
    assert tree(http_server.root) == www_before
    assert not Path("/etc/passwd.tar").exists()

    records = [r for r in caplog.records if r.name.startswith("cloudshards")]
    assert records, "cloudshards logged nothing at DEBUG"
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        if record.name.startswith("cloudshards"):
            for secret in SECRETS:
                assert secret not in text, f"secret in a log record: {record.name}: {text}"
    for line in result.stderr.splitlines():
        for secret in SECRETS:
            assert secret not in line, f"secret in the subprocess's stderr: {line}"


def _fields(sample: dict[str, Any]) -> Sample:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


# ------------------------------------------------------------------------------ GCS


class _CountingProxy(http.server.ThreadingHTTPServer):
    """An HTTP reverse proxy that records (method, path) of every request it forwards.

    fake-gcs-server keeps no request log (the fixture runs it at ``-log-level warn``), so the
    GCS test points gcsfs at this proxy: every request gcsfs makes (it builds every URL from
    ``endpoint_url``, downloads included) passes here and is counted on the server side of
    the client, retries included.
    """

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, method: str, path: str) -> None:
        with self.lock:
            self.requests.append((method, path))

    def take(self) -> list[tuple[str, str]]:
        with self.lock:
            taken, self.requests = self.requests, []
        return taken


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: _CountingProxy
    _HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host"})

    def _forward(self) -> None:
        self.server.record(self.command, self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in self._HOP}
        upstream = http.client.HTTPConnection(
            self.server.upstream_host, self.server.upstream_port, timeout=60
        )
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in self._HOP and key.lower() not in ("date", "server"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def gcs_proxy(gcs_server: GCSServer) -> Iterator[_CountingProxy]:
    proxy = _CountingProxy(gcs_server.endpoint_url)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


@pytest.mark.timeout(120)
def test_gcs_second_epoch_from_cache(
    gcs_dataset: RemoteDataset, gcs_proxy: _CountingProxy, tmp_path: Path
) -> None:
    """gs:// through fake-gcs-server with the cache: the first epoch fetches every object,
    the second makes no request at all, and both read every sample intact."""
    local = gcs_dataset.local
    assert gcs_dataset.storage_options is not None
    options = {"gs": {**gcs_dataset.storage_options["gs"], "endpoint_url": gcs_proxy.url}}
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(
        gcs_dataset.url, shardshuffle=False, cache_dir=str(cache_dir), storage_options=options
    )
    gcs_proxy.take()
    for epoch in range(2):
        samples = [(epoch, s["__key__"], s["__url__"], _fields(s)) for s in ds]
        check_samples(samples, local.samples, f"gs epoch {epoch}")
        requests = gcs_proxy.take()
        media = Counter(
            gcs_download_name(path)
            for method, path in requests
            if method == "GET" and gcs_download_name(path)
        )
        if epoch == 0:
            assert set(media) == set(local.shards), f"first epoch object GETs: {dict(media)}"
        else:
            assert media == Counter(), f"second epoch made object GETs: {dict(media)}"
            assert requests == [], f"second epoch made requests: {requests}"
    for url, name in zip(gcs_dataset.shard_urls(), local.shards, strict=True):
        assert_cache_holds(cache_dir, url, local.root / name, gcs_proxy.url)
