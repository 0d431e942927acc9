"""Session fixtures for the integration suite: real S3, GCS and HTTP servers on 127.0.0.1,
a synthetic WebDataset written with the stdlib ``tarfile``, and its copies on each server.

Servers never skip: a missing server binary or package fails the fixture with a fix-it hint.
"""

from __future__ import annotations

import os

# gcsfs picks its filesystem class at import time; with the experimental flag on (the default)
# it makes a gRPC/TLS call per bucket that times out after 60 s against an emulator.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import gzip
import io
import json
import random
import shutil
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from servers import (
    GCSServer,
    NginxServer,
    S3Server,
    ServerStartError,
)

BUCKET = "cloudshards-it"
SHARD_SIZES = (7, 13, 20, 3, 11, 16)  # deliberately uneven: workers finish at different times
SHARD_BRACE = f"train-{{000000..{len(SHARD_SIZES) - 1:06d}}}.tar"
SEED = 20240601
FIELDS = ("bin", "cls", "json")
# Variables that would let a backend find credentials or endpoints behind a test's back.
AMBIENT_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCLOUD_", "CLOUDSDK_")
AMBIENT_ENV_NAMES = ("STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST", "GCE_METADATA_IP")

Sample = dict[str, bytes]


@dataclass(frozen=True)
class LocalDataset:
    """The synthetic dataset on local disk.

    Attributes:
        root: Directory holding the shards.
        shards: Shard file names in order (``train-000000.tar`` ...).
        samples: key -> {"bin", "cls", "json"} bytes, in shard order then member order.
        shard_keys: The keys of each shard, in order.
        gz_shard: A gzipped copy of shard 0 (same samples as ``shard_keys[0]``).
        truncated_shard: A copy of shard ``truncated_from`` cut in the middle of a member's data.
        truncated_intact_keys: The keys whose members all lie before the cut.
    """

    root: Path
    shards: list[str]
    samples: dict[str, Sample]
    shard_keys: list[list[str]]
    gz_shard: str
    truncated_shard: str
    truncated_from: int
    truncated_intact_keys: list[str]
    brace: str = SHARD_BRACE

    def files(self) -> list[str]:
        """Every file to upload: the shards, the gzipped copy and the truncated copy."""
        return [*self.shards, self.gz_shard, self.truncated_shard]


