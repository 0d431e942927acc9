"""Indexed mode's location rule against real nginx servers.

An index served by one host may not send reads (with the ``storage_options`` headers meant for
that host) to another, nor climb out of its directory with a percent-encoded ``..`` that the
server decodes. Host "A" is the session's nginx; host "B" is a second nginx on another port.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from servers import NginxServer

import cloudshards as wds
from cloudshards.errors import ConfigError
from cloudshards.indexed import IndexedDataset, build_index, load_index

if TYPE_CHECKING:
    from conftest import LocalDataset

SECRET_HEADER = {"http": {"headers": {"Authorization": "Bearer token-for-host-A"}}}


@pytest.fixture(scope="module")
def other_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxServer]:
    """A second nginx: another host as far as URLs go (same address, another port)."""
    server = NginxServer.start(tmp_path_factory.mktemp("nginx-b"))
    try:
        yield server
    finally:
        server.close()


def publish(server: NginxServer, directory: str, local: LocalDataset, count: int) -> list[str]:
    """Copy the first ``count`` shards under ``directory`` on ``server``; return their URLs."""
    root = server.root / directory
    root.mkdir(parents=True)
    for name in local.shards[:count]:
        shutil.copyfile(local.root / name, root / name)
    return [server.url_for(f"{directory}/{name}") for name in local.shards[:count]]


def serve_index(server: NginxServer, path: str, shards: list[dict[str, Any]]) -> str:
    """Save an index document at ``path`` under the server's root; return its URL."""
    target = server.root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    samples = sum(shard["num_samples"] for shard in shards)
    document = {
        "format": "cloudshards-index", "version": 1, "num_shards": len(shards),
        "num_samples": samples, "shards": shards,
    }  # fmt: skip
    target.write_text(json.dumps(document))
    return server.url_for(path)


def requests_for(server: NginxServer, prefix: str) -> list[str]:
    time.sleep(0.5)  # nginx logs a moment after it responds
    return [line for line in server.access_log() if f" /{prefix}/" in line]


def without_url(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "__url__"} for s in samples]


def test_an_index_cannot_send_reads_to_another_host(
    http_server: NginxServer, other_server: NginxServer, dataset: LocalDataset
) -> None:
    name = f"safety-{uuid.uuid4().hex[:8]}"
    on_b = publish(other_server, name, dataset, 2)
    shards = [shard.to_json(shard.url) for shard in build_index(on_b).shards]  # absolute on B
    index_url = serve_index(http_server, f"{name}/train.index.json", shards)
    signed = f"{index_url}?X-Amz-Signature=SECRET"
    other_server.clear_access_log()

    def balanced_epoch() -> list[dict[str, Any]]:
        with wds.WebDataset(
            on_b, shardshuffle=False, balance="drop", rank=0, world_size=1,
            sample_counts=signed, storage_options=SECRET_HEADER,
        ) as ds:  # fmt: skip
            return list(ds)

    for load in (
        lambda: load_index(signed, SECRET_HEADER),
        lambda: IndexedDataset(signed, storage_options=SECRET_HEADER),
        balanced_epoch,
    ):
        with pytest.raises(ConfigError, match="allow_external_shards=True") as info:
            load()
        message = str(info.value)
        assert index_url.split("://", 1)[1] in message
        assert on_b[0] in message
        assert "SECRET" not in message
    assert requests_for(other_server, name) == [], "host B received requests (and A's headers)"

    with wds.WebDataset(on_b, shardshuffle=False) as stream:
        expected = list(stream)
    with IndexedDataset(signed, storage_options=SECRET_HEADER, allow_external_shards=True) as ds:
        assert without_url([ds[i] for i in range(len(ds))]) == without_url(expected)
    assert requests_for(other_server, name), "opted in: the samples come from host B"


def test_a_percent_encoded_parent_cannot_climb_out(
    http_server: NginxServer, dataset: LocalDataset
) -> None:
    name = f"safety-{uuid.uuid4().hex[:8]}"
    private = publish(http_server, f"{name}/private", dataset, 1)
    shard = build_index(private).shards[0]
    entry = "%2e%2e/private/" + Path(private[0]).name
    index_url = serve_index(http_server, f"{name}/public/train.index.json", [shard.to_json(entry)])
    with pytest.raises(ConfigError, match=r"with '\.\.'") as info:
        IndexedDataset(index_url)
    assert repr(entry) in str(info.value)
    # Why: the server decodes %2e%2e and serves the file outside the index's directory.
    with IndexedDataset(index_url, allow_external_shards=True) as ds:
        assert ds[0]["__key__"] == dataset.shard_keys[0][0]
