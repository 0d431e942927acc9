"""Indexed mode against real servers: moto S3 and nginx.

Each test gets its own copy of the synthetic dataset (conftest ``dataset``) under a unique
prefix, indexed by ``build_index`` over the server and saved next to the shards, and reads it
through the cloud simulator (``cloudsim.py``, no faults) in front of the server. The servers'
own request records (nginx's access log with Range headers and body sizes, moto's werkzeug
request log) show how many requests each read made: one ranged GET per sample without a
cache, one download per shard with one. The simulator's counters say when those records are
complete (see ``Copy.logged``).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from cloudsim_fixtures import cloudsim_process_factory  # noqa: F401
from torch.utils.data import DataLoader

import cloudshards as wds
from cloudshards.errors import ShardOpenError
from cloudshards.indexed import DatasetIndex, IndexedDataset, build_index, load_index

if TYPE_CHECKING:
    from cloudsim import CloudSimProcess
    from conftest import LocalDataset
    from servers import NginxServer, S3Server

# Python >= 3.12 warns when forking a process that has threads (fsspec's IO loop, the
# dataset's reading threads); the DataLoader forks on purpose. Not a cloudshards warning.
FORK_WARNING = pytest.mark.filterwarnings(
    r"ignore:This process \(pid=\d+\) is multi-threaded, use of fork\(\):DeprecationWarning"
)
INDEX_BUCKET = "cloudshards-it-indexed"
# How long a server may take to log the requests the simulator has already forwarded to it.
LOG_TIMEOUT_S = 30.0
Sample = dict[str, Any]


@dataclass(frozen=True)
class Request:
    """One request a server logged: method, path (no query), status; nginx adds the Range
    header and the body bytes sent (moto logs neither: None)."""

    method: str
    path: str
    status: int
    range: str | None = None
    sent: int | None = None


@dataclass
class Copy:
    """A private copy of the dataset on one server, with its index saved next to it, reached
    through a cloud simulator (every URL and endpoint below points at the simulator)."""

    protocol: str
    shard_urls: list[str]
    index_url: str
    storage_options: dict[str, Any] | None
    local: LocalDataset
    sim: CloudSimProcess
    prefix: str  # the request path of every object of this copy starts with it
    server_log: Callable[[], list[Request]]  # this copy's requests the server logged so far
    remove: Callable[[str], None]  # deletes a shard from the server
    marked: int = 0  # requests for this copy before the last mark()

    def object_path(self, url: str) -> str:
        """The request path of a shard URL as the server logs it."""
        rest = url.split("://", 1)[1]
        return rest[rest.index("/") :] if self.protocol == "http" else f"/{rest}"

    def forwarded(self) -> int:
        """How many requests for this copy's objects the simulator has forwarded."""
        by_path = self.sim.stats().by_path
        return sum(n for path, n in by_path.items() if path.startswith(self.prefix))

    def logged(self) -> list[Request]:
        """Every request for this copy's objects, as the server logged it, once the log holds
        all of the requests the simulator has forwarded.

        Why this is race-free, where waiting for the log to go quiet was not: the simulator
        counts a request before it forwards it, so before the client can have any answer to
        it. Callers ask only once every thread and worker process that read has finished
        (``with`` blocks closed, DataLoader iterations exhausted), so every request the client
        waited for is already in ``forwarded()``: an extra request cannot come after it.
        The server logs each request it answers, when it likes (nginx as a response ends, in
        one of two worker processes; moto from the request's thread), so its log may lag that
        count but never stay below it: wait until it has caught up, however slowly, and fail
        (never pass) if it has not within LOG_TIMEOUT_S. More entries than forwarded requests
        means a request bypassed the simulator: also a failure. The prefix is unique to this
        copy, so no other test's request, however late it is logged, is counted.
        """
        expected = self.forwarded()
        deadline = time.monotonic() + LOG_TIMEOUT_S
        while len(entries := self.server_log()) < expected:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the {self.protocol} server logged {len(entries)} of the {expected} "
                    f"requests the simulator forwarded, in {LOG_TIMEOUT_S:.0f} s: {entries}"
                )
            time.sleep(0.01)
        assert len(entries) == expected, (
            f"the {self.protocol} server logged {len(entries)} requests under {self.prefix}, "
            f"the simulator forwarded {expected}: some bypassed it? {entries}"
        )
        return entries

    def mark(self) -> None:
        """Start counting requests here (the earlier ones all logged first)."""
        self.marked = len(self.logged())

    def requests(self) -> list[Request]:
        """The requests for this copy since the last mark(), in the server's log order."""
        return self.logged()[self.marked :]


