"""ShardWriter against real servers: moto S3 and fake-gcs-server.

Round trips through every decoder over S3 and local paths; atomicity when the writing code
raises, when an upload is already under way (multipart / resumable), and when the writing
process is SIGKILLed in the middle of a shard.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

import cloudshards
from cloudshards import ShardWriter, TarWriter, torch_audio, torch_video
from cloudshards.decoders import allow_unsafe_decoders
from cloudshards.errors import ShardOpenError

if TYPE_CHECKING:
    from servers import GCSServer, S3Server

PART_BYTES = 5 << 20  # S3's smallest multipart part: uploads start before the shard is done


def _load_unit_helpers() -> ModuleType:
    # The media samples, their checks and the SIGKILL harness live with the unit tests
    # (tests/test_writers.py); load that module by path rather than copying them here.
    path = Path(__file__).resolve().parents[1] / "tests" / "test_writers.py"
    spec = importlib.util.spec_from_file_location("cloudshards_writer_helpers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helpers = _load_unit_helpers()


@pytest.fixture
def unsafe_decoding() -> Iterator[None]:
    allow_unsafe_decoders(True)  # the media samples hold a pickle (.pyd) field
    yield
    allow_unsafe_decoders(False)


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[tuple[str, Any]]:
    fs = s3_server.filesystem()
    bucket = f"writers-{secrets.token_hex(4)}"
    fs.mkdir(bucket)
    yield bucket, fs
    fs.rm(bucket, recursive=True)


@pytest.fixture
def gcs_bucket(gcs_server: GCSServer) -> Iterator[tuple[str, Any]]:
    fs = gcs_server.filesystem()
    bucket = f"writers-{secrets.token_hex(4)}"
    fs.mkdir(bucket)
    yield bucket, fs
    fs.rm(bucket, recursive=True)


def names(fs: Any, bucket: str) -> list[str]:
    return sorted(path.rsplit("/", 1)[1] for path in fs.find(bucket, refresh=True))


def pending_uploads(fs: Any, bucket: str) -> list[str]:
    """Keys of the multipart uploads S3 holds open (started, neither completed nor aborted)."""
    answer = fs.call_s3("list_multipart_uploads", Bucket=bucket)
    return [upload["Key"] for upload in answer.get("Uploads", [])]


@pytest.mark.parametrize("where", ["s3", "local"])
def test_every_decoder_round_trips(
    where: str,
    s3_server: S3Server,
    s3_bucket: tuple[str, Any],
    tmp_path: Path,
    unsafe_decoding: None,
) -> None:
    bucket, fs = s3_bucket
    base = f"s3://{bucket}/media" if where == "s3" else str(tmp_path / "media")
    options = {"s3": s3_server.storage_options()}
    with ShardWriter(f"{base}-%06d.tar", maxcount=2, storage_options=options) as sink:
        for index in range(5):
            sink.write(helpers.media_sample(index))
    assert sink.written == [f"{base}-{shard:06d}.tar" for shard in range(3)]
    if where == "s3":
        assert names(fs, bucket) == [f"media-{shard:06d}.tar" for shard in range(3)]
    dataset = cloudshards.WebDataset(
        f"{base}-{{000000..000002}}.tar", shardshuffle=False, storage_options=options
    ).decode("rgb8", torch_video, torch_audio)
    decoded = list(dataset)
    assert len(decoded) == 5
    for index, sample in enumerate(decoded):
        helpers.check_decoded(sample, index)


def samples(count: int, size: int) -> list[dict[str, Any]]:
    return [{"__key__": f"k{i:04d}", "bin": os.urandom(size), "cls": i} for i in range(count)]


def write_then_fail(sink: ShardWriter, written: list[dict[str, Any]], check: Any = None) -> None:
    """Write the samples inside ``with sink``, run ``check``, then raise RuntimeError."""
    with sink:
        for sample in written:
            sink.write(sample)
        if check is not None:
            check()
        raise RuntimeError("boom")


def test_shardwriter_to_gcs_emulator(gcs_server: GCSServer, gcs_bucket: tuple[str, Any]) -> None:
    bucket, fs = gcs_bucket
    options = {"gs": gcs_server.storage_options()}
    written = samples(7, 3000)
    with ShardWriter(f"gs://{bucket}/g-%03d.tar", maxcount=3, storage_options=options) as sink:
        for sample in written:
            sink.write(sample)
    assert names(fs, bucket) == ["g-000.tar", "g-001.tar", "g-002.tar"]
    read = list(
        cloudshards.WebDataset(
            f"gs://{bucket}/g-{{000..002}}.tar", shardshuffle=False, storage_options=options
        ).decode()
    )
    assert [(s["__key__"], s["bin"], s["cls"]) for s in read] == [
        (s["__key__"], s["bin"], s["cls"]) for s in written
    ]


def test_s3_with_credentials_from_the_environment(
    s3_server: S3Server, s3_bucket: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, _ = s3_bucket
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    with TarWriter(f"s3://{bucket}/env.tar") as sink:
        sink.write({"__key__": "k", "txt": "from env"})
    assert [s["txt"] for s in cloudshards.WebDataset(f"s3://{bucket}/env.tar").decode()] == [
        "from env"
    ]


@pytest.mark.parametrize("sample_bytes", [1000, 3 << 20], ids=["one-put", "multipart"])
def test_s3_exception_inside_with_publishes_nothing(
    s3_server: S3Server, s3_bucket: tuple[str, Any], sample_bytes: int
) -> None:
    bucket, fs = s3_bucket
    options = {"s3": {**s3_server.storage_options(), "default_block_size": PART_BYTES}}

    def upload_under_way() -> None:
        if sample_bytes > PART_BYTES // 2:
            # Shard 1 holds 6 MB: a part is already on the server, in an open upload.
            assert pending_uploads(fs, bucket) == ["x-01.tar"]

    sink = ShardWriter(f"s3://{bucket}/x-%02d.tar", maxcount=3, storage_options=options)
    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail(sink, samples(5, sample_bytes), upload_under_way)
    assert names(fs, bucket) == ["x-00.tar"]
    assert pending_uploads(fs, bucket) == []  # the multipart upload was aborted, not left over
    with tarfile.open(fileobj=fs.open(f"{bucket}/x-00.tar", "rb")) as tar:
        assert len(tar.getnames()) == 6


@pytest.mark.parametrize("sample_bytes", [1000, 400_000], ids=["one-shot", "resumable"])
def test_gcs_exception_inside_with_publishes_nothing(
    gcs_server: GCSServer, gcs_bucket: tuple[str, Any], sample_bytes: int
) -> None:
    bucket, fs = gcs_bucket
    # A 256 KiB block makes gcsfs start a resumable upload and send chunks before the close.
    options = {"gs": {**gcs_server.storage_options(), "block_size": 1 << 18}}
    sink = ShardWriter(f"gs://{bucket}/y-%02d.tar", maxcount=3, storage_options=options)
    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail(sink, samples(5, sample_bytes))
    assert names(fs, bucket) == ["y-00.tar"]


def test_missing_bucket_fails_on_close_naming_the_url(s3_server: S3Server) -> None:
    options = {"s3": s3_server.storage_options()}
    url = "s3://no-such-bucket-here/z.tar"
    writer = TarWriter(url, storage_options=options)
    writer.write({"__key__": "k", "txt": "x"})
    with pytest.raises(ShardOpenError, match=r"no-such-bucket-here/z\.tar"):
        writer.close()


def check_killed(fs: Any, bucket: str, url_base: str, options: Any) -> None:
    """Shards 0 and 1 are complete and readable; shard 2 (killed mid-way) does not exist."""
    assert names(fs, bucket) == ["train-000000.tar", "train-000001.tar"]
    shards = cloudshards.expand_urls(f"{url_base}/train-*.tar", storage_options=options)
    keys = [
        s["__key__"]
        for s in cloudshards.WebDataset(shards, shardshuffle=False, storage_options=options)
    ]
    assert keys == [f"k{index:03d}" for index in range(8)]


@pytest.mark.timeout(300)
def test_s3_killed_writer_leaves_no_complete_looking_shard(
    s3_server: S3Server, s3_bucket: tuple[str, Any], tmp_path: Path
) -> None:
    bucket, fs = s3_bucket
    # Credentials and endpoint from the environment, as a training job would have them.
    env = {**os.environ, **s3_server.env()}
    helpers.run_killed_writer(
        f"s3://{bucket}/train-%06d.tar",
        storage_options={"s3": {"default_block_size": PART_BYTES}},
        sample_bytes=3 << 20,  # shard 2 has 6 MB when killed: one part already uploaded
        env=env,
    )
    assert pending_uploads(fs, bucket) == ["train-000002.tar"]  # it really was mid-upload
    check_killed(fs, bucket, f"s3://{bucket}", {"s3": s3_server.storage_options()})
    # What a bucket lifecycle rule (AbortIncompleteMultipartUpload) would clean up:
    fs.clear_multipart_uploads(bucket)


@pytest.mark.timeout(300)
def test_gcs_killed_writer_leaves_no_complete_looking_shard(
    gcs_server: GCSServer, gcs_bucket: tuple[str, Any]
) -> None:
    bucket, fs = gcs_bucket
    env = {**os.environ, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    options = {"gs": {**gcs_server.storage_options(), "block_size": 1 << 18}}
    helpers.run_killed_writer(
        f"gs://{bucket}/train-%06d.tar", storage_options=options, sample_bytes=400_000, env=env
    )
    check_killed(fs, bucket, f"gs://{bucket}", {"gs": gcs_server.storage_options()})
