"""webdataset 1.0.2 as the oracle for names that webdataset code builds, overrides or seeds:
``DecodingError``'s constructions and attributes, batching of bare samples, ``TarWriter.tarmode``,
``WebDataset``'s ``update_cache_info``/``create_url_iterator`` hooks; and where the draws of
``ResampledShards(deterministic=True)`` differ from webdataset's on purpose."""

from __future__ import annotations

import gc
import gzip
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import webdataset

import cloudshards
from cloudshards.errors import DecodeError

MakeShards = Callable[..., Any]


@contextmanager
def oracle_quirks() -> Iterator[None]:
    """webdataset 1.0.2 leaves shard files for the garbage collector (ResourceWarnings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        warnings.simplefilter("ignore", UserWarning)  # its shardshuffle=None advice
        try:
            yield
        finally:
            gc.collect()


def same(theirs: Any, ours: Any) -> bool:
    """Equal values of equal types, through dicts, tuples and lists (tensors and arrays by
    dtype, shape and contents; dicts in any key order: webdataset's come from a set)."""
    if type(theirs) is not type(ours):
        return False
    if isinstance(ours, torch.Tensor):
        return ours.dtype == theirs.dtype and bool(torch.equal(ours, theirs))
    if isinstance(ours, np.ndarray):
        return ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    if isinstance(ours, dict):
        return ours.keys() == theirs.keys() and all(same(theirs[k], ours[k]) for k in ours)
    if isinstance(ours, (tuple, list)):
        return len(ours) == len(theirs) and all(map(same, theirs, ours))
    return bool(ours == theirs)


# --- DecodingError ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda cls: cls(url="u.tar", key="k", k="jpg", sample={"jpg": b"x"}),
        lambda cls: cls("u.tar", "k", "jpg", {"jpg": b"x"}),
        lambda cls: cls("u.tar", "k"),
        lambda cls: cls("u.tar", k="jpg"),
        lambda cls: cls(),
    ],
    ids=["keywords", "positional", "two-positional", "url-and-k", "empty"],
)
def test_decoding_error_builds_as_in_webdataset(build: Callable[[Any], Any]) -> None:
    theirs, ours = build(webdataset.DecodingError), build(cloudshards.DecodingError)
    assert isinstance(ours, DecodeError)
    for name in ("url", "key", "k", "sample"):
        assert getattr(ours, name) == getattr(theirs, name), name
    with pytest.raises(TypeError):
        cloudshards.DecodingError("u", "k", "jpg", {}, "extra")
    with pytest.raises(TypeError):
        cloudshards.DecodingError("u", "k", key="again")


def test_decode_error_keeps_its_own_form() -> None:
    error = DecodeError("bad bytes", url="u.tar", key="k", field="jpg")
    assert (error.url, error.key, error.field, error.k, error.sample) == (
        "u.tar",
        "k",
        "jpg",
        "jpg",
        None,
    )
    assert "bad bytes" in str(error)
    assert "k.jpg" in str(error)


def test_decoder_error_carries_the_undecoded_sample() -> None:
    sample = {"__key__": "k1", "__url__": "s.tar", "cls": b"1", "jpg": b"not an image"}

    def failure(module: Any) -> Any:
        with pytest.raises(module.DecodingError) as info:
            module.autodecode.Decoder([module.autodecode.imagehandler("rgb")])(dict(sample))
        return info.value

    theirs, ours = failure(webdataset), failure(cloudshards.webdataset)
    assert ours.sample == theirs.sample == sample
    assert (
        (ours.url, ours.key, ours.k) == (theirs.url, theirs.key, theirs.k) == ("s.tar", "k1", "jpg")
    )


# --- batching bare samples -------------------------------------------------------------------

BARE = {
    "tensors": [torch.arange(3), torch.arange(3) + 10],
    "float-tensors": [torch.ones(2, 2), torch.zeros(2, 2)],
    "int-arrays": [np.arange(3), np.arange(3) + 10],
    "float-arrays": [np.arange(3.0), np.arange(3.0) + 1],
    "2d-arrays": [np.ones((2, 3)), np.zeros((2, 3))],
    "strings": ["abc", "def"],
    "bytes": [b"ab", b"cd"],
    "tuples": [(1, "a", np.arange(2)), (2, "b", np.arange(2))],
    "lists": [[1.5, torch.arange(2)], [2.5, torch.arange(2)]],
    "dicts": [{"x": 1, "y": "a"}, {"x": 2, "y": "b"}],
}


@pytest.mark.parametrize("case", sorted(BARE))
def test_batched_collates_like_webdataset(case: str) -> None:
    def batches(module: Any) -> list[Any]:
        samples = BARE[case]
        return list(module.DataPipeline(lambda: iter(samples), module.batched(2)))

    theirs, ours = batches(webdataset), batches(cloudshards)
    assert same(theirs, ours), (theirs, ours)


def test_bare_tensors_batch_into_columns_by_position() -> None:
    [batch] = cloudshards.DataPipeline(
        lambda: iter([torch.arange(3), torch.arange(3) + 10]), cloudshards.batched(2)
    )
    assert list(batch) == [0, 1, 2]
    assert batch[2].tolist() == [2, 12]


