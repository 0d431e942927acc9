"""The cloud simulator itself (integration/cloudsim.py): byte-identical passthrough in front of
nginx, moto (SigV4 signatures still valid) and fake-gcs-server, and each knob doing what it says.

Timing checks are lower bounds only: the machine is noisy, a delay can only make things slower.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from cloudsim import CONTROL_PREFIX, CloudSim, CloudSimProcess
from cloudsim_fixtures import cloudsim_factory, cloudsim_process_factory, via  # noqa: F401

if TYPE_CHECKING:
    from conftest import RemoteDataset
    from servers import GCSServer, NginxServer, S3Server

Factory = Callable[..., CloudSim]
BLOB_SIZE = 1 << 20
BLOB = random.Random(7).randbytes(BLOB_SIZE)
SMALL = BLOB[: 1 << 19]  # gcsfs uploads bytes in one aiohttp body: over 1 MiB it warns
BLOB_NAME = "cloudsim/blob.bin"
BUCKET = "cloudsim-test"
RETRY_BUCKET = "cloudsim-retry"
KEY = "dir with space/blob ü+%.bin"  # characters SigV4 and GCS paths must not re-quote
# The slack allowed on a sleep that the event loop may end a clock tick early.
EARLY = 0.98


@dataclass
class Answer:
    """One HTTP exchange as the client saw it."""

    status: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: BaseException | None = None
    elapsed_s: float = 0.0


async def _fetch(
    session: aiohttp.ClientSession, method: str, url: str, headers: Mapping[str, str]
) -> Answer:
    answer = Answer()
    start = time.monotonic()
    try:
        async with session.request(method, url, headers=headers) as response:
            answer.status, answer.headers = response.status, dict(response.headers)
            async for chunk in response.content.iter_chunked(1 << 16):
                answer.body += chunk
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        answer.error = exc
    answer.elapsed_s = time.monotonic() - start
    return answer


def fetch(
    url: str,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    repeat: int = 1,
    parallel: bool = False,
    read_timeout_s: float = 30.0,
) -> list[Answer]:
    """Make ``repeat`` requests (one after another, or all at once) with a fresh aiohttp client;
    errors are returned in ``Answer.error``, not raised."""

    async def run() -> list[Answer]:
        timeout = aiohttp.ClientTimeout(total=60, sock_read=read_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            calls = [_fetch(session, method, url, headers or {}) for _ in range(repeat)]
            if parallel:
                return list(await asyncio.gather(*calls))
            return [await call for call in calls]

    return asyncio.run(run())


def fetch_one(url: str, method: str = "GET", **kwargs: Any) -> Answer:
    return fetch(url, method, **kwargs)[0]


@pytest.fixture(scope="module")
def blob_url(http_server: NginxServer) -> str:
    """A 1 MiB random file on nginx."""
    path = http_server.root / BLOB_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(BLOB)
    return http_server.url_for(BLOB_NAME)


@pytest.fixture
def sim(cloudsim: Factory, http_server: NginxServer, blob_url: str) -> CloudSim:
    """A simulator in front of nginx, no knobs set."""
    return cloudsim(http_server.base_url)


def through(sim: CloudSim | CloudSimProcess, url: str) -> str:
    """``url`` on nginx, reached through the simulator."""
    return sim.url + "/" + url.split("/", 3)[3]


# ---------------------------------------------------------------------------- passthrough

COMPARED_HEADERS = ("Content-Length", "Content-Range", "ETag", "Last-Modified", "Accept-Ranges")


@pytest.mark.parametrize(
    ("method", "range_", "status"),
    [
        ("GET", None, 200),
        ("GET", "bytes=100-199", 206),
        ("GET", "bytes=-1000", 206),
        ("GET", f"bytes={BLOB_SIZE - 10}-", 206),
        ("HEAD", None, 200),
    ],
)
def test_http_passthrough_is_identical(
    sim: CloudSim, blob_url: str, method: str, range_: str | None, status: int
) -> None:
    headers = {"Range": range_} if range_ else {}
    direct = fetch_one(blob_url, method, headers=headers)
    proxied = fetch_one(through(sim, blob_url) + "?query=kept", method, headers=headers)
    assert direct.error is None
    assert proxied.error is None
    assert proxied.status == direct.status == status
    assert proxied.body == direct.body
    for name in COMPARED_HEADERS:
        assert proxied.headers.get(name) == direct.headers.get(name), name
    if method == "HEAD":
        assert proxied.headers["Content-Length"] == str(BLOB_SIZE)
    elif range_ == "bytes=100-199":
        assert proxied.body == BLOB[100:200]
        assert proxied.headers["Content-Range"] == f"bytes 100-199/{BLOB_SIZE}"
    assert sim.stats().by_status == {str(status): 1}


def test_s3_through_proxy_keeps_signatures_valid(cloudsim: Factory, s3_server: S3Server) -> None:
    """s3fs signs for the proxy's host; PUT, LIST, HEAD, GET and ranged GET all validate."""
    import s3fs

    sim = cloudsim(s3_server.endpoint_url)
    options = {**s3_server.storage_options(), "endpoint_url": sim.url}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    fs.mkdir(BUCKET)
    path = f"{BUCKET}/{KEY}"
    fs.pipe(path, BLOB)
    assert fs.find(BUCKET) == [path]
    assert fs.info(path)["size"] == BLOB_SIZE
    assert fs.cat_file(path) == BLOB
    assert fs.cat_file(path, start=1000, end=5000) == BLOB[1000:5000]
    assert s3_server.filesystem().cat_file(path) == BLOB  # what went up is what is there
    stats = sim.stats()
    assert stats.by_method.get("PUT", 0) >= 2  # bucket + object
    assert "403" not in stats.by_status
    assert stats.by_status.get("206") == 1
    assert stats.bytes_sent >= BLOB_SIZE + 4000


