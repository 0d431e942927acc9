"""GCS shards read through obstore (the default where it can) give what gcsfs gives, with the
credentials and endpoints users give gcsfs today; what obstore cannot take falls back to
gcsfs; errors stay clear; parts of a replaced object are never stitched together."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from servers import gcs_download_name
from test_cache_safety_remote import RewritingProxy, proxies  # noqa: F401 - the fixture
from test_transport_remote import (
    _changing_tar,
    _publish,
    all_keys,
    keys_of,
    samples_of,
    transport_of,
)

import cloudshards as wds
from cloudshards.errors import ConfigError, ShardOpenError
from cloudshards.source.remote import FsspecObject

if TYPE_CHECKING:
    from conftest import RemoteDataset


def xml_downloads(proxy: RewritingProxy) -> list[str]:
    """Paths of the object GETs obstore sent (GCS's XML API: ``/bucket/object``)."""
    return [e.path for e in proxy.take() if e.method == "GET" and "/storage/v1/" not in e.path]


def test_a_given_token_is_the_bearer_obstore_sends(
    gcs_dataset: RemoteDataset,
    gcs_server: Any,
    proxies: Callable[..., RewritingProxy],  # noqa: F811 - the imported fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``google.auth`` credentials object as ``token=`` (one of the forms gcsfs takes): every
    object GET carries its access token, as gcsfs's own requests do, and no error or log
    shows it."""
    from google.oauth2.credentials import Credentials

    expiry = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
    token = Credentials(token="ya29.integration-token", expiry=expiry + datetime.timedelta(hours=1))
    proxy = proxies(gcs_server.endpoint_url)
    options = {"gs": {"endpoint_url": proxy.url, "token": token}}
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    url = gcs_dataset.url_for(gcs_dataset.local.shards[0])
    assert [key for key, _ in samples_of(url, options)] == gcs_dataset.local.shard_keys[0]
    sent = [e for e in proxy.requests if e.method == "GET"]
    assert sent
    assert all(e.request_headers.get("authorization") == f"Bearer {token.token}" for e in sent)
    assert xml_downloads(proxy)  # through obstore, not gcsfs's JSON API


def test_requester_pays_falls_back_to_gcsfs(
    gcs_dataset: RemoteDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"gs": {**gcs_dataset.storage_options["gs"], "requester_pays": True}}
    assert transport_of(gcs_dataset.url_for(gcs_dataset.local.shards[0]), options) is FsspecObject
    assert keys_of(gcs_dataset.url, options) == all_keys(gcs_dataset)
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    with pytest.raises(ConfigError, match="requester_pays"):
        keys_of(gcs_dataset.url, options)


def test_an_emulator_without_the_xml_api_is_read_through_gcsfs(
    gcs_dataset: RemoteDataset,
    gcs_server: Any,
    proxies: Callable[..., RewritingProxy],  # noqa: F811 - the imported fixture
    caplog: pytest.LogCaptureFixture,
) -> None:
    """fake-gcs-server started without ``-public-host`` (here: a Host it does not take as its
    own) answers the XML API with 404: one HEAD tells, the shards are read through gcsfs, and
    one WARNING says how to fix it."""

    def foreign_host(exchange: Any) -> None:
        exchange.request_headers["host"] = "emulator.invalid:4443"

    proxy = proxies(gcs_server.endpoint_url, on_request=foreign_host)
    options = {"gs": {"endpoint_url": proxy.url, "token": "anon"}}
    caplog.set_level("WARNING", logger="cloudshards.fetch")
    assert keys_of(gcs_dataset.url, options) == all_keys(gcs_dataset)
    assert keys_of(gcs_dataset.url, options) == all_keys(gcs_dataset)  # decided once
    sent = proxy.take()
    assert [e.method for e in sent if "/storage/v1/" not in e.path] == ["HEAD"]
    (warning,) = [r.getMessage() for r in caplog.records if "XML API" in r.getMessage()]
    assert "-public-host" in warning
    assert "through gcsfs" in warning


def test_a_retried_first_part_asks_for_the_generation_it_saw(
    gcs_dataset: RemoteDataset,
    gcs_server: Any,
    proxies: Callable[..., RewritingProxy],  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> None:
    """In a versioned bucket (old generations stay readable), the first part's answer is cut
    short and the object replaced before the retry: the retry asks for the generation the
    later parts are pinned to, so the whole read is that generation; never the new first
    part with the old rest."""
    old, new = tmp_path / "old.tar", tmp_path / "new.tar"
    _changing_tar(old, 1)
    _changing_tar(new, 2)
    gcs_server.filesystem().mkdir("cloudshards-versioned", enable_versioning=True)
    target = "cloudshards-versioned/retried-first.tar"

    def publish(source: Path) -> None:
        _publish(gcs_dataset, "gcs", source, "retried-first.tar", bucket="cloudshards-versioned")

    publish(old)
    cut: list[int] = []

    def cut_first_and_replace(exchange: Any) -> None:
        first = exchange.method == "GET" and exchange.range_start() == 0
        if cut or not first or gcs_download_name(exchange.path) != "retried-first.tar":
            return
        cut.append(len(exchange.body))
        exchange.body = exchange.body[: len(exchange.body) // 2]
        publish(new)

    proxy = proxies(gcs_server.endpoint_url, on_response=cut_first_and_replace)
    options = {"gs": {"endpoint_url": proxy.url, "token": "anon"}}
    read = samples_of(f"gs://{target}", options, part_bytes=64 << 10, concurrency=2, prefetch=0)
    assert cut
    assert len(read) == 24
    assert {bytes(data) for _, data in read} == {b"\x01" * (64 << 10)}


def test_an_identical_rewrite_mid_read_still_counts_as_a_change(
    gcs_dataset: RemoteDataset, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same bytes written again make a new generation: the parts pinned to the old one
    fail, naming the change, rather than going on unpinned (where a later, real change would
    be stitched in unseen), and the unchanged ETag is not taken for a proxy's rewriting."""
    caplog.set_level("INFO", logger="cloudshards.fetch")
    source = tmp_path / "same.tar"
    _changing_tar(source, 1)
    name = "rewritten-same.tar"
    _publish(gcs_dataset, "gcs", source, name)
    url = gcs_dataset.url_for(name)
    options = gcs_dataset.storage_options
    samples = iter(wds.WebDataset(url, shardshuffle=False, storage_options=options,
                                  part_bytes=64 << 10, concurrency=1, prefetch=0))  # fmt: skip
    next(samples)
    _publish(gcs_dataset, "gcs", source, name)
    with pytest.raises(ShardOpenError, match="changed while it was read"):
        list(samples)
    assert "refuses If-Match" not in caplog.text


def test_the_xml_api_probe_decides_only_on_an_object_that_exists(
    gcs_dataset: RemoteDataset,
    gcs_server: Any,
    proxies: Callable[..., RewritingProxy],  # noqa: F811 - the imported fixture
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On an emulator without the XML API, a missing first shard proves nothing: it is named
    as missing, and the next shards (which exist) still find the gcsfs fallback."""

    def foreign_host(exchange: Any) -> None:
        exchange.request_headers["host"] = "emulator.invalid:4443"

    proxy = proxies(gcs_server.endpoint_url, on_request=foreign_host)
    options = {"gs": {"endpoint_url": proxy.url, "token": "anon"}}
    caplog.set_level("WARNING", logger="cloudshards.fetch")
    with pytest.raises(ShardOpenError, match="object not found"):
        keys_of(gcs_dataset.url_for("no-such-shard.tar"), options)
    assert keys_of(gcs_dataset.url, options) == all_keys(gcs_dataset)
    assert any("-public-host" in r.getMessage() for r in caplog.records)
