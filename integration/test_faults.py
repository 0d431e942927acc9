"""Fault injection end to end: the cloud simulator (integration/cloudsim.py) in front of nginx,
moto and fake-gcs-server, and cloudshards reading the synthetic dataset through it.

What is checked: 503s and connections cut mid-body are retried (and counted) without losing,
repeating or corrupting a sample; a dead store gives a clear ``ShardOpenError`` within a bound
computed from the options; a stalled read is an error, not a hang; a server that ignores Range
is detected and never corrupts data; the node cache stays complete under faults; prefetch
holds no more than its byte budget and leaves no thread behind.

The backends' own retries are turned down (``quiet_backends``): our retry layer is what is under
test, and s3fs/gcsfs retrying by themselves would hide every fault from it (and gcsfs's backoff
takes ~33 s on a persistent fault). Timing assertions are generous upper bounds: the machine is
a noisy 2-core box.
"""

from __future__ import annotations

import gc
import logging
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from cloudsim import CloudSim
from cloudsim_fixtures import cloudsim_factory, via  # noqa: F401
from servers import GCS_DOWNLOAD

import cloudshards as wds
from cloudshards.cache import cache_info
from cloudshards.errors import ShardOpenError
from cloudshards.source import (
    FetchOptions,
    IOStats,
    OpenOptions,
    PartStream,
    ShardPrefetcher,
    open_remote,
    parts,
)
from cloudshards.source.adapt import FIRST_PART_BYTES

if TYPE_CHECKING:
    from conftest import LocalDataset, RemoteDataset