def test_gcs_through_proxy(cloudsim: Factory, gcs_server: GCSServer) -> None:
    import gcsfs

    sim = cloudsim(gcs_server.endpoint_url)
    options = {**gcs_server.storage_options(), "endpoint_url": sim.url}
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
    fs.mkdir(BUCKET)
    path = f"{BUCKET}/{KEY}"
    fs.pipe(path, SMALL)
    assert fs.info(path)["size"] == len(SMALL)
    assert fs.cat_file(path) == SMALL
    assert fs.cat_file(path, start=1000, end=5000) == SMALL[1000:5000]
    assert gcs_server.filesystem().cat_file(path) == SMALL
    stats = sim.stats()
    assert stats.by_method.get("POST", 0) >= 2  # bucket + upload
    assert stats.by_status.get("206") == 1
    assert stats.failures == 0


def test_via_repoints_remote_datasets(
    cloudsim: Factory, s3_dataset: RemoteDataset, http_dataset: RemoteDataset
) -> None:
    import s3fs

    sim_s3 = cloudsim(s3_dataset.server.endpoint_url)
    proxied = via(sim_s3, s3_dataset)
    assert proxied.storage_options["s3"]["endpoint_url"] == sim_s3.url
    assert proxied.env["AWS_ENDPOINT_URL"] == sim_s3.url
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **proxied.storage_options["s3"])
    name = s3_dataset.local.shards[0]
    assert (
        fs.cat_file(f"{s3_dataset.base_url}/{name}") == (s3_dataset.local.root / name).read_bytes()
    )

    sim_http = cloudsim(http_dataset.server.base_url)
    proxied = via(sim_http, http_dataset)
    assert proxied.url.startswith(sim_http.url + "/")
    answer = fetch_one(proxied.url_for(name))
    assert answer.body == (http_dataset.local.root / name).read_bytes()
    assert sim_s3.stats().gets >= 1
    assert sim_http.stats().gets == 1


# ---------------------------------------------------------------------------- knobs


def test_latency_and_jitter_delay_every_request(sim: CloudSim, blob_url: str) -> None:
    url = through(sim, blob_url)
    sim.configure(latency_s=0.2)
    for answer in [*fetch(url, repeat=2), fetch_one(url, "HEAD")]:
        assert answer.error is None
        assert answer.elapsed_s >= 0.2 * EARLY
    sim.configure(latency_s=0.05, jitter_s=0.1)
    answers = fetch(url, headers={"Range": "bytes=0-99"}, repeat=4, parallel=True)
    assert all(answer.status == 206 and answer.elapsed_s >= 0.05 * EARLY for answer in answers)


