"""A JSON field's Python objects are bounded by the decode limit, not only its bytes.

``json.loads`` makes a list, dict or number per few bytes of text, ~22-30 bytes of objects per
byte at worst; a ``.json.gz`` inflated to the limit must not then take 27 times the limit.
"""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest

from cloudshards.decoders import Decoder
from cloudshards.errors import DecodeError
from cloudshards.inflate import active_limit, json_loads

LIMIT = 1 << 20
URL = "file:///data/shard-000007.tar"


def nested_lists(count: int) -> bytes:
    """The finding's text: ``count`` empty lists in a list, 3 bytes each."""
    return b"[" + b"[]," * count + b"[]]"


def test_a_json_gz_of_empty_lists_is_refused_within_the_limit() -> None:
    text = nested_lists(300_000)  # 900 KB: under the limit as bytes, ~20 MB as lists
    assert len(text) < LIMIT
    sample = {"__key__": "k7", "__url__": URL, "json.gz": gzip.compress(text)}
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="over the decode limit") as info:
            Decoder([], max_bytes=LIMIT)(sample)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (info.value.url, info.value.key, info.value.field) == (URL, "k7", "json.gz")
    assert peak < 4 * LIMIT, f"peak {peak:,} bytes"  # the gzip stage holds ~2x; lists: 20x


def test_json_that_fits_decodes_as_json_loads_does() -> None:
    records = [{"caption": "a cat on a mat", "width": 512, "height": 384, "tags": ["cat"]}]
    text = json.dumps(records * 400).encode()  # ~30 KB, whose objects fit in 1 MiB
    assert len(text) * 65 > LIMIT  # large enough to be counted, not waved through
    decoded = Decoder([], max_bytes=LIMIT)({"__key__": "k", "json": text, "jsn": b"[1, 2]"})
    assert decoded["json"] == json.loads(text)
    assert decoded["jsn"] == [1, 2]


def test_the_limit_applies_to_json_loads_alone() -> None:
    token = active_limit.set(1000)
    try:
        assert json_loads(b'{"a": [1, 2]}') == {"a": [1, 2]}
        with pytest.raises(DecodeError, match="JSON of 304 bytes holds 202 "):
            json_loads(nested_lists(100))
    finally:
        active_limit.reset(token)
