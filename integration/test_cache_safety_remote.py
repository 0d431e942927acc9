"""The node cache's checksum rules against real servers and real clients.

A reverse proxy in front of each server plays the part the real world plays: a CDN or an
SSE-KMS bucket whose ETag is 32 hex digits and no MD5 (in front of nginx, and of moto with
IAM auth, the ``x-amz-server-side-encryption: aws:kms`` header included), and a bad link that
flips a byte of a GCS download (fake-gcs-server, whose ``crc32c`` and ``md5Hash`` are
checksums the cache does trust; it verifies the CRC32C) or a GCS object whose checksums are
not of what it serves.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import http.server
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import google_crc32c
import pytest
from servers import gcs_download_name

import cloudshards as wds
from cloudshards.cache import entry_name
from cloudshards.cache.tee import TeeStream
from cloudshards.errors import ShardOpenError

if TYPE_CHECKING:
    from conftest import RemoteDataset
    from servers import GCSServer, NginxServer, S3Server

Sample = dict[str, bytes]


# ------------------------------------------------------------------------------ the proxy


@dataclass
class Exchange:
    """One request and its response, which a rewrite may change before it is sent on."""

    method: str
    path: str
    request_headers: dict[str, str]
    status: int = 0
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def set_header(self, name: str, value: str) -> None:
        self.headers = [(k, v) for k, v in self.headers if k.lower() != name.lower()]
        self.headers.append((name, value))

    def range_start(self) -> int:
        """Where the body starts in the object (0 without a Range header)."""
        match = re.match(r"bytes=(\d+)-", self.request_headers.get("range", ""))
        return int(match.group(1)) if match else 0


class RewritingProxy(http.server.ThreadingHTTPServer):
    """A reverse proxy that lets a test rewrite requests and responses, and records them.

    The Host header is passed through unchanged, so SigV4 signatures made for the proxy's
    address still verify upstream.
    """

    daemon_threads = True

    def __init__(
        self,
        upstream: str,
        on_request: Callable[[Exchange], None] | None = None,
        on_response: Callable[[Exchange], None] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.on_request = on_request
        self.on_response = on_response
        self.requests: list[Exchange] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _RewritingHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def take(self) -> list[Exchange]:
        with self.lock:
            taken, self.requests = self.requests, []
        return taken


class _RewritingHandler(http.server.BaseHTTPRequestHandler):
    server: RewritingProxy
    _HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k.lower(): v for k, v in self.headers.items() if k.lower() not in self._HOP}
        exchange = Exchange(self.command, self.path, headers)
        if self.server.on_request is not None:
            self.server.on_request(exchange)
        upstream = http.client.HTTPConnection(
            self.server.upstream_host, self.server.upstream_port, timeout=60
        )
        try:
            upstream.request(self.command, self.path, body=body, headers=exchange.request_headers)
            response = upstream.getresponse()
            exchange.status, exchange.reason = response.status, response.reason
            upstream_length = response.getheader("Content-Length")
            exchange.body = response.read()
            exchange.headers = [
                (k, v)
                for k, v in response.getheaders()
                if k.lower() not in self._HOP and k.lower() not in ("date", "server")
            ]
        finally:
            upstream.close()
        if self.server.on_response is not None:
            self.server.on_response(exchange)
        with self.server.lock:
            self.server.requests.append(exchange)
        self.send_response(exchange.status, exchange.reason)
        for key, value in exchange.headers:
            self.send_header(key, value)
        # A HEAD response has no body but the length of the GET's (fsspec's size lookup).
        length = upstream_length if self.command == "HEAD" else str(len(exchange.body))
        self.send_header("Content-Length", length or "0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(exchange.body)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def proxies() -> Iterator[Callable[..., RewritingProxy]]:
    """Factory: ``start(upstream, on_request=..., on_response=...)``; all shut at teardown."""
    started: list[tuple[RewritingProxy, threading.Thread]] = []

    def start(upstream: str, **hooks: Any) -> RewritingProxy:
        proxy = RewritingProxy(upstream, **hooks)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        started.append((proxy, thread))
        return proxy

    yield start
    for proxy, thread in started:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


# ------------------------------------------------------------------------------ helpers


def _fields(sample: dict[str, Any]) -> Sample:
    return {k: v for k, v in sample.items() if not k.startswith("__")}


def _read(ds: Any) -> dict[str, Sample]:
    return {s["__key__"]: _fields(s) for s in ds}


def _expected(dataset: RemoteDataset, shards: range | list[int]) -> dict[str, Sample]:
    local = dataset.local
    return {key: local.samples[key] for i in shards for key in local.shard_keys[i]}


def _entries(cache_dir: Path) -> list[str]:
    data = cache_dir / "data"
    return sorted(p.name for p in data.iterdir()) if data.is_dir() else []


def _opaque(etag: str) -> str:
    """An ETag as an SSE-KMS object or a CDN has it: 32 hex digits, not the body's MD5."""
    real = etag.strip().strip('"')
    return '"' + hashlib.md5(f"kms:{real}".encode()).hexdigest() + '"'


def _cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("cloudshards")
    ]