def test_bandwidth_cap_paces_one_connection(sim: CloudSim, blob_url: str) -> None:
    rate = 2 * BLOB_SIZE  # bytes/s: the blob takes >= 0.5 s, less the first 1/100 s of data
    sim.configure(bandwidth_bps=rate)
    answer = fetch_one(through(sim, blob_url))
    assert answer.body == BLOB
    assert answer.elapsed_s >= (BLOB_SIZE - rate / 100) / rate * EARLY
    half = BLOB_SIZE // 2
    ranged = fetch_one(through(sim, blob_url), headers={"Range": f"bytes=0-{half - 1}"})
    assert ranged.body == BLOB[:half]
    assert ranged.elapsed_s >= (half - rate / 100) / rate * EARLY


def test_fail_every_second_get(sim: CloudSim, blob_url: str) -> None:
    sim.configure(fail_every_n=2)
    url = through(sim, blob_url)
    statuses = []
    for _ in range(3):
        statuses += [a.status for a in fetch(url, repeat=2)]
        assert fetch_one(url, "HEAD").status == 200  # fail_methods: GET only
    assert statuses == [200, 503] * 3
    error = fetch(url, repeat=2)[1]
    assert error.status == 503
    assert json.loads(error.body)["error"]["code"] == 503
    # A request signed like S3's gets an S3 error document.
    signed = fetch(url, headers={"Authorization": "AWS4-HMAC-SHA256 Credential=x"}, repeat=2)[1]
    assert signed.status == 503
    assert b"<Code>SlowDown</Code>" in signed.body
    assert signed.headers["Content-Type"].startswith("application/xml")
    stats = sim.stats()
    assert stats.failures == 5
    assert stats.by_status == {"200": 8, "503": 5}


def test_fail_status_methods_and_match(sim: CloudSim, blob_url: str) -> None:
    sim.configure(fail_every_n=1, fail_status=500, fail_methods=["HEAD"], match=r"blob\.bin")
    assert fetch_one(through(sim, blob_url), "HEAD").status == 500
    assert fetch_one(through(sim, blob_url)).status == 200  # GET not in fail_methods
    assert fetch_one(sim.url + "/cloudsim/", "HEAD").status == 200  # not matched
    assert sim.stats().failures == 1


def test_cut_every_third_get(sim: CloudSim, blob_url: str) -> None:
    sim.configure(cut_every_n=3, cut_after_bytes=100_000)
    answers = fetch(through(sim, blob_url), repeat=6)
    for index, answer in enumerate(answers, start=1):
        if index % 3:
            assert answer.error is None
            assert answer.body == BLOB
        else:
            assert isinstance(answer.error, aiohttp.ClientPayloadError), answer.error
            assert answer.status == 200
            assert answer.body == BLOB[:100_000]
    stats = sim.stats()
    assert stats.cuts == 2
    assert stats.gets == 6
    assert stats.bytes_sent == 4 * BLOB_SIZE + 2 * 100_000


def test_cut_in_range_and_reset_mode(sim: CloudSim, blob_url: str) -> None:
    sim.configure(cut_all=True, cut_after_bytes=10**9)  # past the end: cut before the last byte
    ranged = fetch_one(through(sim, blob_url), headers={"Range": "bytes=1000-1999"})
    assert isinstance(ranged.error, aiohttp.ClientPayloadError)
    assert ranged.status == 206
    assert ranged.body == BLOB[1000:1999]
    sim.configure(cut_mode="reset", cut_after_bytes=50_000)
    reset = fetch_one(through(sim, blob_url))
    assert isinstance(reset.error, (aiohttp.ClientPayloadError, aiohttp.ClientOSError))
    assert len(reset.body) <= 50_000
    assert fetch_one(through(sim, blob_url), "HEAD").status == 200  # only GETs are cut
    assert sim.stats().cuts == 2


def test_cut_at_offset_never_delivers_that_byte(sim: CloudSim, blob_url: str) -> None:
    """A byte of the object the store never sends: every answer that carries it is cut just
    before it, whatever range was asked; answers that end before it are whole."""
    sim.configure(cut_at_offset=300_000)
    whole = fetch_one(through(sim, blob_url))
    assert isinstance(whole.error, aiohttp.ClientPayloadError)
    assert whole.body == BLOB[:300_000]
    over = fetch_one(through(sim, blob_url), headers={"Range": "bytes=299990-400000"})
    assert isinstance(over.error, aiohttp.ClientPayloadError)
    assert over.body == BLOB[299_990:300_000]
    at = fetch_one(through(sim, blob_url), headers={"Range": "bytes=300000-"})
    assert isinstance(at.error, aiohttp.ClientPayloadError)
    assert at.status == 206
    assert at.body == b""
    for range_ in ("bytes=0-299999", "bytes=300001-400000"):
        answer = fetch_one(through(sim, blob_url), headers={"Range": range_})
        assert answer.error is None
        start, end = (int(x) for x in range_[6:].split("-"))
        assert answer.body == BLOB[start : end + 1]
    assert sim.stats().cuts == 3


