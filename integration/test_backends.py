"""The same shards read through local paths, file://, s3:// (moto), gs:// (fake-gcs-server) and
http:// (nginx) give the same samples; errors name the URL and never leak signed-URL secrets."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

import cloudshards as wds

if TYPE_CHECKING:
    from conftest import LocalDataset, RemoteDataset
    from servers import NginxServer, S3Server

SECRET = "SECRET123"
SIGNED_QUERY = f"?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIAEXAMPLE"
BACKENDS = ("local", "file", "s3", "gs", "http")
REMOTE_FIXTURES = {"s3": "s3_dataset", "gs": "gcs_dataset", "http": "http_dataset"}


@dataclass(frozen=True)
class Source:
    """One way of reaching the dataset: a URL prefix plus the options it needs."""

    name: str
    base_url: str
    storage_options: dict[str, dict[str, Any]] | None
    local: LocalDataset

    def url_for(self, name: str) -> str:
        return f"{self.base_url}/{name}"

    @property
    def url(self) -> str:
        return self.url_for(self.local.brace)


@pytest.fixture(params=BACKENDS)
def source(request: pytest.FixtureRequest, dataset: LocalDataset) -> Source:
    """The dataset reached through each backend in turn, with explicit storage options."""
    if request.param == "local":
        return Source("local", str(dataset.root), None, dataset)
    if request.param == "file":
        return Source("file", f"file://{dataset.root}", None, dataset)
    remote: RemoteDataset = request.getfixturevalue(REMOTE_FIXTURES[request.param])
    return Source(request.param, remote.base_url, remote.storage_options, dataset)


def read(url: str | list[str], storage_options: Any = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Read every sample of ``url`` in order (shardshuffle=False)."""
    ds = wds.WebDataset(url, shardshuffle=False, storage_options=storage_options, **kwargs)
    return list(ds)


def fields_of(sample: dict[str, Any]) -> dict[str, Any]:
    """The sample without its ``__key__``/``__url__`` metadata."""
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def assert_samples(
    samples: list[dict[str, Any]],
    local: LocalDataset,
    keys: Iterable[str],
    url_of_key: Callable[[str], str] | None = None,
) -> None:
    """Check keys (in order), field bytes and, when given, each sample's ``__url__``."""
    assert [s["__key__"] for s in samples] == list(keys)
    for sample in samples:
        key = sample["__key__"]
        assert fields_of(sample) == local.samples[key], f"fields differ for sample {key}"
        if url_of_key is not None:
            assert sample["__url__"] == url_of_key(key), f"__url__ of {key}"


def shard_url_of_key(source: Source) -> Callable[[str], str]:
    """Map a key to the URL of the shard that holds it."""
    owner = {
        key: source.url_for(shard)
        for shard, keys in zip(source.local.shards, source.local.shard_keys, strict=True)
        for key in keys
    }
    return owner.__getitem__


def iterate_until_error(
    url: str, storage_options: Any = None
) -> tuple[list[dict[str, Any]], BaseException | None]:
    """Collect samples until the pipeline raises; return them and the error (or None)."""
    samples: list[dict[str, Any]] = []
    ds = wds.WebDataset(url, shardshuffle=False, storage_options=storage_options)
    try:
        for sample in ds:
            samples.append(sample)
    except Exception as exc:
        return samples, exc
    return samples, None


# ------------------------------------------------------------------- harness self-checks


@pytest.mark.parametrize("backend", sorted(REMOTE_FIXTURES))
def test_harness_serves_uploaded_bytes(request: pytest.FixtureRequest, backend: str) -> None:
    """The servers hold byte-identical copies (checked without cloudshards)."""
    remote: RemoteDataset = request.getfixturevalue(REMOTE_FIXTURES[backend])
    fs = None if backend == "http" else remote.server.filesystem()
    for name in remote.local.files():
        expected = (remote.local.root / name).read_bytes()
        if fs is None:
            with urllib.request.urlopen(remote.url_for(name), timeout=10) as response:
                got = response.read()
        else:
            got = fs.cat_file(f"cloudshards-it/{name}")
        assert got == expected, name


