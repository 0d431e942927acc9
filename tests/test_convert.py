"""WebLoader with ``batch_size=None`` converts each batch as torch's ``default_convert`` would
(the oracle), through a faster path for the batches ``.batched()`` makes."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_convert

import cloudshards as wds
from cloudshards.stages.batch import convert_batch

Point = collections.namedtuple("Point", "x y")


class Tagged(list):  # type: ignore[type-arg]
    """A list subclass: default_convert keeps its type."""


def shape(value: Any) -> Any:
    """Types and values, recursively, for comparing two conversions exactly."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.tolist())
    if isinstance(value, dict):
        return (type(value), {k: shape(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return (type(value), [shape(v) for v in value])
    return (type(value), value)


CASES: dict[str, Any] = {
    "bytes and keys": (["k0", "k1"], [b"a" * 10, b"b"]),
    "numbers": [1, 2.5, True, None],
    "arrays": (np.arange(3), np.array([1.5]), np.array(["a", "b"])),
    "numpy scalars": [np.float32(1.5), np.int64(3)],
    "nested": [[b"x", "y"], (1, [np.arange(2)]), {"cls": np.array([1, 2])}],
    "tensors": (torch.ones(2), [torch.zeros(1)]),
    "namedtuple": Point(np.arange(2), b"y"),
    "list subclass": Tagged([np.arange(2), b"z"]),
    "mixed list": [b"a", np.arange(2)],
    "empty": ([], ()),
    "leaf": b"bytes",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_convert_batch_is_default_convert(case: str) -> None:
    data = CASES[case]
    assert shape(convert_batch(data)) == shape(default_convert(data))


def test_convert_batch_copies_lists_as_default_convert_does() -> None:
    batch = ["k0", "k1"]
    converted = convert_batch(batch)
    assert converted == batch
    assert converted is not batch


def test_webloader_without_batch_size_converts_like_a_dataloader(make_shards: Any) -> None:
    shards = make_shards([7, 6])
    urls = [str(path) for path in shards.paths]

    def pipeline() -> Any:
        return wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__", "bin", "cls").batched(4)

    loader = wds.WebLoader(pipeline(), batch_size=None, num_workers=0)
    assert loader.pipeline[0].collate_fn is convert_batch
    ours = list(loader)
    theirs = list(DataLoader(pipeline(), batch_size=None, num_workers=0))
    assert len(ours) == 4
    assert shape(ours) == shape(theirs)
    assert [key for batch in ours for key in batch[0]] == [key for key, _ in shards.samples]


def test_webloader_keeps_a_collate_fn_the_user_gives(make_shards: Any) -> None:
    shards = make_shards([3])
    dataset = wds.WebDataset([str(shards.paths[0])], shardshuffle=False).to_tuple("__key__")
    loader = wds.WebLoader(dataset.batched(3), batch_size=None, collate_fn=lambda b: ("mine", b))
    assert list(loader) == [("mine", ([key for key, _ in shards.samples],))]
    batched = wds.WebLoader(dataset, batch_size=3)
    assert batched.pipeline[0].collate_fn is not convert_batch
    assert list(batched) == [[tuple(key for key, _ in shards.samples)]]