def test_stall_at_offset_pauses_before_that_byte(sim: CloudSim, blob_url: str) -> None:
    """With stall_at_offset, every answer carrying that byte pauses just before it, then
    goes on; answers that end before it are not held."""
    sim.configure(cut_at_offset=300_000, stall_at_offset=True, stall_s=0.3)
    held = fetch_one(through(sim, blob_url), headers={"Range": "bytes=299990-400000"})
    assert held.error is None
    assert held.body == BLOB[299_990:400_001]
    assert held.elapsed_s >= 0.3 * EARLY
    stalled = fetch_one(through(sim, blob_url), read_timeout_s=0.1)
    assert isinstance(stalled.error, asyncio.TimeoutError)
    assert stalled.body == BLOB[:300_000]
    before = fetch_one(through(sim, blob_url), headers={"Range": "bytes=0-299999"})
    assert before.error is None
    assert before.body == BLOB[:300_000]
    stats = sim.stats()
    assert (stats.stalls, stats.cuts) == (2, 0)


def test_stall_then_resume(sim: CloudSim, blob_url: str) -> None:
    sim.configure(stall_every_n=1, stall_s=0.3, cut_after_bytes=1000)
    answer = fetch_one(through(sim, blob_url))
    assert answer.body == BLOB
    assert answer.elapsed_s >= 0.3 * EARLY
    stalled = fetch_one(through(sim, blob_url), read_timeout_s=0.1)  # a stall detector fires
    assert isinstance(stalled.error, asyncio.TimeoutError)
    assert stalled.body == BLOB[:1000]
    assert sim.stats().stalls == 2


def test_ignore_range_answers_200_with_everything(sim: CloudSim, blob_url: str) -> None:
    sim.configure(ignore_range=True)
    answer = fetch_one(through(sim, blob_url), headers={"Range": "bytes=100-199"})
    assert answer.status == 200
    assert answer.body == BLOB
    assert "Content-Range" not in answer.headers
    sim.configure(ignore_range=False)
    assert fetch_one(through(sim, blob_url), headers={"Range": "bytes=100-199"}).status == 206
    assert sim.stats().ranges_ignored == 1


def test_counters_match_what_was_done(sim: CloudSim, blob_url: str) -> None:
    url = through(sim, blob_url)
    done = [
        fetch_one(url),
        fetch_one(url + "?x=1", headers={"Range": "bytes=0-9"}),
        fetch_one(url, "HEAD"),
        fetch_one(sim.url + "/cloudsim/missing.bin"),
        fetch_one(url, "DELETE"),
    ]
    stats = sim.stats()
    assert stats.requests == 5
    assert stats.gets == 3
    assert stats.by_method == {"GET": 3, "HEAD": 1, "DELETE": 1}
    assert stats.by_path == {"/" + BLOB_NAME: 4, "/cloudsim/missing.bin": 1}
    assert stats.by_status == {"200": 2, "206": 1, "404": 1, "405": 1}
    assert stats.bytes_sent == sum(len(answer.body) for answer in done)
    assert stats.faults == stats.failures == stats.cuts == stats.upstream_errors == 0
    sim.reset_stats()
    assert sim.stats().requests == 0


def test_control_api(sim: CloudSim, blob_url: str) -> None:
    def call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{sim.url}{CONTROL_PREFIX}/{path}", data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read())

    status, config = call("POST", "config", {"latency_s": 0.01, "fail_methods": ["get", "head"]})
    assert status == 200
    assert config["latency_s"] == 0.01
    assert config["fail_methods"] == ["GET", "HEAD"]
    assert sim.config.latency_s == 0.01
    assert call("POST", "config", {"no_such_knob": 1})[0] == 400
    assert call("POST", "config", {"cut_all": "yes"})[0] == 400
    fetch_one(through(sim, blob_url))
    status, stats = call("GET", "stats")
    assert status == 200
    assert stats["gets"] == 1
    assert stats["bytes_sent"] == BLOB_SIZE
    assert call("POST", "reset", {})[0] == 200
    assert sim.stats().requests == 0
    with pytest.raises(ValueError, match="unknown knob"):
        sim.configure(latency=1)


