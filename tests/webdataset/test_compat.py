"""webdataset 1.0.2 as the oracle: the same pipeline over the same shards gives the same samples.

Each test builds one pipeline twice, with ``webdataset`` and with ``cloudshards``, and compares
the outputs exactly (in order, or as multisets where a shuffle or worker interleaving is
involved). The differences that docs/migrating.md makes on purpose are tested at the end as
cloudshards' own documented behaviour.
"""

from __future__ import annotations

import gc
import io
import json
import pickle
import re
import tarfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset
from PIL import Image
from torch.utils.data import DataLoader

import cloudshards
from cloudshards.decoders import allow_unsafe_decoders
from cloudshards.errors import ShardFormatError

Build = Callable[[Any], Any]
MakeShards = Callable[..., Any]

# --- helpers ---------------------------------------------------------------------------------


@contextmanager
def oracle_quirks() -> Iterator[None]:
    """Run webdataset code: 1.0.2 leaves shard files for the garbage collector to close.

    Its ResourceWarnings would turn into errors under ``filterwarnings = error``; they are
    ignored, and the files collected, only while the oracle runs, so cloudshards' own leaks
    still fail the test.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            yield
        finally:
            gc.collect()


def oracle(build: Build) -> list[Any]:
    """The list webdataset's version of the pipeline yields."""
    with oracle_quirks():
        return list(build(webdataset))


def run_both(build: Build) -> tuple[list[Any], list[Any]]:
    """(webdataset's output, cloudshards' output) for the same pipeline builder."""
    expected = oracle(build)
    actual = list(build(cloudshards))
    return expected, actual


def canon(x: Any) -> Any:
    """A hashable, exactly comparable form of a sample: types, dtypes, shapes and bytes count.

    ``__local_path__`` (a webdataset 1.0.2 extra on local shards) is left out here and tested
    on its own in :func:`test_local_shards_carry_local_path`.
    """
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.detach().contiguous().numpy().tobytes())
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, x.tobytes())
    if isinstance(x, np.generic):
        return ("npscalar", str(x.dtype), x.item())
    if isinstance(x, Image.Image):
        return ("pil", x.mode, x.size, x.tobytes())
    if isinstance(x, dict):
        items = ((str(k), canon(v)) for k, v in x.items() if k != "__local_path__")
        return ("dict", tuple(sorted(items, key=lambda kv: kv[0])))
    if isinstance(x, tuple):
        return ("tuple", tuple(canon(v) for v in x))
    if isinstance(x, list):
        return ("list", tuple(canon(v) for v in x))
    return (type(x).__name__, x)


def canon_list(samples: Iterable[Any]) -> list[Any]:
    return [canon(s) for s in samples]


def multiset(samples: Iterable[Any]) -> Counter[Any]:
    return Counter(canon(s) for s in samples)