# --- TarWriter.tarmode -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a.tar", "a.tgz", "a.tar.gz", "a.tar.bz2", "a.tar.xz", None])
@pytest.mark.parametrize("compress", [None, False, True, "gz", "bz2", "xz"])
def test_tarmode_matches(name: str | None, compress: bool | str | None) -> None:
    fileobj: Any = name if name is not None else object()
    expected = webdataset.TarWriter.tarmode(fileobj, compress)
    assert cloudshards.TarWriter.tarmode(fileobj, compress) == expected
    assert cloudshards.webdataset.writer.TarWriter.tarmode(fileobj) == webdataset.TarWriter.tarmode(
        fileobj
    )


def test_a_tarmode_override_is_used(tmp_path: Path) -> None:
    class GzipWriter(cloudshards.TarWriter):
        @staticmethod
        def tarmode(fileobj: Any, compress: bool | str | None = None) -> Any:
            return "w|gz"

    path = tmp_path / "plain-name.tar"
    with GzipWriter(str(path)) as writer:
        writer.write({"__key__": "k", "txt": "hello"})
    assert b"k.txt" in gzip.decompress(path.read_bytes())


# --- WebDataset hooks ------------------------------------------------------------------------


def reversed_source(module: Any) -> type:
    """A webdataset-style subclass that reads the shards in reverse order."""

    class Reversed(module.WebDataset):  # type: ignore[misc,name-defined]
        def create_url_iterator(self, args: Any) -> None:
            self.append(module.SimpleShardList(list(reversed(args.urls))))

    return Reversed


def test_a_create_url_iterator_override_chooses_the_shards(make_shards: MakeShards) -> None:
    shards = make_shards([2, 3, 2])
    urls = [str(path) for path in shards.paths]
    with oracle_quirks():
        theirs = [s["__key__"] for s in reversed_source(webdataset)(urls, shardshuffle=False)]
    ours = [s["__key__"] for s in reversed_source(cloudshards)(urls, shardshuffle=False)]
    assert ours == theirs
    assert ours[:2] == shards.keys[-2:]


def test_an_update_cache_info_override_chooses_the_cache(
    make_shards: MakeShards, tmp_path: Path
) -> None:
    shards = make_shards([2, 2])
    cache = tmp_path / "cache"
    cache.mkdir()

    class Cached(cloudshards.WebDataset):
        def update_cache_info(self, args: Any) -> None:
            args.cache_dir, args.cache_size = str(cache), 10**9

    data = Cached(shards.spec())
    assert data.cache is not None
    assert (Path(data.cache.directory), data.cache.max_bytes) == (cache, 10**9)
    assert [s["__key__"] for s in data] == shards.keys
    assert cloudshards.WebDataset(shards.spec()).cache is None


def test_the_hooks_can_be_called(make_shards: MakeShards, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards([2])
    data = cloudshards.WebDataset(shards.spec())
    monkeypatch.setenv("WDS_CACHE_SIZE", "1234")
    args = SimpleNamespace(cache_dir=None, cache_size=-1)
    data.update_cache_info(args)
    assert (args.cache_dir, args.cache_size) == (None, 1234)
    before = len(data.pipeline)
    data.create_url_iterator(
        SimpleNamespace(urls=shards.spec(), mode=None, shardshuffle=False, storage_options=None)
    )
    assert len(data.pipeline) == before + 1
    assert [s["url"] for s in data.pipeline[-1]] == [str(p) for p in shards.paths]


# --- ResampledShards draws -------------------------------------------------------------------

URLS = [f"{i:02d}" for i in range(3)]


def _draws(seed: int, epoch: int, worker: int) -> list[str]:
    shards = cloudshards.ResampledShards(
        URLS * 10, nshards=20, seed=seed, deterministic=True, worker_seed=lambda: worker
    )
    shards.epoch = epoch - 1  # each pass counts one epoch up
    return [s["url"] for s in shards]


def test_deterministic_resampled_draws_repeat_and_never_collide() -> None:
    """Deliberately not webdataset's seeds: its ``961 * worker + 31 * epoch + seed`` makes
    worker 1 draw at epoch 0 what worker 0 draws at epoch 31, and seed 31 what seed 0 draws an
    epoch later. Here a rerun draws the same shards, and none of those pairs coincide."""
    assert _draws(0, 0, 0) == _draws(0, 0, 0)
    assert _draws(0, 31, 0) != _draws(0, 0, 1)
    assert _draws(31, 0, 0) != _draws(0, 1, 0)
    webdataset_draws = webdataset.ResampledShards(
        URLS * 10, nshards=20, seed=0, deterministic=True, worker_seed=lambda: 1
    )
    later = webdataset.ResampledShards(
        URLS * 10, nshards=20, seed=0, deterministic=True, worker_seed=lambda: 0
    )
    later.epoch = 30
    assert [s["url"] for s in webdataset_draws] == [s["url"] for s in later]  # its collision