def test_upstream_down_is_a_502(cloudsim: Factory) -> None:
    from servers import free_port

    sim = cloudsim(f"http://127.0.0.1:{free_port()}")
    assert fetch_one(sim.url + "/x").status == 502
    assert sim.stats().upstream_errors == 1


def test_stop_ends_the_thread(http_server: NginxServer) -> None:
    sim = CloudSim(http_server.base_url).start()
    url = sim.url
    sim.stop()
    sim.stop()  # idempotent
    assert not [t for t in threading.enumerate() if t.name == "cloudsim"]
    assert isinstance(fetch_one(url + "/").error, aiohttp.ClientConnectionError)


# ---------------------------------------------------------------------------- subprocess


def test_subprocess_serves_and_stops_cleanly(
    cloudsim_process: Callable[..., CloudSimProcess], blob_url: str
) -> None:
    base = blob_url.split("/cloudsim/")[0]
    sim = cloudsim_process(base, latency_s=0.1, fail_methods=["GET", "HEAD"], cut_all=False)
    assert sim.url.startswith("http://127.0.0.1:")
    answer = fetch_one(through(sim, blob_url))
    assert answer.body == BLOB
    assert answer.elapsed_s >= 0.1 * EARLY
    assert sim.configure(fail_every_n=1).fail_every_n == 1
    assert fetch_one(through(sim, blob_url), "HEAD").status == 503
    stats = sim.stats()
    assert stats.requests == 2
    assert stats.failures == 1
    assert stats.bytes_sent == BLOB_SIZE
    assert sim.stop() == 0  # SIGTERM: clean exit
    assert sim.stop() == 0

    orphan = cloudsim_process(base)  # exits by itself when its parent (its stdin) goes away
    assert orphan.popen.stdin is not None
    orphan.popen.stdin.close()
    assert orphan.popen.wait(timeout=10) == 0


# ---------------------------------------------------------------------------- clients


@pytest.fixture
def s3_sim(cloudsim: Factory, s3_server: S3Server) -> tuple[CloudSim, Any]:
    """A simulator in front of moto and an s3fs filesystem through it, with the blob stored."""
    import s3fs

    sim = cloudsim(s3_server.endpoint_url)
    options = {**s3_server.storage_options(), "endpoint_url": sim.url}
    direct = s3_server.filesystem()
    direct.mkdir(RETRY_BUCKET)
    direct.pipe(f"{RETRY_BUCKET}/retry.bin", BLOB)
    return sim, s3fs.S3FileSystem(skip_instance_cache=True, **options)


def test_s3fs_retries_503_and_cuts_by_itself(s3_sim: tuple[CloudSim, Any]) -> None:
    """botocore retries SlowDown and s3fs re-reads a cut body: reads still succeed."""
    sim, fs = s3_sim
    sim.configure(fail_every_n=2, cut_every_n=2, cut_after_bytes=1000, match="retry.bin")
    path = f"{RETRY_BUCKET}/retry.bin"
    assert fs.cat_file(path) == BLOB  # GET 1: fine
    # GET 2: 503, retried by botocore; GET 3: cut, retried by s3fs; GET 4: 503; GET 5: fine.
    assert fs.cat_file(path, start=10, end=20_000) == BLOB[10:20_000]
    stats = sim.stats()
    assert stats.failures >= 2
    assert stats.cuts >= 1


def test_gcsfs_retries_503(cloudsim: Factory, gcs_server: GCSServer) -> None:
    """gcsfs retries a 503 with 1-2 s of backoff; the JSON error body is what it expects."""
    import gcsfs

    direct = gcs_server.filesystem()
    direct.mkdir(RETRY_BUCKET)
    direct.pipe(f"{RETRY_BUCKET}/retry.bin", SMALL)
    sim = cloudsim(gcs_server.endpoint_url, fail_every_n=2, match="alt=media")
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, endpoint_url=sim.url, token="anon")
    for _ in range(2):
        assert fs.cat_file(f"{RETRY_BUCKET}/retry.bin", start=0, end=100) == SMALL[:100]
    assert sim.stats().failures == 1