Factory = Callable[..., CloudSim]
Sample = dict[str, bytes]
FIELDS = ("bin", "cls", "json")
PART = 1 << 16  # the smallest part size: every shard of the dataset takes 1-3 ranged GETs
CUT_AT = 20_000  # bytes sent before a cut or a stall (at most Content-Length - 1)
# What each backend does on its own per failed request once quieted: s3fs sleeps 0.1 s after
# its single attempt before giving up; fsspec HTTP and (quieted) gcsfs fail at once.
BACKEND_SLEEP_S = {"http": 0.0, "s3": 0.1, "gs": 0.0}
REQUEST_S = 2.0  # one request to a local server through the proxy, with slack for a busy box
STARTUP_S = 5.0  # filesystem creation, first connections, thread start-up


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(autouse=True)
def quiet_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make s3fs and gcsfs give up after one try, so every fault reaches cloudshards' retries.

    Neither has a storage option for it: s3fs's ``retries`` is a class attribute (passed as an
    option it reaches aiobotocore's session and fails with TypeError), and gcsfs's retry count
    is fixed when its methods are decorated; its retry loop asks ``gcsfs.retry.is_retriable``.
    botocore's own retries are turned off through ``config_kwargs`` (see ``through``).
    """
    import gcsfs.retry
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda exc: False)


@pytest.fixture(autouse=True)
def unranged_hosts() -> Iterator[set[str]]:
    """Forget hosts marked as ignoring Range, before and after each test."""
    parts._UNRANGED_HOSTS.clear()
    yield parts._UNRANGED_HOSTS
    parts._UNRANGED_HOSTS.clear()


@pytest.fixture
def no_threads_left() -> Iterator[None]:
    """Fail if a prefetch thread outlives the test (after a short grace period)."""
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefetch_threads() == []


# ------------------------------------------------------------------------------ helpers


def prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cloudshards")]


def through(cloudsim: Factory, remote: RemoteDataset, **knobs: Any) -> tuple[CloudSim, Any]:
    """Start a simulator in front of ``remote``'s server; return it and the proxied dataset.

    GCS faults only hit object downloads (JSON or XML API), never metadata calls.
    """
    server = remote.server
    upstream = server.base_url if remote.protocol == "http" else server.endpoint_url
    if remote.protocol == "gs":
        knobs.setdefault("match", GCS_DOWNLOAD)
    sim = cloudsim(upstream, **knobs)
    proxied = via(sim, remote)
    if remote.protocol == "s3":
        options = proxied.storage_options["s3"]
        # botocore retries 5xx by itself (up to ~40 s with s3fs's loop around it). Its
        # ``max_attempts`` counts retries (1 would still retry once); this counts every try.
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}}
    return sim, proxied


def dataset_for(remote: Any, urls: str | list[str] | None = None, **kw: Any) -> wds.WebDataset:
    return wds.WebDataset(
        remote.url if urls is None else urls,
        shardshuffle=False,
        storage_options=remote.storage_options,
        **kw,
    )


def read_samples(samples: Iterable[dict[str, Any]]) -> list[tuple[str, Sample]]:
    return [(s["__key__"], {f: s[f] for f in FIELDS}) for s in samples]


def expected_samples(local: LocalDataset) -> list[tuple[str, Sample]]:
    return [(key, {f: sample[f] for f in FIELDS}) for key, sample in local.samples.items()]


def assert_exactly_once(got: list[tuple[str, Sample]], local: LocalDataset) -> None:
    """Every sample once, in order, byte for byte (with a readable message when not)."""
    want = expected_samples(local)
    got_keys = [key for key, _ in got]
    want_keys = [key for key, _ in want]
    assert got_keys == want_keys, (
        f"{len(got_keys)} samples instead of {len(want_keys)}; "
        f"missing {sorted(set(want_keys) - set(got_keys))[:5]}, "
        f"repeated {sorted({k for k in got_keys if got_keys.count(k) > 1})[:5]}"
    )
    corrupt = [
        key for (key, fields), (_, wanted) in zip(got, want, strict=True) if fields != wanted
    ]
    assert corrupt == [], f"corrupted samples: {corrupt[:5]}"


def give_up_bound_s(fetch: FetchOptions, protocol: str) -> float:
    """Longest time a request that always fails may take before ``ShardOpenError``.

    ``retries + 1`` attempts, each a request plus the backend's own sleep, and the backoff
    between them (each delay at most ``min(max_backoff_s, backoff_s * 2**n)``).
    """
    backoff = sum(min(fetch.max_backoff_s, fetch.backoff_s * 2.0**n) for n in range(fetch.retries))
    attempts = fetch.retries + 1
    return STARTUP_S + backoff + attempts * (REQUEST_S + BACKEND_SLEEP_S[protocol])


# ------------------------------------------------------------------------------ 503s and cuts


@pytest.mark.timeout(90)
def test_503s_and_cuts_lose_nothing(
    cloudsim: Factory, remote_dataset: RemoteDataset, no_threads_left: None
) -> None:
    """Every 2nd GET a 503, every 3rd GET cut mid-body: all samples once, intact, retried."""
    sim, remote = through(
        cloudsim, remote_dataset, fail_every_n=2, cut_every_n=3, cut_after_bytes=CUT_AT
    )
    ds = dataset_for(remote, part_bytes=PART, concurrency=2, prefetch=2, retries=10)
    before = ds.stats()["io"]
    got = read_samples(ds)
    after = ds.stats()["io"]
    assert_exactly_once(got, remote.local)
    stats = sim.stats()
    assert stats.failures > 0
    assert stats.cuts > 0
    # Several ranged GETs per shard (plus the retries), not one streaming GET per shard.
    assert stats.by_status.get("206", 0) > len(remote.local.shards)
    # Each injected fault reached our layer and was retried once (and counted).
    assert after["retries"] - before["retries"] >= stats.faults
    assert after["failures"] == before["failures"]
    assert after["shards"] - before["shards"] == len(remote.local.shards)


@pytest.mark.timeout(90)
def test_a_whole_shard_stream_retries_its_first_request(
    cloudsim: Factory, remote_dataset: RemoteDataset, no_threads_left: None
) -> None:
    """The one-GET reads of whole shards (index building, sample counting, a cache taking a
    download over, a host that ignores Range) retry a 503 on their first request as on any
    later one; on S3 through obstore too, whose stream sends its GET when first asked."""
    sim, remote = through(cloudsim, remote_dataset, fail_every_n=2)
    if remote.protocol == "s3":  # s3fs's botocore settings would switch obstore off
        remote.storage_options["s3"].pop("config_kwargs")
    options = OpenOptions(storage_options=remote.storage_options)
    stats = IOStats()
    for name in remote.local.shards:
        with open_remote(remote.url_for(name), options, fetch=FetchOptions(), stats=stats) as s:
            data = b"".join(iter(lambda: s.read(1 << 20), b""))
        assert data == (remote.local.root / name).read_bytes()
    assert sim.stats().failures >= len(remote.local.shards) // 2
    assert stats.retries == sim.stats().failures
    assert stats.failures == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fixture", ["s3_dataset", "gcs_dataset"])
def test_a_whole_shard_stream_hands_on_every_byte_before_a_cut_it_cannot_get_past(
    cloudsim: Factory, request: pytest.FixtureRequest, fixture: str, no_threads_left: None
) -> None:
    """Every answer that carries one byte of the shard is cut just before it: a one-GET
    read (index building, counting, a cache taking a download over) hands on every byte
    before it, then raises naming the shard and that byte. On S3 and GCS through obstore,
    whose stream gathered 4 MiB before handing any on, the bytes of the cut answer were lost
    with it: the read failed having delivered nothing of a shard smaller than that.

    (Over HTTP the one-GET read is fsspec's, whose aiohttp stream raises a cut before the
    bytes it holds: not handed on yet. The ranged reads of every store keep them.)"""
    remote_dataset: RemoteDataset = request.getfixturevalue(fixture)
    name = max(
        remote_dataset.local.shards, key=lambda n: (remote_dataset.local.root / n).stat().st_size
    )
    content = (remote_dataset.local.root / name).read_bytes()
    cut = len(content) // 2
    sim, remote = through(cloudsim, remote_dataset, cut_at_offset=cut)
    if remote.protocol == "s3":  # s3fs's botocore settings would switch obstore off
        remote.storage_options["s3"].pop("config_kwargs")
    options = OpenOptions(storage_options=remote.storage_options)
    url = remote.url_for(name)
    got = bytearray()

    def read_to_the_end() -> None:
        fetch = FetchOptions(retries=2, stall_timeout_s=2)
        with open_remote(url, options, fetch=fetch, stats=IOStats()) as stream:
            while chunk := stream.read(1 << 20):
                got.extend(chunk)

    with pytest.raises(ShardOpenError) as caught:
        read_to_the_end()
    assert bytes(got) == content[:cut]
    assert (caught.value.url, caught.value.offset) == (url, cut)
    assert sim.stats().cuts >= 3


def sample_starts(path: Path) -> list[tuple[str, str, int]]:
    """(key, member name, offset of its data) of each sample's first member in a tar."""
    starts: list[tuple[str, str, int]] = []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            key = member.name.split(".", 1)[0]
            if member.isfile() and (not starts or starts[-1][0] != key):
                starts.append((key, member.name, member.offset_data))
    return starts


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["cut", "stall"])
@pytest.mark.parametrize("where", ["first part", "later part"])
def test_a_byte_the_store_never_sends_loses_no_sample_before_it(
    cloudsim: Factory, remote_dataset: RemoteDataset, where: str, fault: str, no_threads_left: None
) -> None:
    """Every answer that carries one byte of a shard is cut (or stalls) just before it (a
    broken replica, a bad sector), however often it is asked for: the bytes of the part before
    it are kept from the cut answers, so every sample before that byte arrives, intact, and
    then an error names the shard, the member being read and the byte. In the first part (a
    small shard is read with that one GET, which also brings its size) as in a later one."""
    local = remote_dataset.local
    sizes = [len(keys) for keys in local.shard_keys]
    if where == "first part":  # the last sample that starts in the smallest shard's first part
        shard = sizes.index(min(sizes))
        starts = sample_starts(local.root / local.shards[shard])
        key, member, data_at = [start for start in starts if start[2] < FIRST_PART_BYTES][-1]
        assert key != local.shard_keys[shard][0], "no sample before the cut"
    else:
        # The second sample that starts after the first part of the largest shard: samples of
        # the part it is in that lie before it are read only from bytes kept from a cut answer.
        shard = sizes.index(max(sizes))
        starts = sample_starts(local.root / local.shards[shard])
        later = [start for start in starts if start[2] > PART]
        assert len(later) >= 2, "the largest shard is too small for this test"
        key, member, data_at = later[1]
    cut = data_at + 100
    stall = {"stall_at_offset": True, "stall_s": 20.0} if fault == "stall" else {}
    sim, remote = through(cloudsim, remote_dataset, cut_at_offset=cut, **stall)
    url = remote.url_for(local.shards[shard])
    ds = dataset_for(
        remote, [url], part_bytes=PART, concurrency=2, prefetch=1, retries=2, stall_timeout_s=2
    )
    got: list[tuple[str, Sample]] = []
    samples = iter(ds)
    error = None
    try:
        for sample in samples:
            got.extend(read_samples([sample]))
    except ShardOpenError as exc:
        error = exc
    assert error is not None, "the shard was read whole past a byte the store never sent"
    keys = local.shard_keys[shard]
    want = keys[: keys.index(key)]
    assert [k for k, _ in got] == want
    assert got == [(k, {f: local.samples[k][f] for f in FIELDS}) for k in want]
    assert (error.url, error.member, error.offset) == (url, member, cut)
    assert f"member {member!r}" in str(error)
    assert f"byte offset {cut}" in str(error)
    faults = sim.stats()
    assert (faults.stalls if fault == "stall" else faults.cuts) >= 3