@dataclass(frozen=True)
class RemoteDataset:
    """The dataset uploaded to one server.

    Attributes:
        protocol: ``"s3"``, ``"gs"`` or ``"http"``.
        base_url: Where the files live, e.g. ``s3://cloudshards-it``; no trailing slash.
        url: Brace URL of the six shards, e.g. ``s3://cloudshards-it/train-{000000..000005}.tar``.
        storage_options: Per-protocol options for ``wds.WebDataset`` (None for http).
        env: Environment variables that reach the server without options.
        local: The local dataset that was uploaded.
    """

    protocol: str
    base_url: str
    url: str
    storage_options: dict[str, dict[str, Any]] | None
    env: dict[str, str]
    local: LocalDataset
    server: Any = field(repr=False, default=None)

    def url_for(self, name: str) -> str:
        """Return the URL of one uploaded file (or a missing one, for error tests)."""
        return f"{self.base_url}/{name}"

    def shard_urls(self) -> list[str]:
        """Return the six shard URLs in order."""
        return [self.url_for(name) for name in self.local.shards]


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    """Write a PAX tar like webdataset's TarWriter: a float mtime puts a PAX header on each."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000.5  # a float mtime is what makes tarfile write the PAX header
            info.mode = 0o444
            info.uname = info.gname = "bigdata"
            tar.addfile(info, io.BytesIO(data))


def _truncate_mid_member(source: Path, target: Path) -> tuple[int, str]:
    """Copy ``source`` cut in the middle of the data of a ``.bin`` member past its midpoint.

    Returns the cut offset and the name of the member that was cut.
    """
    data = source.read_bytes()
    with tarfile.open(source, "r") as tar:
        members = tar.getmembers()
    victim = next(m for m in members if m.name.endswith(".bin") and m.offset_data > len(data) // 2)
    cut = victim.offset_data + victim.size // 2
    target.write_bytes(data[:cut])
    return cut, victim.name


def make_dataset(
    root: Path, sizes: tuple[int, ...] = SHARD_SIZES, seed: int = SEED
) -> LocalDataset:
    """Write the synthetic dataset under ``root`` and return its description."""
    rng = random.Random(seed)
    shards: list[str] = []
    samples: dict[str, Sample] = {}
    shard_keys: list[list[str]] = []
    index = 0
    for shard_index, size in enumerate(sizes):
        name = f"train-{shard_index:06d}.tar"
        keys: list[str] = []
        members: list[tuple[str, bytes]] = []
        for position in range(size):
            key = f"s{shard_index}-{position:04d}"
            sample = {
                "bin": rng.randbytes(rng.randint(1024, 6 * 1024)),
                "cls": str(index % 10).encode("ascii"),
                "json": json.dumps({"key": key, "index": index}, sort_keys=True).encode(),
            }
            members += [(f"{key}.{ext}", sample[ext]) for ext in FIELDS]
            samples[key] = sample
            keys.append(key)
            index += 1
        _write_tar(root / name, members)
        shards.append(name)
        shard_keys.append(keys)

    gz_shard = "train-000000.tar.gz"
    (root / gz_shard).write_bytes(gzip.compress((root / shards[0]).read_bytes(), mtime=0))

    truncated_from = 2
    truncated_shard = f"truncated-{truncated_from:06d}.tar"
    _, victim = _truncate_mid_member(root / shards[truncated_from], root / truncated_shard)
    victim_key = victim.split(".", 1)[0]
    keys = shard_keys[truncated_from]
    intact = keys[: keys.index(victim_key)]
    return LocalDataset(
        root=root,
        shards=shards,
        samples=samples,
        shard_keys=shard_keys,
        gz_shard=gz_shard,
        truncated_shard=truncated_shard,
        truncated_from=truncated_from,
        truncated_intact_keys=intact,
    )


_STARTED: list[str] = []  # one line per server started, for the terminal summary


def _start(factory: Any, *args: Any) -> Any:
    """Start a server, turning a start failure into a test failure (never a skip)."""
    try:
        server = factory(*args)
    except ServerStartError as exc:
        pytest.fail(str(exc), pytrace=False)
    name = getattr(server, "implementation", server.process.name)
    url = getattr(server, "endpoint_url", None) or server.base_url
    _STARTED.append(f"{name} at {url}, ready in {server.start_s:.2f} s")
    return server


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the servers this session started and how long each took to be ready."""
    if _STARTED:
        terminalreporter.write_sep("-", "integration servers")
        for line in _STARTED:
            terminalreporter.write_line(line)


def _check_gcsfs_flag() -> None:
    if "gcsfs" in sys.modules:
        import gcsfs

        if gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
            pytest.fail(
                "gcsfs was imported before integration/conftest.py set "
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; every bucket call would hang 60 s. "
                "Export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before running pytest.",
                pytrace=False,
            )


