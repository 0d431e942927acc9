"""S3 shards read through obstore (the default where it can) give what s3fs gives, with every
way users pass credentials and endpoints to fsspec today; what obstore cannot take falls back
to s3fs; errors stay clear and secret-free; a forked worker never hangs on obstore's runtime.
The checks that hold for GCS as well run for it too (its own are in test_transport_gcs.py)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch.utils.data
from cloudsim_fixtures import cloudsim_factory, via  # noqa: F401 - the fixture
from servers import S3Server

import cloudshards as wds
from cloudshards.errors import ConfigError, ShardFormatError, ShardOpenError
from cloudshards.source import FetchOptions, OpenOptions, object_at, process_stats
from cloudshards.source.objstore import ObstoreObject
from cloudshards.source.parts import FIRST_PART_BYTES
from cloudshards.source.remote import FsspecObject
from cloudshards.source.resumable import open_remote

if TYPE_CHECKING:
    from conftest import RemoteDataset


def keys_of(url: str, storage_options: Any = None, **kwargs: Any) -> list[str]:
    dataset = wds.WebDataset(url, shardshuffle=False, storage_options=storage_options, **kwargs)
    return [sample["__key__"] for sample in dataset]


def all_keys(remote: RemoteDataset) -> list[str]:
    return [key for keys in remote.local.shard_keys for key in keys]


def transport_of(url: str, storage_options: Any) -> type:
    return type(object_at(url, OpenOptions(storage_options=storage_options)))


def samples_of(url: str, storage_options: Any, **kwargs: Any) -> list[tuple[str, bytes]]:
    dataset = wds.WebDataset(url, shardshuffle=False, storage_options=storage_options, **kwargs)
    return [(sample["__key__"], sample["bin"]) for sample in dataset]


@pytest.mark.parametrize("remote", ["s3", "gcs"])
def test_reads_through_obstore_by_default_and_match_s3fs_and_gcsfs(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, remote: str
) -> None:
    dataset: RemoteDataset = request.getfixturevalue(f"{remote}_dataset")
    options = dataset.storage_options
    # A shard that exists: an emulator's GCS endpoint is probed with a HEAD of it.
    shard = dataset.url_for(dataset.local.shards[0])
    assert transport_of(shard, options) is ObstoreObject
    fast = samples_of(dataset.url, options)
    cached = samples_of(dataset.url, options, cache_dir=str(tmp_path / "cache"))
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "fsspec")
    assert transport_of(shard, options) is FsspecObject
    slow = samples_of(dataset.url, options)
    assert [key for key, _ in fast] == all_keys(dataset)
    assert fast == slow == cached
    for key, data in fast:
        assert data == dataset.local.samples[key]["bin"]


@pytest.mark.parametrize("remote", ["s3", "gcs"])
def test_credentials_and_endpoint_from_the_environment(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, remote: str
) -> None:
    """S3: keys and endpoint in ``AWS_*``. GCS: ``STORAGE_EMULATOR_HOST`` alone, where gcsfs's
    chain finds no credentials for an emulator and goes anonymous; obstore reads the same
    endpoint unsigned."""
    dataset: RemoteDataset = request.getfixturevalue(f"{remote}_dataset")
    for name, value in dataset.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    assert keys_of(dataset.url) == all_keys(dataset)


def test_credentials_and_endpoint_from_an_aws_profile(
    s3_dataset: RemoteDataset, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    server = s3_dataset.server
    config = tmp_path / "aws-config"
    config.write_text(
        f"[profile train]\nregion = us-east-1\nendpoint_url = {server.endpoint_url}\n"
    )
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(
        f"[train]\naws_access_key_id = {server.key}\naws_secret_access_key = {server.secret}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    assert keys_of(s3_dataset.url, {"s3": {"profile": "train"}}) == all_keys(s3_dataset)
    monkeypatch.setenv("AWS_PROFILE", "train")
    assert keys_of(s3_dataset.url) == all_keys(s3_dataset)


def test_endpoint_and_region_in_client_kwargs(
    s3_dataset: RemoteDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = s3_dataset.server
    options = {
        "s3": {
            "key": server.key,
            "secret": server.secret,
            "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": "us-east-1"},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }
    }
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    assert keys_of(s3_dataset.url, options) == all_keys(s3_dataset)


def test_an_option_obstore_lacks_falls_back_to_s3fs(
    s3_dataset: RemoteDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"s3": {**s3_dataset.storage_options["s3"], "config_kwargs": {"proxies": {}}}}
    assert transport_of(s3_dataset.url_for("x.tar"), options) is FsspecObject
    assert keys_of(s3_dataset.url, options) == all_keys(s3_dataset)
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    with pytest.raises(ConfigError, match="config_kwargs"):
        keys_of(s3_dataset.url, options)


@pytest.mark.parametrize("prefetch_pool", [True, False])
def test_a_wrong_secret_is_access_denied_without_the_secret(
    s3_dataset: RemoteDataset, monkeypatch: pytest.MonkeyPatch, prefetch_pool: bool
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    monkeypatch.setenv("CLOUDSHARDS_RETRIES", "1")
    wrong = "wrongSECRETvalue123"
    options = {"s3": {**s3_dataset.storage_options["s3"], "secret": wrong}}
    url = s3_dataset.url_for(s3_dataset.local.shards[0])
    kwargs = {} if prefetch_pool else {"prefetch": 0}
    with pytest.raises(ShardOpenError) as info:
        keys_of(url, options, **kwargs)
    text = "".join(traceback.format_exception(info.value))
    assert "access denied" in str(info.value)
    assert url in str(info.value)
    assert "SignatureDoesNotMatch" in str(info.value)
    assert wrong not in text


@pytest.mark.parametrize("remote", ["s3", "gcs"])
def test_a_missing_object_is_named_and_not_retried(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    remote: str,
) -> None:
    dataset: RemoteDataset = request.getfixturevalue(f"{remote}_dataset")
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    url = dataset.url_for("no-such-shard.tar")
    with pytest.raises(ShardOpenError, match="object not found") as info:
        keys_of(url, dataset.storage_options)
    assert url in str(info.value)
    assert isinstance(info.value, FileNotFoundError)  # the 404, as webdataset code catches it
    # GCS's 404 carries no error code: the message says "HTTP 404", never "None".
    assert "None" not in "".join(traceback.format_exception_only(info.value))
    assert "retrying" not in caplog.text.lower()


def _read_in_workers(url: str, options: Any, context: str) -> list[str]:
    dataset = wds.WebDataset(url, shardshuffle=False, storage_options=options)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=60
    )
    return sorted(sample["__key__"] for sample in loader)


def test_forked_workers_of_a_process_that_used_obstore_read_through_s3fs(
    s3_dataset: RemoteDataset,
) -> None:
    """obstore's runtime cannot cross a fork: a worker forked after its parent used obstore
    would hang on its first read; it reads through s3fs instead (and says why)."""
    options = s3_dataset.storage_options
    url = s3_dataset.url
    assert keys_of(url, options) == all_keys(s3_dataset)  # the parent uses obstore
    assert _read_in_workers(url, options, "fork") == sorted(all_keys(s3_dataset))


_METADATA_THEN_WORKERS = """
import logging, sys
import torch.utils.data
import cloudshards as wds
from cloudshards import install_as_webdataset
from cloudshards.source import objstore

