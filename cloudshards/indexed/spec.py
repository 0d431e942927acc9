"""What ``IndexedDataset`` is given, as an index: an index, an index file's URL, or shard
URLs (their index found beside them, or built)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from cloudshards.errors import ConfigError
from cloudshards.indexed.build import build_index
from cloudshards.indexed.files import default_index_url, load_index, read_bytes
from cloudshards.indexed.format import DatasetIndex, read_index
from cloudshards.redact import redact_url
from cloudshards.urls import expand_urls

__all__ = ["as_index"]

logger = logging.getLogger(__name__)


def as_index(
    spec: DatasetIndex | str | Iterable[str],
    storage_options: Mapping[str, Any] | None,
    allow_external_shards: bool,
) -> DatasetIndex:
    if isinstance(spec, DatasetIndex):
        return spec
    if isinstance(spec, str) and spec.split("?", 1)[0].endswith((".json", ".json.gz")):
        return load_index(spec, storage_options, allow_external_shards=allow_external_shards)
    if isinstance(spec, Mapping) or not isinstance(spec, (str, Iterable)):
        raise ConfigError(f"expected an index, an index URL or shard URLs, got {spec!r}")
    urls = expand_urls(spec, storage_options=storage_options)
    default = default_index_url(urls)
    data = read_bytes(default, storage_options)
    if data is not None:
        found = read_index(data, default, allow_external_shards=allow_external_shards)
        selected = found.select(urls)
        if selected is not None:
            return selected
        logger.warning("%s does not list every shard given", redact_url(default))
    logger.warning(
        "no index for %d shards at %s: scanning them now; save an index with "
        "`cloudshards index` to skip this",
        len(urls),
        redact_url(default),
    )
    return build_index(urls, storage_options)