_WERKZEUG_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _moto_requests(log: Path, offset: int, prefix: str) -> list[Request]:
    with log.open("rb") as f:
        f.seek(offset)
        text = _ANSI_ESCAPE.sub("", f.read().decode(errors="replace"))
    found = (
        Request(m.group(1), m.group(2).split("?", 1)[0], int(m.group(3)))
        for m in _WERKZEUG_LINE.finditer(text)
    )
    return [r for r in found if r.path.startswith(prefix)]


def _s3_copy(server: S3Server, sim: CloudSimProcess, local: LocalDataset) -> Copy:
    import s3fs

    # Every request for the copy's objects goes through the simulator, the upload included:
    # the server's log then holds exactly the requests the simulator counts.
    log = server.process.log_path
    offset = log.stat().st_size
    options = {"s3": {**server.storage_options(), "endpoint_url": sim.url}}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options["s3"])
    prefix = f"{INDEX_BUCKET}/{uuid.uuid4().hex[:8]}"
    if not fs.exists(INDEX_BUCKET):
        fs.mkdir(INDEX_BUCKET)
    fs.put([str(local.root / n) for n in local.shards], [f"{prefix}/{n}" for n in local.shards])
    urls = [f"s3://{prefix}/{n}" for n in local.shards]

    def server_log() -> list[Request]:
        return _moto_requests(log, offset, f"/{prefix}/")

    index_url = f"s3://{prefix}/train.index.json"
    wds.write_index(build_index(urls, options), index_url, options)

    def remove(url: str) -> None:
        fs.rm(url.removeprefix("s3://"))

    return Copy("s3", urls, index_url, options, local, sim, f"/{prefix}/", server_log, remove)


def _http_copy(server: NginxServer, sim: CloudSimProcess, local: LocalDataset) -> Copy:
    name = f"indexed-{uuid.uuid4().hex[:8]}"
    root = server.root / name
    root.mkdir()
    for shard in local.shards:
        shutil.copyfile(local.root / shard, root / shard)
    log = server.access_log_path
    offset = log.stat().st_size if log.exists() else 0
    urls = [f"{sim.url}/{name}/{n}" for n in local.shards]
    index_url = f"{sim.url}/{name}/train.index.json"
    # nginx serves files read-only: save the index into its directory, as it would be at
    # that URL (shard URLs relative to it).
    index = build_index(urls)
    (root / "train.index.json").write_text(json.dumps(index.to_json(index_url)))

    def server_log() -> list[Request]:
        return _nginx_requests(log, offset, f"/{name}/")

    def remove(url: str) -> None:
        (root / url.rsplit("/", 1)[-1]).unlink()

    return Copy("http", urls, index_url, None, local, sim, f"/{name}/", server_log, remove)