def keys_of(samples: Iterable[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in samples]


def rows_of(batches: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Split collated dict batches back into per-sample dicts."""
    rows = []
    for batch in batches:
        for i in range(len(batch["__key__"])):
            rows.append({k: v[i] for k, v in batch.items()})
    return rows


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """Write ``(key, {field: bytes})`` samples as a WebDataset tar."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for key, fields in samples:
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return path


def image_bytes(seed: int, fmt: str) -> bytes:
    """A small deterministic RGB image encoded as PNG or JPEG."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def shards(make_shards: MakeShards) -> Any:
    """Four shards of five samples with fields bin, json, cls."""
    return make_shards([5, 5, 5, 5], payload_bytes=48)


@pytest.fixture
def image_urls(tmp_path: Path) -> list[str]:
    """Two shards of six samples: even samples carry a PNG, odd ones a JPEG, all a cls."""
    directory = tmp_path / "images"
    directory.mkdir()
    urls = []
    for shard in range(2):
        samples = []
        for i in range(6):
            n = shard * 6 + i
            ext, fmt = ("png", "PNG") if i % 2 == 0 else ("jpg", "JPEG")
            samples.append((f"img{n:04d}", {ext: image_bytes(n, fmt), "cls": str(n % 3).encode()}))
        urls.append(str(write_tar(directory / f"img-{shard:06d}.tar", samples)))
    return urls


@pytest.fixture
def unsafe_off() -> Iterator[None]:
    allow_unsafe_decoders(False)
    yield
    allow_unsafe_decoders(False)


# --- reading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["brace", "list", "double-colon", "env-var"])
def test_plain_samples_match_webdataset(
    shards: Any, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [str(p) for p in shards.paths]
    urls: str | list[str]
    if form == "brace":
        urls = shards.spec()
    elif form == "list":
        urls = paths
    elif form == "double-colon":
        urls = "::".join(paths)
    else:
        monkeypatch.setenv("WDS_SHARDDIR", str(shards.paths[0].parent))
        urls = "${SHARDDIR}/shard-{000000..000003}.tar"

    expected, actual = run_both(lambda wds: wds.WebDataset(urls, shardshuffle=False))

    assert canon_list(actual) == canon_list(expected)
    # And both agree with what was written: keys in order, __url__, field bytes.
    assert keys_of(actual) == shards.keys
    by_key = dict(shards.samples)
    for sample in actual:
        assert sample["__url__"] in paths
        assert sample["__url__"].endswith(f"shard-{int(sample['__key__'][1:5]):06d}.tar")
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        assert fields == by_key[sample["__key__"]]


def test_local_shards_carry_local_path(shards: Any) -> None:
    # webdataset 1.0.2 adds "__local_path__" to every sample of a local (or file://) shard;
    # code that reopens the shard reads it. docs/migrating.md does not list it as a difference.
    expected, actual = run_both(lambda wds: wds.WebDataset(shards.spec(), shardshuffle=False))
    assert [s["__local_path__"] for s in expected] == [s["__url__"] for s in expected]
    assert [s.get("__local_path__") for s in actual] == [s["__local_path__"] for s in expected]
    # Where it sits among the keys: tuple(sample.values()) and default_collate's dicts show it.
    assert [list(s) for s in actual] == [list(s) for s in expected]


@pytest.mark.parametrize(
    ("select_files", "rename_files"),
    [
        (lambda name: not name.endswith(".bin"), None),
        (None, lambda name: name.replace(".json", ".meta.json")),
        (lambda name: not name.endswith(".json"), lambda name: name.replace(".cls", ".json")),
    ],
    ids=["select", "rename", "rename-then-select"],
)
def test_select_files_and_rename_files_match(
    shards: Any,
    select_files: Callable[[str], bool] | None,
    rename_files: Callable[[str], str] | None,
) -> None:
    expected, actual = run_both(
        lambda wds: wds.WebDataset(
            shards.spec(),
            shardshuffle=False,
            select_files=select_files,
            rename_files=rename_files,
        )
    )
    assert len(actual) == len(shards.samples)
    assert canon_list(actual) == canon_list(expected)


# --- decoding --------------------------------------------------------------------------------


def test_decode_without_arguments_matches(shards: Any) -> None:
    expected, actual = run_both(
        lambda wds: wds.WebDataset(shards.spec(), shardshuffle=False).decode()
    )
    assert isinstance(actual[0]["cls"], int)
    assert isinstance(actual[0]["json"], dict)
    assert canon_list(actual) == canon_list(expected)


@pytest.mark.parametrize("spec", ["rgb", "torchrgb", "pil", "l", "rgb8"])
def test_decode_imagespec_matches(image_urls: list[str], spec: str) -> None:
    expected, actual = run_both(
        lambda wds: wds.WebDataset(image_urls, shardshuffle=False).decode(spec)
    )
    assert len(actual) == 12
    assert canon_list(actual) == canon_list(expected)


def test_to_tuple_first_present_field(image_urls: list[str]) -> None:
    expected, actual = run_both(
        lambda wds: (
            wds.WebDataset(image_urls, shardshuffle=False).decode("rgb").to_tuple("png;jpg", "cls")
        )
    )
    assert all(isinstance(image, np.ndarray) and image.shape == (6, 8, 3) for image, _ in actual)
    assert [label for _, label in actual] == [n % 3 for n in range(12)]
    assert canon_list(actual) == canon_list(expected)


# --- fluent filters --------------------------------------------------------------------------


def keep_even_cls(sample: dict[str, Any]) -> bool:
    return int(sample["cls"]) % 2 == 0


def summarize(sample: dict[str, Any]) -> dict[str, Any]:
    # A new dict without __key__: map puts the input's __key__ back in both libraries.
    return {"size": len(sample["bin"]), "label": int(sample["cls"])}


def drop_odd(sample: dict[str, Any]) -> dict[str, Any] | None:
    # A None result drops the sample.
    return sample if int(sample["cls"]) % 2 == 0 else None


FLUENT: dict[str, Callable[[Any], Any]] = {
    "map": lambda ds: ds.map(summarize),
    "map-none-drops": lambda ds: ds.map(drop_odd),
    "map_dict": lambda ds: ds.map_dict(cls=int, json=json.loads),
    "map_tuple": lambda ds: ds.to_tuple("cls", "json").map_tuple(int, json.loads),
    "map_tuple-none": lambda ds: ds.to_tuple("cls", "json").map_tuple(None, json.loads),
    "to_tuple-spaces": lambda ds: ds.to_tuple("cls json"),
    "rename": lambda ds: ds.rename(label="cls", meta="txt;json"),
    "rename-keep-false": lambda ds: ds.rename(keep=False, label="cls", payload="bin"),
    "select": lambda ds: ds.select(keep_even_cls),
    "slice-stop": lambda ds: ds.slice(3),
    "slice-start-stop": lambda ds: ds.slice(2, 11),
    "slice-step": lambda ds: ds.slice(1, 17, 3),
    "rename_keys": lambda ds: ds.rename_keys(label="cls", meta="json"),
    "rename_keys-keep": lambda ds: ds.rename_keys(label="cls", keep_unselected=True),
    "extract_keys": lambda ds: ds.extract_keys("*.cls", "*.txt;*.json"),
    "xdecode": lambda ds: ds.xdecode(cls=lambda s: int(s.read()), json=json.load),
    "decode-batched-dicts": lambda ds: ds.decode().batched(4),
    "batched-partial-false": lambda ds: ds.decode().batched(3, partial=False),
    "batched-tuples": lambda ds: ds.decode().to_tuple("cls", "json", "bin").batched(6),
    "unbatched": lambda ds: ds.decode().to_tuple("cls", "json").batched(4).unbatched(),
    "listed": lambda ds: ds.listed(3),
    "listed-unlisted": lambda ds: ds.listed(3).unlisted(),
    "listed-partial-false": lambda ds: ds.listed(7, partial=False),  # 1.0.2 ignores partial
    "repeat-once-nbatches": lambda ds: ds.repeat(1, 7),  # 1.0.2 ignores nbatches for one pass
    "repeat-twice-nbatches": lambda ds: ds.repeat(2, 7),
}


@pytest.mark.parametrize("name", list(FLUENT))
def test_fluent_method_matches(shards: Any, name: str) -> None:
    chain = FLUENT[name]
    expected, actual = run_both(
        lambda wds: chain(wds.WebDataset(shards.spec(), shardshuffle=False))
    )
    assert actual, "the pipeline yielded nothing"
    assert canon_list(actual) == canon_list(expected)


def test_default_collation_types(shards: Any) -> None:
    # What training code indexes into: ints -> numpy array, dicts/str/bytes -> lists.
    batches = list(cloudshards.WebDataset(shards.spec(), shardshuffle=False).decode().batched(4))
    assert [len(b["__key__"]) for b in batches] == [4, 4, 4, 4, 4]
    first = batches[0]
    assert isinstance(first["cls"], np.ndarray)
    assert first["cls"].tolist() == [int(f["cls"]) for _, f in shards.samples[:4]]
    assert isinstance(first["json"], list)
    assert first["json"][0] == {"key": "s0000_000000", "shard": 0, "index": 0}
    assert first["__key__"] == shards.keys[:4]


def test_batched_tensors_are_stacked(image_urls: list[str]) -> None:
    expected, actual = run_both(
        lambda wds: (
            wds.WebDataset(image_urls, shardshuffle=False)
            .decode("torchrgb")
            .to_tuple("png;jpg", "cls")
            .batched(5)
        )
    )
    images, labels = actual[0]
    assert isinstance(images, torch.Tensor)
    assert images.shape == (5, 3, 6, 8)
    assert images.dtype == torch.float32
    assert isinstance(labels, np.ndarray)
    assert [len(b[1]) for b in actual] == [5, 5, 2]
    assert canon_list(actual) == canon_list(expected)


# --- DataPipeline ----------------------------------------------------------------------------


def open_clip_pipeline(urls: list[str], *, shuffle: bool, batch: bool) -> Build:
    def build(wds: Any) -> Any:
        stages: list[Any] = [wds.SimpleShardList(urls), wds.split_by_worker]
        stages.append(wds.tarfile_to_samples(handler=wds.reraise_exception))
        if shuffle:
            stages.append(wds.shuffle(100, seed=1))
        stages += [wds.decode("rgb"), wds.to_tuple("png;jpg", "cls")]
        if batch:
            stages.append(wds.batched(4))
        return wds.DataPipeline(*stages)

    return build


def test_datapipeline_open_clip_style_matches(image_urls: list[str]) -> None:
    expected, actual = run_both(open_clip_pipeline(image_urls, shuffle=False, batch=True))
    assert [len(labels) for _, labels in actual] == [4, 4, 4]
    assert canon_list(actual) == canon_list(expected)


def test_datapipeline_with_seeded_shuffle_matches(image_urls: list[str]) -> None:
    expected, actual = run_both(open_clip_pipeline(image_urls, shuffle=True, batch=False))
    unshuffled = list(open_clip_pipeline(image_urls, shuffle=False, batch=False)(cloudshards))
    assert multiset(actual) == multiset(expected) == multiset(unshuffled)
    assert canon_list(actual) != canon_list(unshuffled), "shuffle(100, seed=1) did nothing"
    # shuffle(seed=...) documents webdataset 1.0.2's algorithm: same seed, same order.
    assert canon_list(actual) == canon_list(expected)


def test_custom_pipeline_stage_in_datapipeline(shards: Any) -> None:
    def build(wds: Any) -> Any:
        class EveryOther(wds.PipelineStage):  # type: ignore[misc]
            def __init__(self, offset: int) -> None:
                self.offset = offset

            def run(self, src: Iterable[Any]) -> Iterator[Any]:
                for i, sample in enumerate(src):
                    if (i + self.offset) % 2 == 0:
                        yield sample

        return wds.DataPipeline(
            wds.SimpleShardList(shards.spec()),
            wds.tarfile_to_samples(),
            EveryOther(1),
            wds.map(lambda s: {**s, "cls": int(s["cls"])}),
        )

    expected, actual = run_both(build)
    assert keys_of(actual) == shards.keys[1::2]
    assert canon_list(actual) == canon_list(expected)


def _add_index(src: Iterable[dict[str, Any]], start: int, *, step: int = 1) -> Iterator[Any]:
    for i, sample in enumerate(src):
        yield {**sample, "idx": start + i * step}


def test_pipelinefilter_on_user_generator(shards: Any) -> None:
    def build(wds: Any) -> Any:
        add_index = wds.pipelinefilter(_add_index)
        return wds.DataPipeline(
            wds.SimpleShardList(shards.spec()), wds.tarfile_to_samples(), add_index(10, step=2)
        )

    expected, actual = run_both(build)
    assert [s["idx"] for s in actual] == list(range(10, 50, 2))
    assert canon_list(actual) == canon_list(expected)

    # The same filter appended to a fluent WebDataset.
    def build_fluent(wds: Any) -> Any:
        ds = wds.WebDataset(shards.spec(), shardshuffle=False)
        return ds.compose(wds.pipelinefilter(_add_index)(0))

    expected, actual = run_both(build_fluent)
    assert canon_list(actual) == canon_list(expected)


# --- epochs and lengths ----------------------------------------------------------------------


def test_with_length_sets_len_only(shards: Any) -> None:
    with oracle_quirks():
        reference = webdataset.WebDataset(shards.spec(), shardshuffle=False).with_length(
            7, silent=True
        )
        assert len(reference) == 7
    ds = cloudshards.WebDataset(shards.spec(), shardshuffle=False).with_length(7)
    assert len(ds) == 7
    assert keys_of(ds) == shards.keys  # the epoch itself is unchanged


@pytest.mark.parametrize("n", [7, 20, 33])
def test_with_epoch_yields_exactly_n_and_repeats(shards: Any, n: int) -> None:
    def build(wds: Any) -> Any:
        return wds.WebDataset(shards.spec(), shardshuffle=False).with_epoch(n)

    with oracle_quirks():
        reference = build(webdataset)
        expected = [keys_of(reference), keys_of(reference)]
    ds = build(cloudshards)
    actual = [keys_of(ds), keys_of(ds)]

    assert [len(epoch) for epoch in actual] == [n, n]
    assert actual == expected
    # Past the end of the data the epoch starts over from the first shard.
    assert actual[0] == (shards.keys * 2)[:n]


# --- error handlers --------------------------------------------------------------------------


def corrupt_shard(kind: str, good: Path, directory: Path) -> str:
    path = directory / f"bad-{kind}.tar"
    if kind == "garbage":
        path.write_bytes(b"this is not a tar file\n" * 50)
    elif kind == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2 + 100])
    return str(path)  # "missing": never written


@pytest.mark.parametrize("kind", ["garbage", "missing"])
@pytest.mark.parametrize("handler", ["warn_and_continue", "ignore_and_continue"])
def test_corrupt_shard_is_skipped(
    make_shards: MakeShards, tmp_path: Path, kind: str, handler: str
) -> None:
    shards = make_shards([4, 4, 4])
    # Keys s0003_*: distinct from the good shards' even when a truncated shard yields some.
    bad_source = make_shards([0, 0, 0, 6], directory=tmp_path / "source")
    bad = corrupt_shard(kind, bad_source.paths[3], tmp_path)
    paths = [str(p) for p in shards.paths]
    urls = [paths[0], bad, paths[1], paths[2]]

    def build(wds: Any) -> Any:
        return wds.WebDataset(urls, shardshuffle=False, handler=getattr(wds, handler))

    if handler == "warn_and_continue":
        with pytest.warns(UserWarning, match="Error"):
            expected = oracle(build)
        # The warning names the shard that was skipped.
        with pytest.warns(UserWarning, match=re.escape(Path(bad).name)):
            actual = list(build(cloudshards))
    else:
        expected, actual = run_both(build)

    assert sorted(keys_of(expected)) == sorted(shards.keys)
    assert keys_of(actual) == shards.keys
    assert multiset(actual) == multiset(expected)


@pytest.mark.parametrize("handler", ["warn_and_continue", "ignore_and_continue"])
def test_truncated_shard_keeps_its_complete_samples(
    make_shards: MakeShards, tmp_path: Path, handler: str
) -> None:
    shards = make_shards([4, 4])
    source = make_shards([0, 0, 6], directory=tmp_path / "source")
    bad = corrupt_shard("truncated", source.paths[2], tmp_path)
    urls = [str(shards.paths[0]), bad, str(shards.paths[1])]

    def build(wds: Any) -> Any:
        return wds.WebDataset(urls, shardshuffle=False, handler=getattr(wds, handler))

    expected = oracle(build)
    if handler == "warn_and_continue":
        # cloudshards reports the truncation (webdataset 1.0.2 reads to the cut silently).
        with pytest.warns(UserWarning, match=re.escape(Path(bad).name)):
            actual = list(build(cloudshards))
    else:
        actual = list(build(cloudshards))

    complete = [s for s in expected if {"bin", "json", "cls"} <= s.keys()]
    partial_from_bad = [k for k in keys_of(actual) if k.startswith("s0002_")]
    assert partial_from_bad, "the samples before the cut should be delivered"
    assert set(shards.keys) <= set(keys_of(actual))
    # Every complete sample webdataset reads, in the same order; no partial sample.
    assert canon_list(actual) == canon_list(complete)


def duplicate_member_shard(path: Path) -> str:
    """``s1.txt`` twice (the second b"second"), then three more samples."""
    members = [("s0", b"a"), ("s1", b"b"), ("s1", b"second"), ("s2", b"c"), ("s3", b"d")]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for key, data in [*members, ("s4", b"e")]:
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize("handler", ["warn_and_continue", "ignore_and_continue"])
def test_duplicate_member_skips_only_that_member(tmp_path: Path, handler: str) -> None:
    """As webdataset: a continuing handler drops the duplicated member (the field keeps its
    first value) and the shard goes on; the rest of the shard is not lost."""
    url = duplicate_member_shard(tmp_path / "dup-000000.tar")

    def build(wds: Any) -> Any:
        return wds.WebDataset(url, shardshuffle=False, handler=getattr(wds, handler))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, actual = run_both(build)
    assert keys_of(expected) == ["s0", "s1", "s2", "s3", "s4"]
    assert [s["txt"] for s in expected][1] == b"b"
    assert canon_list(actual) == canon_list(expected)


def test_duplicate_member_asks_a_stopping_handler_once(tmp_path: Path) -> None:
    url = duplicate_member_shard(tmp_path / "dup-000000.tar")
    asked: list[BaseException] = []

    def stop(exn: BaseException) -> bool:
        asked.append(exn)
        return False

    assert keys_of(cloudshards.WebDataset(url, shardshuffle=False, handler=stop)) == ["s0"]
    assert len(asked) == 1
    assert "duplicate field 'txt'" in str(asked[0])
    assert "s1.txt" in str(asked[0])
    with pytest.raises(ShardFormatError, match="duplicate"):
        list(cloudshards.WebDataset(url, shardshuffle=False))


def test_corrupt_shard_raises_by_default(make_shards: MakeShards, tmp_path: Path) -> None:
    shards = make_shards([3, 3])
    bad = corrupt_shard("garbage", shards.paths[0], tmp_path)
    urls = [str(shards.paths[0]), bad, str(shards.paths[1])]
    with oracle_quirks(), pytest.raises(tarfile.ReadError):
        list(webdataset.WebDataset(urls, shardshuffle=False))
    samples = iter(cloudshards.WebDataset(urls, shardshuffle=False))
    assert [next(samples)["__key__"] for _ in range(3)] == shards.keys[:3]
    with pytest.raises(cloudshards.ShardError, match=re.escape(Path(bad).name)):
        next(samples)


def test_empty_check_raises_when_no_samples(tmp_path: Path) -> None:
    empty = str(write_tar(tmp_path / "empty.tar", []))
    with oracle_quirks(), pytest.raises(ValueError, match="No samples found in dataset"):
        list(webdataset.WebDataset(empty, shardshuffle=False))
    with pytest.raises(ValueError, match="No samples found in dataset"):
        list(cloudshards.WebDataset(empty, shardshuffle=False))
    expected, actual = run_both(
        lambda wds: wds.WebDataset(empty, shardshuffle=False, empty_check=False)
    )
    assert actual == expected == []


# --- DataLoader ------------------------------------------------------------------------------


def test_webloader_two_workers_matches(shards: Any) -> None:
    def build(wds: Any) -> Any:
        ds = wds.WebDataset(shards.spec(), shardshuffle=False).decode().batched(4)
        return wds.WebLoader(ds, batch_size=None, num_workers=2)

    expected, actual = run_both(build)
    assert all(len(batch["__key__"]) <= 4 for batch in actual)
    rows = rows_of(actual)
    assert sorted(keys_of(rows)) == sorted(shards.keys)
    assert multiset(rows) == multiset(rows_of(expected))


def test_dataloader_two_workers_each_sample_once_per_epoch(make_shards: MakeShards) -> None:
    shards = make_shards([3] * 8)
    ds = cloudshards.WebDataset(shards.spec(), shardshuffle=True)
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(ds, batch_size=None, num_workers=2, generator=generator)
    epochs = [keys_of(loader), keys_of(loader)]
    for epoch in epochs:
        assert Counter(epoch) == Counter(shards.keys)
    # Documented: shards reshuffle every epoch, even with non-persistent workers.
    assert epochs[0] != epochs[1]

    with oracle_quirks():
        reference = webdataset.WebDataset(shards.spec(), shardshuffle=False)
        expected = keys_of(DataLoader(reference, batch_size=None, num_workers=2))
    assert Counter(expected) == Counter(epochs[0])


# --- documented differences (docs/migrating.md) ----------------------------------------------


def test_shardshuffle_changes_order_each_epoch_and_reruns_the_same(
    make_shards: MakeShards,
) -> None:
    shards = make_shards([3] * 8)
    ds = cloudshards.WebDataset(shards.spec(), shardshuffle=True)
    epoch0, epoch1 = keys_of(ds), keys_of(ds)
    assert sorted(epoch0) == sorted(epoch1) == sorted(shards.keys)
    assert epoch0 != epoch1
    assert epoch0 != shards.keys
    # Samples of a shard stay together; only the shard order is permuted.
    shard_order = [k[:5] for k in epoch0[::3]]
    assert [k[:5] for k in epoch0] == [s for s in shard_order for _ in range(3)]

    rerun = cloudshards.WebDataset(shards.spec(), shardshuffle=True)
    assert keys_of(rerun) == epoch0
    resumed = cloudshards.WebDataset(shards.spec(), shardshuffle=True)
    resumed.set_epoch(1)
    assert keys_of(resumed) == epoch1
    # A positive number means the same full permutation; another seed another order.
    assert keys_of(cloudshards.WebDataset(shards.spec(), shardshuffle=100)) == epoch0
    assert keys_of(cloudshards.WebDataset(shards.spec(), shardshuffle=True, seed=1)) != epoch0


def test_ranks_get_disjoint_covering_splits_every_epoch(
    make_shards: MakeShards, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3] * 8)
    monkeypatch.setenv("WORLD_SIZE", "2")
    shares: dict[tuple[int, int], list[str]] = {}
    for epoch in (0, 1):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            ds = cloudshards.WebDataset(shards.spec(), shardshuffle=True)
            ds.set_epoch(epoch)
            shares[epoch, rank] = keys_of(ds)
    for epoch in (0, 1):
        rank0, rank1 = set(shares[epoch, 0]), set(shares[epoch, 1])
        assert not rank0 & rank1
        assert rank0 | rank1 == set(shards.keys)
        assert len(shares[epoch, 0]) == len(shares[epoch, 1]) == 12
    # Each epoch's split is different.
    assert set(shares[0, 0]) != set(shares[1, 0])


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda ds: ds.with_epoch(5), id="with_epoch"),
        pytest.param(lambda ds: ds.repeat(2), id="repeat"),
        pytest.param(lambda ds: ds.with_epoch(nbatches=3), id="with_epoch nbatches"),
        pytest.param(lambda ds: ds.batched(4), id="batched"),
        pytest.param(lambda ds: ds.to_tuple("cls"), id="to_tuple"),
    ],
)
def test_fluent_methods_change_the_receiver_as_webdatasets_do(shards: Any, call: Any) -> None:
    """with_epoch/repeat change the pipeline and return it, the others return a copy: a
    program that calls ``ds.with_epoch(n)`` without using the result sees the same epochs."""

    def run(wds: Any) -> tuple[bool, list[Any], list[Any]]:
        ds = wds.WebDataset(shards.spec(), shardshuffle=False)
        returned = call(ds)
        return returned is ds, canon_list(list(ds)), canon_list(list(returned))

    with oracle_quirks():
        expected = run(webdataset)
    assert run(cloudshards) == expected


def test_with_length_changes_the_receiver(shards: Any) -> None:
    with oracle_quirks():
        reference = webdataset.WebDataset(shards.spec(), shardshuffle=False)
        reference.with_length(3, silent=True)
        assert len(reference) == 3
    ds = cloudshards.WebDataset(shards.spec(), shardshuffle=False)
    ds.with_length(3)
    assert len(ds) == 3
    assert keys_of(ds) == shards.keys


@pytest.fixture
def pickle_shard(tmp_path: Path) -> str:
    payload = {"labels": [1, 2, 3], "name": "x"}
    samples = [
        (f"p{i}", {"pyd": pickle.dumps(payload), "pickle": pickle.dumps(i), "cls": b"1"})
        for i in range(3)
    ]
    return str(write_tar(tmp_path / "pickled.tar", samples))


def test_pickle_fields_refused_unless_opted_in(
    pickle_shard: str, unsafe_off: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(wds: Any) -> Any:
        return wds.WebDataset(pickle_shard, shardshuffle=False).decode()

    with pytest.raises(cloudshards.DecodeError, match="unpickle"):
        list(build(cloudshards))
    expected = oracle(build)
    assert expected[0]["pyd"] == {"labels": [1, 2, 3], "name": "x"}

    allow_unsafe_decoders()
    assert canon_list(build(cloudshards)) == canon_list(expected)

    allow_unsafe_decoders(False)
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PICKLE", "1")
    assert canon_list(build(cloudshards)) == canon_list(expected)


def test_pipe_urls_need_opt_in(shards: Any) -> None:
    url = f"pipe:cat {shards.paths[0]}"
    with pytest.raises(cloudshards.ConfigError, match="pipe"):
        list(cloudshards.WebDataset(url, shardshuffle=False))
    expected = oracle(lambda wds: wds.WebDataset(url, shardshuffle=False))
    actual = list(cloudshards.WebDataset(url, shardshuffle=False, allow_pipe=True))
    assert keys_of(actual) == shards.keys[:5]
    assert canon_list(actual) == canon_list(expected)


def test_warn_and_continue_does_not_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    with pytest.warns(UserWarning, match="boom"):
        assert cloudshards.warn_and_continue(ValueError("boom")) is True
    assert slept == []


def test_dataset_specs_read_through_multishardsample(make_shards: Any, tmp_path: Path) -> None:
    """webdataset's YAML / dict dataset specs: every shard of each dataset, once an epoch."""
    shards = make_shards([3, 2, 4])
    spec = {"datasets": [{"name": "all", "shards": [str(p) for p in shards.paths]}]}
    from_dict = [s["__key__"] for s in cloudshards.WebDataset(spec)]
    assert sorted(from_dict) == sorted(shards.keys)
    spec_file = tmp_path / "spec.yaml"
    import yaml

    spec_file.write_text(yaml.safe_dump(spec))
    from_yaml = [s["__key__"] for s in cloudshards.WebDataset(str(spec_file))]
    assert sorted(from_yaml) == sorted(shards.keys)
    with pytest.raises(cloudshards.ConfigError, match="wids JSON"):
        cloudshards.WebDataset(str(tmp_path / "spec.json"))
    with pytest.raises(cloudshards.ConfigError, match="datasets"):
        cloudshards.WebDataset({"shards": []})


def test_mcached_replays_the_first_pass_and_lmdb_cached_says_what_to_use(
    make_shards: Any,
) -> None:
    shards = make_shards([3, 2])
    ds = cloudshards.WebDataset(shards.spec(), shardshuffle=False).mcached()
    assert [s["__key__"] for s in ds] == shards.keys
    for path in shards.paths:
        path.unlink()  # the second epoch must come from memory
    assert [s["__key__"] for s in ds] == shards.keys
    with pytest.raises(cloudshards.ConfigError, match="cache_dir"):
        cloudshards.WebDataset(shards.spec()).lmdb_cached("/tmp/x.lmdb")