logging.basicConfig(level=logging.WARNING)
install_as_webdataset()
import webdataset

url, first = sys.argv[1], sys.argv[2]
for opener in (wds.gopen, webdataset.gopen):  # both spellings of gopen, before training
    with opener(first) as stream:
        assert stream.read(512)
print("main used obstore:", objstore._used_in_pid is not None)
dataset = wds.WebDataset(url, shardshuffle=False)
loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=60)
print("samples:", sum(1 for _ in loader))
"""


def test_metadata_read_with_gopen_before_training_leaves_forked_workers_on_obstore(
    s3_dataset: RemoteDataset, tmp_path: Path
) -> None:
    """A script that reads a file with gopen in the main process (timm reads its _info.json
    so) and then forks DataLoader workers: the main process reads it through s3fs, so the
    workers can still use obstore (one that used it before forking would leave them on s3fs,
    0.74-0.80x as fast)."""
    script = tmp_path / "metadata_then_workers.py"
    script.write_text(_METADATA_THEN_WORKERS)
    first = s3_dataset.url_for(s3_dataset.local.shards[0])
    env = {**os.environ, **s3_dataset.env}
    result = subprocess.run(
        [sys.executable, str(script), s3_dataset.url, first],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "main used obstore: False" in result.stdout
    assert f"samples: {len(all_keys(s3_dataset))}" in result.stdout
    assert "not obstore" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("remote", ["s3", "gcs"])
def test_spawned_workers_read_through_obstore(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, remote: str
) -> None:
    dataset: RemoteDataset = request.getfixturevalue(f"{remote}_dataset")
    # CLOUDSHARDS_TRANSPORT=obstore reaches the workers: they fail rather than fall back.
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    keys = _read_in_workers(dataset.url, dataset.storage_options, "spawn")
    assert keys == sorted(all_keys(dataset))


def _requests_and_samples(url: str, options: Any) -> tuple[int, list[tuple[str, bytes]]]:
    """The requests reading ``url`` sent (the counters are the process's) and its samples."""
    before = process_stats().requests
    dataset = wds.WebDataset(url, shardshuffle=False, storage_options=options)
    samples = [(sample["__key__"], sample["bin"]) for sample in dataset]
    return process_stats().requests - before, samples


def test_no_size_lookup_the_first_get_brings_the_size(
    s3_dataset: RemoteDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through obstore a shard's first ranged GET also brings its size: no HEAD. A shard that
    fits in the first part is one GET; the rest follow as parts."""
    options = s3_dataset.storage_options
    sizes = [(s3_dataset.local.root / name).stat().st_size for name in s3_dataset.local.shards]
    first, part = FIRST_PART_BYTES, FetchOptions().part_bytes
    expected = sum(1 + -(-max(0, size - first) // part) for size in sizes)
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    requests, fast = _requests_and_samples(s3_dataset.url, options)
    assert requests == expected
    assert [key for key, _ in fast] == all_keys(s3_dataset)
    # s3fs: a HEAD beside each shard's first part, same bytes.
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "fsspec")
    requests, slow = _requests_and_samples(s3_dataset.url, options)
    assert requests == expected + len(sizes)
    assert slow == fast


def test_an_empty_object_is_a_truncated_tar_not_a_range_error(
    s3_dataset: RemoteDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 answers a ranged GET of an empty object with 416; the shard is still named as what
    it is: a tar cut short (at byte 0)."""
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    url = s3_dataset.url_for("empty.tar")
    s3_dataset.server.filesystem().pipe(url, b"")
    with pytest.raises(ShardFormatError, match="truncated tar") as info:
        keys_of(url, s3_dataset.storage_options, empty_check=False)
    assert url in str(info.value)


def _changing_tar(path: Path, fill: int) -> None:
    """24 samples of 64 KiB of ``fill``: the same size and names for every ``fill``."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for number in range(24):
            info = tarfile.TarInfo(f"k{number:04d}.bin")
            info.size = 64 << 10
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(bytes([fill]) * info.size))


def _publish(
    dataset: RemoteDataset,
    remote: str,
    source: Path,
    name: str,
    mtime: int = 1_700_000_000,
    bucket: str = "cloudshards-it",
) -> None:
    """Write ``source`` as object ``name`` of ``bucket`` (replacing it); ``mtime`` over HTTP."""
    if remote in ("s3", "gcs"):
        with warnings.catch_warnings():  # gcsfs's upload of bytes: aiohttp's warning
            warnings.simplefilter("ignore", ResourceWarning)
            dataset.server.filesystem().put(str(source), f"{bucket}/{name}")
    else:
        target = dataset.server.root / bucket / name
        shutil.copyfile(source, target)
        os.utime(target, (mtime, mtime))  # nginx's ETag is the mtime and size


def test_a_key_obstore_cannot_name_is_read_through_s3fs(
    s3_dataset: RemoteDataset, caplog: pytest.LogCaptureFixture
) -> None:
    """A key with a '..' part is legal in S3, but obstore refuses to name it (before any
    request): it is read through s3fs, not retried as a connection error and given up."""
    source = s3_dataset.local.root / s3_dataset.local.shards[0]
    _publish(s3_dataset, "s3", source, "odd/../dotted.tar")
    url = s3_dataset.url_for("odd/../dotted.tar")
    assert keys_of(url, s3_dataset.storage_options) == s3_dataset.local.shard_keys[0]
    assert "retry" not in caplog.text.lower()


@pytest.mark.parametrize("remote", ["s3", "gcs", "http"])
def test_an_object_replaced_while_it_is_read_is_never_stitched(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, remote: str
) -> None:
    """Each part after the first is asked for only while the object's ETag is the first
    part's (If-Match; on GCS its generation): when the object is replaced mid-read, the read
    fails and names the change, instead of handing on members made of both versions; the
    cache keeps nothing."""
    # The reader pauses while the new version is uploaded: a cache download would run ahead
    # to the end after 0.5 s of that (a slow upload on a loaded machine), before the change.
    monkeypatch.setenv("CLOUDSHARDS_CACHE_IDLE_MS", "600000")
    dataset: RemoteDataset = request.getfixturevalue(f"{remote}_dataset")
    old, new = tmp_path / "old.tar", tmp_path / "new.tar"
    _changing_tar(old, 1)
    _changing_tar(new, 2)
    assert old.stat().st_size == new.stat().st_size
    name = f"changing-{remote}.tar"
    url = dataset.url_for(name)

    def publish(source: Path, mtime: int) -> None:
        _publish(dataset, remote, source, name, mtime)

    cache = tmp_path / "cache"
    for cache_dir in (None, cache):
        publish(old, 1_700_000_000)
        samples = iter(
            wds.WebDataset(
                url,
                shardshuffle=False,
                storage_options=dataset.storage_options,
                part_bytes=64 << 10,
                concurrency=1,
                prefetch=0,
                cache_dir=str(cache_dir) if cache_dir else None,
            )
        )
        first = next(samples)
        assert bytes(first["bin"][:1]) == b"\x01"
        publish(new, 1_700_000_500)
        read = [first]
        with pytest.raises(ShardOpenError, match="changed while it was read") as info:
            read.extend(samples)
        assert name in str(info.value)
        assert all(bytes(s["bin"]) == b"\x01" * (64 << 10) for s in read)  # never version 2
    assert not [p for p in (cache / "data").glob("*") if not p.name.endswith(".partial")]


@pytest.mark.parametrize("remote", ["s3", "http"])
def test_a_store_ignoring_if_match_never_gets_two_versions_stitched(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    remote: str,
    cloudsim: Any,
) -> None:
    """s3rver and Python's http.server answer a ranged GET whatever its If-Match says: each
    answer's own ETag must be the first part's, checked on its headers, so a replaced object
    still fails the read, naming the change, and the cache keeps nothing."""
    monkeypatch.setenv("CLOUDSHARDS_CACHE_IDLE_MS", "600000")  # as in the test above
    old, new = tmp_path / "old.tar", tmp_path / "new.tar"
    _changing_tar(old, 1)
    _changing_tar(new, 2)
    name = f"ignoring-{remote}.tar"
    with contextlib.ExitStack() as stack:
        if remote == "s3":  # a moto that checks no signature: a signed If-Match is dropped
            server = S3Server.start(tmp_path / "moto", enforce_auth=False)
            stack.callback(server.close)
            fs = server.filesystem()
            fs.mkdir("open-bucket")
            upstream, options = server.endpoint_url, {"s3": server.storage_options()}

            def publish(source: Path) -> None:
                fs.put(str(source), f"open-bucket/{name}")

        else:
            dataset: RemoteDataset = request.getfixturevalue("http_dataset")
            upstream, options = dataset.server.base_url, dataset.storage_options

            def publish(source: Path) -> None:
                target = dataset.server.root / "cloudshards-it" / name
                shutil.copyfile(source, f"{target}.new")  # replaced at once, as a store does
                mtime = 1_700_000_500 if source == new else 1_700_000_000  # nginx's ETag
                os.utime(f"{target}.new", (mtime, mtime))
                os.replace(f"{target}.new", target)

        sim = cloudsim(upstream, ignore_if_match=True)
        if remote == "s3":
            options = {"s3": {**options["s3"], "endpoint_url": sim.url}}
            url = f"s3://open-bucket/{name}"
        else:
            url = f"{sim.url}/cloudshards-it/{name}"
        cache = tmp_path / "cache"
        for cache_dir in (None, cache):
            publish(old)
            samples = iter(
                wds.WebDataset(
                    url,
                    shardshuffle=False,
                    storage_options=options,
                    part_bytes=64 << 10,
                    concurrency=1,
                    prefetch=0,
                    cache_dir=str(cache_dir) if cache_dir else None,
                )
            )
            read = [next(samples)]
            publish(new)
            with pytest.raises(ShardOpenError, match="changed while it was read"):
                read.extend(samples)
            assert all(bytes(s["bin"]) == b"\x01" * (64 << 10) for s in read)  # never version 2
        assert not [p for p in (cache / "data").glob("*") if not p.name.endswith(".partial")]
        assert sim.stats().if_match_ignored > 0


@pytest.mark.parametrize("remote", ["s3", "gcs"])
def test_a_stream_resumed_after_a_cut_never_continues_into_a_new_version(
    request: pytest.FixtureRequest, tmp_path: Path, remote: str, cloudsim: Any
) -> None:
    """A whole-shard stream (the cache's downloads, counting, index building) cut mid-way
    resumes with a ranged GET: when the object was replaced meanwhile, the resumed answer's
    ETag or generation is not the first one's, and the read fails naming the change instead
    of handing on the old start with the new rest."""
    dataset: RemoteDataset = request.getfixturevalue(f"{remote}_dataset")
    old, new = tmp_path / "old.tar", tmp_path / "new.tar"
    _changing_tar(old, 1)
    _changing_tar(new, 2)
    name = f"resumed-{remote}.tar"
    _publish(dataset, remote, old, name, 1_700_000_000)
    sim = cloudsim(dataset.server.endpoint_url, cut_all=True, cut_after_bytes=1_000_000)
    proxied = via(sim, dataset)
    options = OpenOptions(storage_options=proxied.storage_options, block_bytes=64 << 10)
    stream = open_remote(proxied.url_for(name), options)
    try:
        head = b""
        while len(head) < 100_000:  # a read gives what one chunk holds
            head += stream.read(100_000 - len(head))
        assert head == old.read_bytes()[:100_000]
        _publish(dataset, remote, new, name, 1_700_000_500)
        sim.configure(cut_all=False)
        with pytest.raises(ShardOpenError, match="changed while it was read"):
            stream.read()
    finally:
        stream.close()
    assert sim.stats().cuts >= 1