# ------------------------------------------------------------------------------ a dead store


@pytest.mark.timeout(60)
def test_all_connections_cut_raise_within_bound(
    cloudsim: Factory, remote_dataset: RemoteDataset, no_threads_left: None
) -> None:
    sim, remote = through(cloudsim, remote_dataset, cut_all=True, cut_after_bytes=CUT_AT)
    ds = dataset_for(remote, part_bytes=PART, concurrency=2, prefetch=1, retries=2)
    bound = give_up_bound_s(ds.fetch, remote.protocol)
    first = remote.url_for(remote.local.shards[0])
    start = time.monotonic()
    with pytest.raises(ShardOpenError) as info:
        for _ in ds:
            pass
    elapsed = time.monotonic() - start
    assert elapsed < bound, f"gave up after {elapsed:.1f} s, bound {bound:.1f} s"
    error = info.value
    assert error.url == first
    assert first in str(error)
    assert error.offset is not None
    assert "gave up after 3 attempts" in str(error)
    assert sim.stats().cuts >= 3


@pytest.mark.timeout(60)
def test_all_connections_cut_skip_handler_ends_quietly(
    cloudsim: Factory, remote_dataset: RemoteDataset, no_threads_left: None
) -> None:
    """Every GET cut after CUT_AT bytes, ``handler="skip"``: each shard ends quietly, within
    the retries' bound, after the samples before the failure."""
    sim, remote = through(cloudsim, remote_dataset, cut_all=True, cut_after_bytes=CUT_AT)
    urls = remote.shard_urls()[:2]
    ds = dataset_for(
        remote,
        urls,
        part_bytes=PART,
        concurrency=2,
        prefetch=1,
        retries=1,
        handler="skip",
        empty_check=False,
    )
    before = ds.stats()["io"]["failures"]
    start = time.monotonic()
    got = [(s["__url__"], s["__key__"], {f: s[f] for f in FIELDS}) for s in ds]
    elapsed = time.monotonic() - start
    # Each shard is given up on, after handing on the samples that lie wholly in the bytes its
    # cut answers brought: an intact start of the shard, in order, nothing twice.
    local = remote.local
    for index, url in enumerate(urls):
        keys = [key for where, key, _ in got if where == url]
        assert keys == local.shard_keys[index][: len(keys)] != local.shard_keys[index]
    assert [u for u, _, _ in got] == sorted((u for u, _, _ in got), key=urls.index)
    assert all(fields == {f: local.samples[key][f] for f in FIELDS} for _, key, fields in got)
    # Two shards given up on one after the other (prefetch may overlap them).
    bound = 2 * give_up_bound_s(ds.fetch, remote.protocol)
    assert elapsed < bound, f"took {elapsed:.1f} s, bound {bound:.1f} s"
    assert ds.stats()["io"]["failures"] - before >= len(urls)
    assert sim.stats().cuts > 0