# ------------------------------------------------------------------------------ servers


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server subprocess with IAM auth enforced (a wrong secret gets 403)."""
    server: S3Server = _start(S3Server.start, tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    """A fake-gcs-server subprocess (gcp-storage-emulator if the Go binary cannot run)."""
    _check_gcsfs_flag()
    server: GCSServer = _start(GCSServer.start, tmp_path_factory.mktemp("gcs"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxServer]:
    """nginx serving ``http_server.root`` with Range support; ``access_log()`` lists requests."""
    server: NginxServer = _start(NginxServer.start, tmp_path_factory.mktemp("nginx"))
    try:
        yield server
    finally:
        server.close()


# ------------------------------------------------------------------------------ datasets


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> LocalDataset:
    """Six uneven PAX shards (7, 13, 20, 3, 11, 16 samples) plus a .tar.gz and a truncated copy."""
    return make_dataset(tmp_path_factory.mktemp("dataset"))


def _upload(fs: Any, local: LocalDataset) -> None:
    fs.mkdir(BUCKET)
    names = local.files()
    fs.put([str(local.root / name) for name in names], [f"{BUCKET}/{name}" for name in names])
    listed = sorted(path.rsplit("/", 1)[-1] for path in fs.ls(BUCKET, refresh=True))
    assert listed == sorted(names), f"upload incomplete: {listed}"


@pytest.fixture(scope="session")
def s3_dataset(s3_server: S3Server, dataset: LocalDataset) -> RemoteDataset:
    """The dataset in ``s3://cloudshards-it`` on moto, with ``storage_options["s3"]``."""
    _upload(s3_server.filesystem(), dataset)
    return RemoteDataset(
        protocol="s3",
        base_url=f"s3://{BUCKET}",
        url=f"s3://{BUCKET}/{dataset.brace}",
        storage_options={"s3": s3_server.storage_options()},
        env=s3_server.env(),
        local=dataset,
        server=s3_server,
    )


@pytest.fixture(scope="session")
def gcs_dataset(gcs_server: GCSServer, dataset: LocalDataset) -> RemoteDataset:
    """The dataset in ``gs://cloudshards-it`` on the emulator, with ``storage_options["gs"]``."""
    _upload(gcs_server.filesystem(), dataset)
    return RemoteDataset(
        protocol="gs",
        base_url=f"gs://{BUCKET}",
        url=f"gs://{BUCKET}/{dataset.brace}",
        storage_options={"gs": gcs_server.storage_options()},
        env=gcs_server.env(),
        local=dataset,
        server=gcs_server,
    )


@pytest.fixture(scope="session")
def http_dataset(http_server: NginxServer, dataset: LocalDataset) -> RemoteDataset:
    """The dataset under ``http://127.0.0.1:PORT/cloudshards-it/`` on nginx (no options)."""
    target = http_server.root / BUCKET
    target.mkdir(parents=True, exist_ok=True)
    for name in dataset.files():
        shutil.copyfile(dataset.root / name, target / name)
    base_url = http_server.url_for(BUCKET)
    return RemoteDataset(
        protocol="http",
        base_url=base_url,
        url=f"{base_url}/{dataset.brace}",
        storage_options=None,
        env={},
        local=dataset,
        server=http_server,
    )


REMOTE_FIXTURES = {"s3": "s3_dataset", "gs": "gcs_dataset", "http": "http_dataset"}


@pytest.fixture(params=sorted(REMOTE_FIXTURES))
def remote_dataset(request: pytest.FixtureRequest) -> RemoteDataset:
    """Each remote copy of the dataset in turn (parametrized: gs, http, s3)."""
    dataset: RemoteDataset = request.getfixturevalue(REMOTE_FIXTURES[request.param])
    return dataset


@pytest.fixture(autouse=True)
def clean_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Remove ambient cloud credentials/endpoints so each test states what it uses."""
    for name in list(os.environ):
        if name.startswith(AMBIENT_ENV_PREFIXES) or name in AMBIENT_ENV_NAMES:
            monkeypatch.delenv(name)
    # No ~/.aws files and no EC2 metadata probing (1 s timeouts) when credentials are missing.
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    from cloudshards.source import adapt, objstore

    adapt.forget()  # part sizes measured by earlier tests
    # Stores and endpoint verdicts (a GCS emulator's XML API) of earlier tests' servers,
    # keyed by an endpoint whose port a later test's server may reuse.
    objstore.forget()
    from cloudshards.source import budget

    # The node's request slots and shared backoff: a directory of the test's own, so that a
    # throttling test does not make the next ones wait.
    # (Outside the test's own tmp_path: tests check which files appear there.)
    monkeypatch.setenv("CLOUDSHARDS_NODE_DIR", str(tmp_path_factory.mktemp("node")))
    budget.forget()