def _nginx_requests(log: Path, offset: int, prefix: str) -> list[Request]:
    """Requests in nginx's access log (the NginxServer format: status, request line, Range,
    body bytes, tab-separated) after ``offset``, for paths under ``prefix``."""
    with log.open("rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    found = []
    for line in lines:
        status, request_line, range_header, sent = [*line.split("\t"), "", "", ""][:4]
        method, path = [*request_line.split(" "), ""][:2]
        if path.startswith(prefix):
            found.append(
                Request(
                    method,
                    path.split("?", 1)[0],
                    int(status or 0),
                    "" if range_header == "-" else range_header,
                    int(sent or 0),
                )
            )
    return found


@pytest.fixture(params=["http", "s3"])
def copy(
    request: pytest.FixtureRequest,
    dataset: LocalDataset,
    cloudsim_process: Callable[..., CloudSimProcess],
) -> Copy:
    """A fresh indexed copy of the dataset on nginx, then on moto S3, behind a simulator of
    its own (a subprocess: no GIL shared with the reads, nothing to fork in the test)."""
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        return _s3_copy(server, cloudsim_process(server.endpoint_url), dataset)
    server = request.getfixturevalue("http_server")
    return _http_copy(server, cloudsim_process(server.base_url), dataset)


def streamed(copy: Copy) -> list[Sample]:
    """The oracle: the streaming reader over the same URLs."""
    with wds.WebDataset(
        copy.shard_urls, shardshuffle=False, storage_options=copy.storage_options
    ) as ds:
        return list(ds)


def sample_range(index: DatasetIndex, i: int) -> tuple[str, int, int]:
    shard, within = index.locate(i)
    entry = index.shards[shard].sample(within)
    return index.shards[shard].url, entry.start, entry.end


def test_index_over_the_store_matches_the_local_index(copy: Copy) -> None:
    remote = load_index(copy.index_url, copy.storage_options)
    local = build_index([str(copy.local.root / n) for n in copy.local.shards])
    assert [s.url for s in remote.shards] == copy.shard_urls  # resolved against the index URL
    assert [s.num_samples for s in remote.shards] == [len(k) for k in copy.local.shard_keys]
    for a, b in zip(remote.shards, local.shards, strict=True):
        assert list(a.samples()) == list(b.samples())
        assert a.size == b.size
    if copy.protocol == "s3":
        assert all(s.etag for s in remote.shards)  # moto gives ETags and LastModified
        assert all(s.mtime for s in remote.shards)


def test_random_access_one_request_per_sample(copy: Copy) -> None:
    expected = streamed(copy)
    with IndexedDataset(copy.index_url, storage_options=copy.storage_options) as ds:
        assert len(ds) == len(expected) == sum(len(k) for k in copy.local.shard_keys)
        order = list(range(len(ds)))
        random.Random(7).shuffle(order)
        order = order[:40]
        copy.mark()
        for i in order:
            assert ds[i] == expected[i], f"sample {i}"
        assert ds.stats()["indexed"]["ranged_gets"] == len(order)
    logged = copy.requests()
    assert len(logged) == len(order), f"{len(logged)} requests for {len(order)} samples"
    # As a multiset: nginx's two workers may log two requests in either order.
    expected_requests: Counter[Request] = Counter()
    for i in order:
        url, start, end = sample_range(ds.index, i)
        if copy.protocol == "http":
            expected_requests[
                Request("GET", copy.object_path(url), 206, f"bytes={start}-{end - 1}", end - start)
            ] += 1
        else:
            expected_requests[Request("GET", copy.object_path(url), 206)] += 1
    assert Counter(logged) == expected_requests


def test_concurrent_reads_one_request_per_sample(copy: Copy) -> None:
    expected = streamed(copy)
    with IndexedDataset(copy.index_url, storage_options=copy.storage_options, max_workers=16) as ds:
        order = [i % len(ds) for i in range(0, 3 * len(ds), 5)]
        copy.mark()
        assert ds.get_many(order) == [expected[i] for i in order]
    logged = copy.requests()
    assert len(logged) == len(order)
    assert Counter(r.method for r in logged) == {"GET": len(order)}
    assert {r.status for r in logged} == {206}


@FORK_WARNING
@pytest.mark.timeout(240)
def test_cache_downloads_each_shard_once_then_serves_from_disk(copy: Copy, tmp_path: Path) -> None:
    expected = streamed(copy)
    ds = IndexedDataset(
        copy.index_url, storage_options=copy.storage_options, cache_dir=tmp_path / "cache"
    )
    sampler = wds.DistributedChunkedSampler(ds, num_replicas=1, rank=0, seed=11)
    loader = DataLoader(
        ds, batch_size=6, sampler=sampler, num_workers=2, collate_fn=list,
        multiprocessing_context="fork",
    )  # fmt: skip
    copy.mark()
    got = [sample for batch in loader for sample in batch]
    assert sorted(got, key=lambda s: s["__key__"]) == sorted(expected, key=lambda s: s["__key__"])
    logged = copy.requests()
    sizes = {copy.object_path(u): (copy.local.root / n).stat().st_size
             for u, n in zip(copy.shard_urls, copy.local.shards, strict=True)}  # fmt: skip
    heads = Counter(r.path for r in logged if r.method == "HEAD")
    gets = Counter(r.path for r in logged if r.method == "GET")
    assert heads == dict.fromkeys(sizes, 1), "one size check per shard download"
    assert set(gets) == set(sizes)
    assert sum(gets.values()) < len(expected), "whole shards, not one GET per sample"
    if copy.protocol == "http":
        sent: Counter[str] = Counter()
        for r in logged:
            if r.method == "GET":
                sent[r.path] += r.sent or 0
        assert sent == sizes, "each shard's bytes crossed the network exactly once"

    copy.mark()
    sampler.set_epoch(1)
    again = [sample for batch in loader for sample in batch]
    assert again != got
    assert sorted(again, key=lambda s: s["__key__"]) == sorted(got, key=lambda s: s["__key__"])
    assert copy.requests() == [], "the second epoch is served from the cache"
    ds.close()


def test_missing_shard_names_url_and_member(copy: Copy) -> None:
    url = copy.shard_urls[3]
    with IndexedDataset(copy.index_url, storage_options=copy.storage_options) as ds:
        copy.remove(url)
        first = ds.shard_ranges()[3][0]
        with pytest.raises(ShardOpenError, match="not found") as info:
            ds[first]
        assert info.value.url == url
        assert info.value.shard_index == 3
        assert info.value.member == f"{copy.local.shard_keys[3][0]}.bin"
        assert ds[first - 1]["__key__"] == copy.local.shard_keys[2][-1]