def test_harness_nginx_ranges_and_query(http_dataset: RemoteDataset) -> None:
    """nginx answers Range with 206 and ignores query strings."""
    url = http_dataset.url_for("train-000000.tar") + SIGNED_QUERY
    request = urllib.request.Request(url, headers={"Range": "bytes=512-1023"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 206
        assert response.headers["Content-Range"].startswith("bytes 512-1023/")
        body = response.read()
    assert body == (http_dataset.local.root / "train-000000.tar").read_bytes()[512:1024]
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        urllib.request.urlopen(http_dataset.url_for("nope.tar"), timeout=10)
    assert excinfo.value.code == 404
    excinfo.value.close()


def test_harness_moto_enforces_auth(s3_server: S3Server, s3_dataset: RemoteDataset) -> None:
    """moto is started with IAM auth on: the right key with a wrong secret is refused."""
    import s3fs

    bad = s3fs.S3FileSystem(
        skip_instance_cache=True, **{**s3_server.storage_options(), "secret": "wrong"}
    )
    with pytest.raises(PermissionError):
        bad.cat_file("cloudshards-it/train-000000.tar")
    assert s3_server.filesystem().cat_file("cloudshards-it/train-000003.tar")


# ------------------------------------------------------------------------- same samples


def test_backend_reads_expected_samples(source: Source) -> None:
    """Each backend yields exactly the generated samples, in shard order, with ``__url__``."""
    samples = read(source.url, source.storage_options)
    assert_samples(samples, source.local, source.local.samples, shard_url_of_key(source))


def test_all_backends_identical(request: pytest.FixtureRequest, dataset: LocalDataset) -> None:
    """Local, file://, s3://, gs:// and http:// give identical samples (ignoring ``__url__``)."""
    urls: dict[str, tuple[str, Any]] = {
        "local": (str(dataset.root / dataset.brace), None),
        "file": (f"file://{dataset.root}/{dataset.brace}", None),
    }
    for backend, fixture in REMOTE_FIXTURES.items():
        remote: RemoteDataset = request.getfixturevalue(fixture)
        urls[backend] = (remote.url, remote.storage_options)
    results = {name: read(url, options) for name, (url, options) in urls.items()}
    reference = [(s["__key__"], fields_of(s)) for s in results["local"]]
    assert len(reference) == sum(len(keys) for keys in dataset.shard_keys)
    for name, samples in results.items():
        assert [(s["__key__"], fields_of(s)) for s in samples] == reference, name


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_env_only_credentials(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """With no storage_options, s3fs/gcsfs find the server through the environment alone."""
    remote: RemoteDataset = request.getfixturevalue(REMOTE_FIXTURES[backend])
    for name, value in remote.env.items():
        monkeypatch.setenv(name, value)
    samples = read(remote.url)
    assert_samples(samples, remote.local, remote.local.samples)


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_glob_matches_brace(request: pytest.FixtureRequest, backend: str) -> None:
    """``train-*.tar`` expands to the six shards (not the .tar.gz or truncated copies)."""
    remote: RemoteDataset = request.getfixturevalue(REMOTE_FIXTURES[backend])
    samples = read(remote.url_for("train-*.tar"), remote.storage_options)
    assert_samples(samples, remote.local, remote.local.samples)


def test_gzip_shard(source: Source) -> None:
    """A gzipped shard yields the same samples as the plain one."""
    url = source.url_for(source.local.gz_shard)
    samples = read(url, source.storage_options)
    assert_samples(samples, source.local, source.local.shard_keys[0], lambda _key: url)


def test_mixed_backends_in_one_list(request: pytest.FixtureRequest, dataset: LocalDataset) -> None:
    """A list of URLs on different backends, with per-protocol options, reads in list order."""
    remotes: list[RemoteDataset] = [
        request.getfixturevalue(fixture)
        for fixture in ("s3_dataset", "gcs_dataset", "http_dataset")
    ]
    options: dict[str, dict[str, Any]] = {}
    for remote in remotes:
        options.update(remote.storage_options or {})
    urls = [remotes[i % 3].url_for(name) for i, name in enumerate(dataset.shards)]
    samples = read(urls, options)
    assert_samples(samples, dataset, dataset.samples)


def test_double_colon_joined_brace_urls(
    s3_dataset: RemoteDataset, gcs_dataset: RemoteDataset
) -> None:
    """``"A::B"`` reads A's shards then B's (webdataset's multi-URL syntax)."""
    url = (
        s3_dataset.url_for("train-{000000..000002}.tar")
        + "::"
        + gcs_dataset.url_for("train-{000003..000005}.tar")
    )
    options = {**(s3_dataset.storage_options or {}), **(gcs_dataset.storage_options or {})}
    samples = read(url, options)
    assert_samples(samples, s3_dataset.local, s3_dataset.local.samples)


def test_decode_to_tuple(remote_dataset: RemoteDataset) -> None:
    """``.decode().to_tuple("json", "cls")`` gives dicts and ints."""
    ds = wds.WebDataset(
        remote_dataset.url, shardshuffle=False, storage_options=remote_dataset.storage_options
    )
    rows = list(ds.decode().to_tuple("json", "cls"))
    assert len(rows) == len(remote_dataset.local.samples)
    for index, (meta, cls) in enumerate(rows):
        assert isinstance(meta, dict)
        assert meta["index"] == index
        assert cls == index % 10
        assert isinstance(cls, int)


# ------------------------------------------------------------------------------- errors


@pytest.mark.timeout(90)
def test_missing_object_raises_shard_open_error(source: Source) -> None:
    """A missing object raises ShardOpenError (an OSError) naming the URL."""
    with pytest.raises(wds.ShardOpenError) as excinfo:
        read(source.url_for("nope-{0..1}.tar"), source.storage_options)
    assert isinstance(excinfo.value, OSError)
    assert source.url_for("nope-0.tar") in str(excinfo.value)


@pytest.mark.timeout(90)
def test_bad_s3_credentials_raise_shard_open_error(s3_dataset: RemoteDataset) -> None:
    """The right access key with a wrong secret (moto enforces auth here) fails to open."""
    assert s3_dataset.storage_options is not None
    options = {"s3": {**s3_dataset.storage_options["s3"], "secret": "wrong-secret"}}
    url = s3_dataset.url_for("train-000000.tar")
    with pytest.raises(wds.ShardOpenError) as excinfo:
        read(url, options)
    assert url in str(excinfo.value)
    assert "wrong-secret" not in str(excinfo.value)


def _wait_for_logged(server: NginxServer, needle: str, timeout_s: float = 5.0) -> list[str]:
    """nginx logs a request just after answering it: poll the log for a bounded time."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = server.access_log()
        if any(needle in line for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_signed_url_query_is_sent_and_served(http_dataset: RemoteDataset) -> None:
    """A presigned-style URL reaches the server with its query and reads normally."""
    http_server: NginxServer = http_dataset.server
    http_server.clear_access_log()
    url = http_dataset.url_for("train-000000.tar") + SIGNED_QUERY
    samples = read(url)
    assert_samples(samples, http_dataset.local, http_dataset.local.shard_keys[0])
    lines = _wait_for_logged(http_server, SECRET)
    assert any(f"X-Amz-Signature={SECRET}" in line for line in lines), lines


@pytest.mark.timeout(90)
def test_signed_url_404_does_not_leak_secret(http_dataset: RemoteDataset) -> None:
    """A 404 on a presigned-style URL names the shard but not the query string."""
    url = http_dataset.url_for("nope-0.tar") + SIGNED_QUERY
    with pytest.raises(wds.ShardOpenError) as excinfo:
        read(url)
    error = excinfo.value
    assert http_dataset.url_for("nope-0.tar") in str(error)
    for text in (str(error), repr(error), *map(str, error.args)):
        assert SECRET not in text
    assert SECRET not in str(getattr(error, "url", ""))


@pytest.mark.timeout(90)
def test_truncated_shard_raises_format_error(source: Source) -> None:
    """A shard cut mid-member raises ShardFormatError naming the URL, after intact samples only."""
    url = source.url_for(source.local.truncated_shard)
    samples, error = iterate_until_error(url, source.storage_options)
    assert isinstance(error, wds.ShardFormatError), repr(error)
    assert isinstance(error, ValueError)
    assert url in str(error)
    intact = source.local.truncated_intact_keys
    assert intact, "the dataset's truncated shard should have intact samples before the cut"
    # Every complete sample before the damage, none after it.
    assert_samples(samples, source.local, intact)