# ------------------------------------------------------------------------------ stalls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cached", [False, True], ids=["no cache", "cache_dir"])
def test_a_stalled_get_is_retried_and_loses_nothing(
    cloudsim: Factory,
    remote_dataset: RemoteDataset,
    cached: bool,
    tmp_path: Path,
    no_threads_left: None,
) -> None:
    """Every 3rd GET stops sending after CUT_AT bytes for longer than stall_timeout_s (a stuck
    connection, as S3 has now and then): that try is abandoned and retried like a cut one, so
    every sample arrives once, intact; the shard is not given up on."""
    sim, remote = through(
        cloudsim, remote_dataset, stall_every_n=3, stall_s=20.0, cut_after_bytes=CUT_AT
    )
    cache = {"cache_dir": str(tmp_path / "cache")} if cached else {}
    ds = dataset_for(
        remote, part_bytes=PART, concurrency=2, prefetch=1, stall_timeout_s=1, retries=4, **cache
    )
    before = ds.stats()["io"]["failures"]  # the process's counters, over every test
    assert_exactly_once(read_samples(ds), remote.local)
    assert sim.stats().stalls >= 2
    assert ds.stats()["io"]["failures"] == before


@pytest.mark.timeout(60)
def test_stall_is_an_error_not_a_hang(cloudsim: Factory, http_dataset: RemoteDataset) -> None:
    """Every GET pauses 20 s after CUT_AT bytes; stall_timeout_s=1 abandons each try (and
    retries it, as any failure) and turns the last into an error, and dropping the failed
    iterator does not wait for the stalled requests either."""
    stall_s = 20.0
    sim, remote = through(
        cloudsim, http_dataset, stall_every_n=1, stall_s=stall_s, cut_after_bytes=CUT_AT
    )
    ds = dataset_for(
        remote, part_bytes=PART, concurrency=2, prefetch=1, stall_timeout_s=1, retries=1
    )
    start = time.monotonic()
    with pytest.raises(ShardOpenError, match="stalled") as info:
        for _ in ds:
            pass
    elapsed = time.monotonic() - start
    bound = ds.fetch.give_up_s + STARTUP_S + REQUEST_S  # 2 tries of 1 s, and a backoff
    assert elapsed < bound, (
        f"ShardOpenError surfaced after {elapsed:.1f} s (stall_timeout_s=1, retries=1, server "
        f"stalls {stall_s:.0f} s)"
    )
    assert info.value.url == remote.url_for(remote.local.shards[0])
    assert sim.stats().stalls >= 2  # the stalled try was tried again

    # The failed iterator's frames (and its prefetcher) live on in the traceback; release
    # them on a helper thread so a blocking clean-up shows as a failure, not a stuck test.
    # (The simulator's teardown ends the stalled responses either way.)
    held: list[BaseException] = [info.value]
    del info

    def release() -> None:
        held.clear()
        gc.collect()

    releaser = threading.Thread(target=release, name="release-failed-iterator", daemon=True)
    start = time.monotonic()
    releaser.start()
    releaser.join(timeout=10)
    waited = time.monotonic() - start
    assert not releaser.is_alive(), (
        f"releasing the failed iterator still blocks after {waited:.0f} s: the clean-up waits "
        f"for the stalled requests (stall_s={stall_s:.0f}); threads {prefetch_threads()}"
    )
    deadline = time.monotonic() + 10
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefetch_threads() == []