# ------------------------------------------------------------------------------ opaque ETags


@pytest.mark.timeout(120)
def test_http_etag_that_looks_like_an_md5_is_not_a_checksum(
    http_dataset: RemoteDataset,
    proxies: Callable[..., RewritingProxy],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nginx behind a "CDN" whose ETags are 32 hex digits but no MD5: every shard is read,
    cached, and served from the cache the next epoch (no object GET at all)."""
    server: NginxServer = http_dataset.server

    rewritten: list[str] = []

    def opaque_etag(exchange: Exchange) -> None:
        etag = exchange.header("ETag")
        if etag is not None:
            exchange.set_header("ETag", _opaque(etag))
            rewritten.append(exchange.path)

    proxy = proxies(server.url_for(""), on_response=opaque_etag)
    urls = [proxy.url + urlsplit(u).path for u in http_dataset.shard_urls()]
    cache_dir = tmp_path / "cache"
    for epoch in range(2):
        ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir))
        assert _read(ds) == _expected(http_dataset, range(len(urls))), f"epoch {epoch}"
        gets = [e for e in proxy.take() if e.method == "GET"]
        if epoch == 0:
            assert gets, "the first epoch fetched nothing"
            assert rewritten, "nginx sent no ETag to rewrite"
        else:
            assert gets == [], f"second epoch fetched {[e.path for e in gets]}"
    assert _entries(cache_dir) == sorted(entry_name(u) for u in urls)
    assert _cache_warnings(caplog) == []


@pytest.mark.timeout(120)
def test_s3_sse_kms_etag_is_not_a_checksum(
    s3_dataset: RemoteDataset,
    proxies: Callable[..., RewritingProxy],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """moto (IAM auth on) behind a proxy that makes every object look SSE-KMS encrypted: an
    opaque ETag and ``x-amz-server-side-encryption: aws:kms``. s3fs reads them, the cache
    caches them, and the second epoch makes no object GET."""
    server: S3Server = s3_dataset.server
    real_of: dict[str, str] = {}

    def kms(exchange: Exchange) -> None:
        etag = exchange.header("ETag")
        if etag is not None:
            real_of[_opaque(etag)] = etag
            exchange.set_header("ETag", _opaque(etag))
            exchange.set_header("x-amz-server-side-encryption", "aws:kms")
            exchange.set_header("x-amz-server-side-encryption-aws-kms-key-id", "arn:aws:kms:k")
        if b"<ETag>" in exchange.body:  # listings carry the ETags too
            exchange.body = re.sub(
                rb"<ETag>([^<]*)</ETag>",
                lambda m: b"<ETag>" + _opaque(m.group(1).decode()).encode() + b"</ETag>",
                exchange.body.replace(b"&quot;", b'"'),
            )

    # If-Match headers go upstream as the client sent them (the opaque ETag): they are signed
    # (SigV4), so a proxy cannot translate them; moto answers 412 for an ETag it never made,
    # and the reader goes on without the condition once the object's ETag proves unchanged.
    proxy = proxies(server.endpoint_url, on_response=kms)
    assert s3_dataset.storage_options is not None
    options = {"s3": {**s3_dataset.storage_options["s3"], "endpoint_url": proxy.url}}
    urls = s3_dataset.shard_urls()
    cache_dir = tmp_path / "cache"
    for epoch in range(2):
        ds = wds.WebDataset(
            urls, shardshuffle=False, cache_dir=str(cache_dir), storage_options=options
        )
        assert _read(ds) == _expected(s3_dataset, range(len(urls))), f"epoch {epoch}"
        gets = [e for e in proxy.take() if e.method == "GET" and "list-type" not in e.path]
        if epoch == 0:
            assert gets
            served = [e for e in gets if e.status in (200, 206)]  # not a refused If-Match
            assert served
            assert all(e.header("x-amz-server-side-encryption") for e in served)
        else:
            assert gets == [], f"second epoch fetched {[e.path for e in gets]}"
    assert _entries(cache_dir) == sorted(entry_name(u, proxy.url) for u in urls)
    assert _cache_warnings(caplog) == []


# ---------------------------------------------------------------- GCS crc32c and md5Hash


@pytest.fixture(params=["obstore", "fsspec"])
def gcs_options(
    gcs_dataset: RemoteDataset, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[[RewritingProxy], dict[str, Any]]:
    """The GCS options through a proxy, read by each transport in turn: obstore (the XML API,
    checksums from one metadata request) and gcsfs (the JSON API, checksums from its open)."""
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", request.param)
    assert gcs_dataset.storage_options is not None
    base = gcs_dataset.storage_options["gs"]
    return lambda proxy: {"gs": {**base, "endpoint_url": proxy.url}}


def _flip_once(name: str, offset: int) -> tuple[Callable[[Exchange], None], list[int]]:
    """A response hook that flips the byte at ``offset`` of object ``name`` in the first
    download that carries it; the list counts the downloads of that object that did."""
    flipped: list[int] = []

    def flip(exchange: Exchange) -> None:
        if gcs_download_name(exchange.path) != name:
            return
        start = exchange.range_start()
        if exchange.status in (200, 206) and start <= offset < start + len(exchange.body):
            flipped.append(start)
            if len(flipped) == 1:
                body = bytearray(exchange.body)
                body[offset - start] ^= 0xFF
                exchange.body = bytes(body)

    return flip, flipped


@pytest.mark.timeout(120)
def test_gcs_byte_corrupted_in_transit_is_fetched_again(
    gcs_dataset: RemoteDataset,
    gcs_server: GCSServer,
    gcs_options: Callable[[RewritingProxy], dict[str, Any]],
    proxies: Callable[..., RewritingProxy],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """fake-gcs-server, one byte flipped on the way: the crc32c catches it
    before the reader sees the end of the shard, a second download replaces it, the samples
    and the entry are right."""
    local = gcs_dataset.local
    name = local.shards[1]
    source = local.root / name
    assert source.stat().st_size <= TeeStream.HOLD_BYTES  # all of it is verified first
    flip, flipped = _flip_once(name, source.stat().st_size // 2)
    proxy = proxies(gcs_server.endpoint_url, on_response=flip)
    url = gcs_dataset.url_for(name)
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(
        [url], shardshuffle=False, cache_dir=str(cache_dir), storage_options=gcs_options(proxy)
    )
    assert _read(ds) == _expected(gcs_dataset, [1])
    assert len(flipped) == 2  # the bad download, and the one that replaced it
    entry = cache_dir / "data" / entry_name(url, proxy.url)
    assert entry.read_bytes() == source.read_bytes()
    (warning,) = _cache_warnings(caplog)
    assert "fetched it again" in warning
    # The server's crc32c (from gcsfs's open, or obstore's metadata request) verified it.
    meta = json.loads((cache_dir / "meta" / f"{entry.name}.json").read_text())
    assert meta["checksum"] == f"crc32c:{google_crc32c.value(source.read_bytes()):08x}"


@pytest.mark.timeout(120)
def test_gcs_corrupted_bytes_already_served_reach_the_handler(
    gcs_dataset: RemoteDataset,
    gcs_server: GCSServer,
    gcs_options: Callable[[RewritingProxy], dict[str, Any]],
    proxies: Callable[..., RewritingProxy],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte flipped early in the shard, before the held-back end: the reader has it
    already, so it gets a ShardOpenError through its handler (never from close), nothing is
    cached, and the next read is right."""
    monkeypatch.setattr(TeeStream, "HOLD_BYTES", 4096)
    local = gcs_dataset.local
    name = local.shards[2]
    source = local.root / name
    flip, _ = _flip_once(name, 2048)
    proxy = proxies(gcs_server.endpoint_url, on_response=flip)
    url = gcs_dataset.url_for(name)
    cache_dir = tmp_path / "cache"
    errors: list[BaseException] = []

    def handler(exn: BaseException) -> bool:
        errors.append(exn)
        return True

    options = gcs_options(proxy)
    ds = wds.WebDataset(
        [url], shardshuffle=False, cache_dir=str(cache_dir), storage_options=options
    )
    ds_handled = wds.WebDataset(
        [url],
        shardshuffle=False,
        cache_dir=str(cache_dir),
        storage_options=options,
        handler=handler,
    )
    _read(ds_handled)
    (error,) = errors
    assert isinstance(error, ShardOpenError)
    assert "checksum" in str(error)
    assert _entries(cache_dir) == []
    assert _read(ds) == _expected(gcs_dataset, [2])
    assert (cache_dir / "data" / entry_name(url, proxy.url)).read_bytes() == source.read_bytes()


@pytest.mark.timeout(120)
def test_gcs_checksums_that_are_not_of_the_bytes_stream_uncached(
    gcs_dataset: RemoteDataset,
    gcs_server: GCSServer,
    gcs_options: Callable[[RewritingProxy], dict[str, Any]],
    proxies: Callable[..., RewritingProxy],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An object whose crc32c and md5Hash are not of what the store serves: two downloads
    agree, the samples are right, the shard is not cached, one warning, nothing raises."""
    name = gcs_dataset.local.shards[3]

    def wrong_checksums(exchange: Exchange) -> None:
        if gcs_download_name(exchange.path) is None and b'"md5Hash"' in exchange.body:
            body = re.sub(
                rb'"md5Hash": ?"[^"]*"', b'"md5Hash": "AQEBAQEBAQEBAQEBAQEBAQ=="', exchange.body
            )
            exchange.body = re.sub(rb'"crc32c": ?"[^"]*"', b'"crc32c": "AQEBAQ=="', body)

    proxy = proxies(gcs_server.endpoint_url, on_response=wrong_checksums)
    url = gcs_dataset.url_for(name)
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(
        [url], shardshuffle=False, cache_dir=str(cache_dir), storage_options=gcs_options(proxy)
    )
    assert _read(ds) == _expected(gcs_dataset, [3])
    media = collections.Counter(
        e.range_start()
        for e in proxy.take()
        if e.method == "GET" and gcs_download_name(e.path) == name
    )
    assert media[0] == 2  # downloaded twice from the start
    assert _entries(cache_dir) == []
    (warning,) = _cache_warnings(caplog)
    assert "checksum" in warning