# ------------------------------------------------------------------------------ ignored Range


@pytest.mark.timeout(60)
def test_a_server_ignoring_range_without_a_length_is_streamed_exactly(
    cloudsim: Factory, http_dataset: RemoteDataset, unranged_hosts: set[str]
) -> None:
    """A host that drops Range and sends the whole object chunked, without Content-Length (as
    nginx does when it gzips on the fly): the first answer's body is the whole object, its
    length the size; every sample once, intact (each shard once failed "ranged GET returned
    N bytes, expected 65536")."""
    sim, remote = through(cloudsim, http_dataset, ignore_range=True, chunked=True)
    ds = dataset_for(remote, part_bytes=PART, concurrency=2, prefetch=2)
    assert_exactly_once(read_samples(ds), remote.local)
    assert sim.stats().ranges_ignored > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("held_whole", [True, False], ids=["held", "too-large-to-hold"])
def test_a_server_ignoring_range_is_read_with_one_object_in_memory(
    cloudsim: Factory,
    http_dataset: RemoteDataset,
    unranged_hosts: set[str],
    monkeypatch: pytest.MonkeyPatch,
    held_whole: bool,
) -> None:
    """A host that answers every ranged GET with the whole object (Python's http.server does):
    the first answer is the object, so no other part goes out (each one brought the whole
    object again, 16 at once: 6.5 GB for a 300 MB shard); an answer too large to hold is left
    and the object streamed with one GET. Every sample once, intact, either way."""
    from cloudshards.source import httpobj

    if not held_whole:
        monkeypatch.setattr(httpobj, "WHOLE_BODY_MAX", 4096)
    sim, remote = through(cloudsim, http_dataset, ignore_range=True)
    ds = dataset_for(remote, part_bytes=PART, concurrency=8, prefetch=0)
    assert_exactly_once(read_samples(ds), remote.local)
    shards = len(remote.local.files())
    # One GET a shard; the first shard one more when its answer was too large to hold.
    assert sim.stats().gets <= shards + (0 if held_whole else 1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fixture", ["http_dataset", "gcs_dataset"])
def test_server_ignoring_range_never_corrupts(
    cloudsim: Factory,
    request: pytest.FixtureRequest,
    fixture: str,
    unranged_hosts: set[str],
    caplog: pytest.LogCaptureFixture,
    no_threads_left: None,
) -> None:
    """Ranged GETs answered 200 with the whole object (and every 3rd GET cut): the fallback to
    streaming is logged once and the samples are exactly right; the streamed shards survive
    cuts mid-object exactly too."""
    caplog.set_level(logging.WARNING, logger="cloudshards")
    remote_dataset: RemoteDataset = request.getfixturevalue(fixture)
    sim, remote = through(
        cloudsim, remote_dataset, ignore_range=True, cut_every_n=3, cut_after_bytes=CUT_AT
    )
    ds = dataset_for(remote, part_bytes=PART, concurrency=2, prefetch=2, retries=6)
    assert_exactly_once(read_samples(ds), remote.local)
    stats = sim.stats()
    assert stats.ranges_ignored > 0
    assert stats.cuts > 0
    logged = [r.getMessage() for r in caplog.records if "ignores Range" in r.getMessage()]
    assert len(logged) == 1, logged
    host = remote.base_url.rsplit("/", 1)[0] if remote.protocol == "http" else remote.base_url
    assert unranged_hosts == {host}
    assert logged[0].startswith(host)

    # Shards of that host now stream with one GET each. Every 2nd GET is cut after 50 kB, once
    # the reader has taken some of it: a per-connection cap makes the body arrive in pieces,
    # and with prefetch=0 each shard is read as soon as it opens. A resumed stream must go on
    # from the middle of the object, exactly.
    caplog.clear()
    sim.configure(cut_every_n=2, cut_after_bytes=50_000, bandwidth_bps=400_000)
    sim.reset_stats()
    streamed = dataset_for(remote, prefetch=0, retries=6)
    assert_exactly_once(read_samples(streamed), remote.local)
    assert sim.stats().cuts >= len(remote.local.shards) // 2
    assert not [r for r in caplog.records if "ignores Range" in r.getMessage()]


@pytest.mark.timeout(90)
def test_an_s3_store_ignoring_range_is_streamed_through_obstore(
    cloudsim: Factory,
    dataset: LocalDataset,
    tmp_path: Path,
    unranged_hosts: set[str],
    caplog: pytest.LogCaptureFixture,
    no_threads_left: None,
) -> None:
    """obstore refuses a whole-object answer to a ranged GET; the store is then recognised
    as ignoring Range and its shards streamed, as through s3fs, not retried until the shard
    fails."""
    from servers import S3Server

    from cloudshards.source import object_at
    from cloudshards.source.objstore import ObstoreObject

    caplog.set_level(logging.WARNING, logger="cloudshards")
    server = S3Server.start(tmp_path / "moto", enforce_auth=False)  # Range is signed: unsigned
    try:
        fs = server.filesystem()
        fs.mkdir("unranged")
        for name in dataset.shards:
            fs.put(str(dataset.root / name), f"unranged/{name}")
        sim = cloudsim(server.endpoint_url, ignore_range=True)
        options = {"s3": {**server.storage_options(), "endpoint_url": sim.url}}
        url = f"s3://unranged/{dataset.brace}"
        assert type(object_at(url, OpenOptions(storage_options=options))) is ObstoreObject
        ds = wds.WebDataset(url, shardshuffle=False, storage_options=options, part_bytes=PART)
        assert_exactly_once(read_samples(ds), dataset)
        assert sim.stats().ranges_ignored > 0
        logged = [r.getMessage() for r in caplog.records if "ignores Range" in r.getMessage()]
        assert len(logged) == 1, logged
        assert not [r for r in caplog.records if "retry" in r.getMessage()]
    finally:
        server.close()


# ------------------------------------------------------------------------------ node cache


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fixture", ["http_dataset", "s3_dataset"])
def test_cache_under_faults_is_complete(
    cloudsim: Factory,
    request: pytest.FixtureRequest,
    fixture: str,
    tmp_path: Path,
    no_threads_left: None,
) -> None:
    """503 on every 2nd GET while the cache fills: samples exact, entries complete, and the
    second pass reads only the cache (no GET reaches the proxy)."""
    remote_dataset: RemoteDataset = request.getfixturevalue(fixture)
    sim, remote = through(cloudsim, remote_dataset, fail_every_n=2)
    cache_dir = tmp_path / "cache"
    ds = dataset_for(
        remote, part_bytes=PART, concurrency=2, prefetch=1, retries=10, cache_dir=str(cache_dir)
    )
    io_before = ds.stats()["io"]["retries"]
    assert_exactly_once(read_samples(ds), remote.local)
    assert ds.stats()["io"]["retries"] > io_before
    assert sim.stats().failures > 0

    local = remote.local
    info = cache_info(cache_dir)
    assert info["partial"] == 0
    assert info["entries"] == len(local.shards)
    assert info["bytes"] == sum((local.root / name).stat().st_size for name in local.shards)

    hits = ds.stats()["cache"]["hits"]
    sim.reset_stats()
    assert_exactly_once(read_samples(ds), local)
    assert ds.stats()["cache"]["hits"] - hits == len(local.shards)
    assert sim.stats().gets == 0, sim.stats()


# ------------------------------------------------------------------------------ memory bound


def read_slowly(
    stream: PartStream, stats: IOStats, consumed: int, peak: list[int], pause_s: float
) -> tuple[bytes, int]:
    """Read ``stream`` to its end in 16 KiB reads, computing for ``pause_s`` after each one
    while sampling the bytes received but not yet consumed; return (data, consumed)."""
    chunks = []
    while chunk := stream.read(1 << 14):
        chunks.append(chunk)
        consumed += len(chunk)
        until = time.monotonic() + pause_s
        while True:
            peak[0] = max(peak[0], stats.bytes - consumed)
            if time.monotonic() >= until:
                break
            time.sleep(0.005)
    return b"".join(chunks), consumed


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("depth", "concurrency"), [(1, 1), (2, 2)])
def test_prefetch_stays_within_budget_and_cleans_up(
    cloudsim: Factory, http_dataset: RemoteDataset, depth: int, concurrency: int
) -> None:
    """A slow consumer (so that every fetch lands before the next read) over a link with
    50 ms first-byte latency: what is received but not consumed never exceeds
    (prefetch + 1) x concurrency x part_bytes; closing the iterator mid-shard leaves no
    thread."""
    sim, remote = through(cloudsim, http_dataset, latency_s=0.05)
    fetch = FetchOptions(prefetch=depth, concurrency=concurrency, part_bytes=PART)
    stats = IOStats()
    local = remote.local
    shards = [{"url": url, "shard_index": i} for i, url in enumerate(remote.shard_urls())]
    prefetcher = ShardPrefetcher(iter(shards), options=OpenOptions(), fetch=fetch, stats=stats)
    it = iter(prefetcher)
    consumed, peak = 0, [0]
    for index, name in enumerate(local.shards[:-1]):
        shard, stream = next(it)
        assert shard["shard_index"] == index
        assert isinstance(stream, PartStream), stream
        data, consumed = read_slowly(stream, stats, consumed, peak, pause_s=0.08)
        stream.close()
        assert data == (local.root / name).read_bytes()
    # Stop in the middle of the last shard, with its parts in flight.
    _, stream = next(it)
    assert isinstance(stream, PartStream)
    assert stream.read(1 << 14)
    it.close()  # type: ignore[attr-defined]
    assert prefetch_threads() == []
    budget = fetch.max_buffered_bytes
    assert peak[0] <= budget, (
        f"held {peak[0]} bytes received but not consumed; budget (prefetch + 1) x "
        f"concurrency x part_bytes = {budget} ({peak[0] / PART:.2f} parts vs {budget // PART})"
    )
    assert peak[0] >= PART  # the measurement saw prefetched parts (it is not vacuous)
    assert sim.stats().gets > len(local.shards)


@pytest.mark.timeout(60)
def test_closing_a_dataset_iterator_leaves_no_threads(
    cloudsim: Factory, http_dataset: RemoteDataset
) -> None:
    """Through WebDataset: close the iterator with shards and parts in flight."""
    sim, remote = through(cloudsim, http_dataset, latency_s=0.05)
    ds = dataset_for(remote, part_bytes=PART, concurrency=2, prefetch=2)
    it = iter(ds)
    first = next(it)
    assert first["__key__"] == next(iter(remote.local.samples))
    assert prefetch_threads() != []
    it.close()  # type: ignore[attr-defined]
    assert prefetch_threads() == []
    assert sim.stats().gets > 0
