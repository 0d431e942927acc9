"""WebDataset pipelines end to end on local shards: epochs, workers, errors, fluent API."""

from __future__ import annotations

import io
import tarfile
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudshards as wds
from cloudshards.errors import ConfigError, ShardFormatError, ShardOpenError


def keys_of(dataset: Any) -> list[str]:
    return [sample["__key__"] for sample in dataset]


def test_samples_are_webdataset_dicts(make_shards: Any) -> None:
    shards = make_shards([3, 2])
    samples = list(wds.WebDataset(shards.spec(), shardshuffle=False))
    assert [s["__key__"] for s in samples] == shards.keys
    for sample, (key, fields) in zip(samples, shards.samples, strict=True):
        expected = {"__key__": key, "__url__": sample["__url__"], **fields}
        assert sample == {**expected, "__local_path__": sample["__url__"]}
    assert samples[0]["__url__"] == str(shards.paths[0])
    assert samples[-1]["__url__"] == str(shards.paths[1])


def test_shard_shuffle_changes_per_epoch_and_repeats_per_seed(make_shards: Any) -> None:
    shards = make_shards([2] * 12)
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5)
    epoch0, epoch1 = keys_of(ds), keys_of(ds)
    assert sorted(epoch0) == sorted(epoch1) == sorted(shards.keys)
    assert epoch0 != epoch1
    rerun = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5)
    assert keys_of(rerun) == epoch0
    rerun.set_epoch(1)
    assert keys_of(rerun) == epoch1
    assert keys_of(wds.WebDataset(shards.spec(), shardshuffle=True, seed=6)) != epoch0


def test_sample_shuffle_is_seeded_per_epoch(make_shards: Any) -> None:
    shards = make_shards([10, 10])
    ds = wds.WebDataset(shards.spec(), shardshuffle=False, seed=1).shuffle(8)
    a, b = keys_of(ds), keys_of(ds)
    assert sorted(a) == sorted(shards.keys)
    assert a != b
    again = wds.WebDataset(shards.spec(), shardshuffle=False, seed=1).shuffle(8)
    assert keys_of(again) == a


def test_ranks_get_disjoint_shards_covering_each_epoch(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3, 1, 4, 1, 5, 9, 2, 6])
    monkeypatch.setenv("WORLD_SIZE", "3")
    for epoch in range(2):
        seen: Counter[str] = Counter()
        for rank in range(3):
            monkeypatch.setenv("RANK", str(rank))
            ds = wds.WebDataset(
                shards.spec(), shardshuffle=True, seed=9, empty_check=False, balance=None
            )
            ds.set_epoch(epoch)
            seen.update(keys_of(ds))
        assert seen == Counter(shards.keys)


@pytest.mark.parametrize("persistent", [False, True])
def test_dataloader_workers_see_each_sample_once_and_reshuffle(
    make_shards: Any, persistent: bool
) -> None:
    shards = make_shards([4] * 8)
    ds = wds.WebDataset(shards.spec(), shardshuffle=True)
    loader = torch.utils.data.DataLoader(
        ds, num_workers=2, batch_size=None, persistent_workers=persistent
    )
    torch.manual_seed(0)
    epochs = [keys_of(loader) for _ in range(2)]
    for keys in epochs:
        assert Counter(keys) == Counter(shards.keys)
    assert epochs[0] != epochs[1]


def test_webloader_sets_the_epoch(make_shards: Any) -> None:
    shards = make_shards([3] * 6)
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=2)
    loader = wds.WebLoader(ds, num_workers=2, batch_size=None)
    first, second = keys_of(loader), keys_of(loader)
    assert Counter(first) == Counter(second) == Counter(shards.keys)
    assert first != second
    assert keys_of(wds.WebLoader(ds, num_workers=2, batch_size=None)) == first


def test_with_epoch_gives_exact_counts_and_repeats(make_shards: Any) -> None:
    shards = make_shards([3, 4])
    ds = wds.WebDataset(shards.spec(), shardshuffle=False)
    assert len(keys_of(ds.with_epoch(5))) == 5
    long = keys_of(ds.with_epoch(17))
    assert len(long) == 17
    assert Counter(long[:7]) == Counter(shards.keys)
    batches = list(ds.batched(2).with_epoch(nbatches=6))
    assert len(batches) == 6


def test_epoch_and_length_change_the_pipeline_other_fluent_methods_copy(
    make_shards: Any,
) -> None:
    """As webdataset's: ``ds.with_epoch(n)`` unassigned still sets the epoch (programs rely on
    it: a resampled dataset would otherwise never end an epoch); to_tuple, batched... copy."""
    shards = make_shards([5])
    ds = wds.WebDataset(shards.spec(), shardshuffle=False)
    ds.to_tuple("cls")
    ds.batched(2)
    assert keys_of(ds) == shards.keys
    with pytest.raises(TypeError, match="with_length"):
        len(ds)
    assert ds.with_epoch(2) is ds
    assert keys_of(ds) == shards.keys[:2]
    assert ds.with_length(42, silent=True) is ds
    assert len(ds) == 42
    assert ds.repeat(2) is ds
    assert keys_of(ds) == shards.keys * 2
    resampled = wds.WebDataset(shards.spec(), resampled=True, seed=1)
    resampled.with_epoch(7)
    assert len(keys_of(resampled)) == 7


def test_hasattr_len_is_false_until_a_length_is_set_as_in_webdataset(make_shards: Any) -> None:
    # LAVIS's runner: ``len(d) if hasattr(d, "__len__") else -1``; webdataset's pipelines get
    # a __len__ only from with_length, so programs ask hasattr before calling len().
    import webdataset

    shards = make_shards([3])
    for module in (webdataset, wds):
        pipeline = module.DataPipeline(module.SimpleShardList(shards.spec()))
        dataset = module.WebDataset(shards.spec(), shardshuffle=False)
        loader = module.WebLoader(dataset, batch_size=None)
        for streaming in (pipeline, dataset, loader):
            assert not hasattr(streaming, "__len__"), (module.__name__, streaming)
            with pytest.raises(TypeError):
                len(streaming)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # webdataset warns that it sets __len__ only
                streaming.with_length(3)
            assert len(streaming) == 3
            assert hasattr(streaming, "__len__")


def test_resampled_with_epoch(make_shards: Any) -> None:
    shards = make_shards([2, 2, 2])
    ds = wds.WebDataset(shards.spec(), resampled=True, seed=3).with_epoch(10)
    first = keys_of(ds)
    assert len(first) == 10
    assert set(first) <= set(shards.keys)
    assert keys_of(ds) != first
    loader = torch.utils.data.DataLoader(ds, num_workers=2, batch_size=None)
    assert len(keys_of(loader)) == 20


def _corrupt_copy(path: Path, target: Path) -> None:
    data = bytearray(path.read_bytes())
    data[2048:2060] = b"\xff" * 12  # inside the second member's header
    target.write_bytes(bytes(data))


def test_bad_shard_raises_by_default_and_can_be_skipped(make_shards: Any, tmp_path: Path) -> None:
    shards = make_shards([3, 3])
    bad = tmp_path / "bad.tar"
    _corrupt_copy(shards.paths[0], bad)
    urls = [str(bad), str(shards.paths[1])]
    with pytest.raises(ShardFormatError) as info:
        list(wds.WebDataset(urls, shardshuffle=False))
    assert str(bad) in str(info.value)
    assert info.value.offset is not None
    skipped = keys_of(wds.WebDataset(urls, shardshuffle=False, handler=wds.ignore_and_continue))
    assert skipped[-3:] == shards.keys[3:]
    assert set(skipped) <= set(shards.keys)
    policy = keys_of(wds.WebDataset(urls, shardshuffle=False, handler="skip"))
    assert policy == skipped


def test_missing_shard_error_and_skip(make_shards: Any, tmp_path: Path) -> None:
    shards = make_shards([2])
    urls = [str(tmp_path / "nope.tar"), str(shards.paths[0])]
    with pytest.raises(ShardOpenError, match=r"nope\.tar"):
        list(wds.WebDataset(urls, shardshuffle=False))
    with pytest.warns(UserWarning, match="nope.tar"):
        got = keys_of(wds.WebDataset(urls, shardshuffle=False, handler=wds.warn_and_continue))
    assert got == shards.keys


def test_truncated_shard_keeps_samples_before_the_cut(make_shards: Any, tmp_path: Path) -> None:
    shards = make_shards([6], payload_bytes=3000)
    data = shards.paths[0].read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: len(data) // 2])
    got: list[str] = []
    expected = dict(shards.samples)

    def consume() -> None:
        for sample in wds.WebDataset(str(cut), shardshuffle=False):
            got.append(sample["__key__"])
            assert sample["bin"] == expected[sample["__key__"]]["bin"]

    with pytest.raises(ShardFormatError, match=r"cut\.tar"):
        consume()
    assert got == shards.keys[: len(got)]
    assert 0 < len(got) < 6


def test_empty_check_explains_the_cause(make_shards: Any) -> None:
    shards = make_shards([2])
    loader = torch.utils.data.DataLoader(
        wds.WebDataset(shards.spec(), shardshuffle=False), num_workers=2, batch_size=None
    )
    failed = iter(loader)
    stopped = weakref.ref(failed)
    with pytest.raises(ValueError, match="fewer shards than workers") as raised:
        list(failed)
    # The failed iterator still owns its running workers: DataLoader stops them only in
    # its __del__. The exception's traceback holds the iterator in a reference cycle
    # (traceback -> torch's reraise frame -> exception -> traceback), so __del__ would run
    # whenever the garbage collector gets to it, possibly inside a worker forked below,
    # which inherits the garbage. There it fails ("can only test a child process"),
    # pytest's unraisable hook imports tracemalloc, and when that collection happened
    # inside an import of the worker (numpy.random), Python 3.11's module lock is
    # re-entered: the worker dies with a KeyError in importlib. Break the cycle, so that
    # dropping the last references stops the workers here, now (a gc.collect() would do it
    # too, but in 5 s: the queues' finalizers run first and the joins time out).
    raised.value.__traceback__ = None
    del failed, raised
    assert stopped() is None, "the failed DataLoader iterator (and its workers) outlived it"
    relaxed = wds.WebDataset(shards.spec(), shardshuffle=False, empty_check=False)
    loader = torch.utils.data.DataLoader(relaxed, num_workers=2, batch_size=None)
    assert sorted(keys_of(loader)) == shards.keys


def test_empty_check_names_the_errors_the_handler_let_pass(
    make_shards: Any, tmp_path: Path
) -> None:
    """An epoch left empty by errors the handler passed over says so, naming the first one
    (the shard's URL), rather than guessing at too few shards for the workers."""
    shards = make_shards([2])
    missing = tmp_path / "missing-000007.tar"
    cut = tmp_path / "cut.tar"
    cut.write_bytes(Path(shards.paths[0]).read_bytes()[:700])  # inside the first sample
    for urls, errors in ([str(missing)], 1), ([str(missing), str(cut)], 2):
        dataset = wds.WebDataset(urls, shardshuffle=False, handler=wds.ignore_and_continue)
        with pytest.raises(ValueError, match="No samples found in dataset") as raised:
            list(dataset)
        message = str(raised.value)
        assert f"{errors} error(s) in this worker's shards went to the handler" in message
        assert "missing-000007.tar" in message
        assert "fewer shards than workers" not in message
    # Each pass counts its own: once the shard is there (an empty archive), no error is.
    dataset = wds.WebDataset(str(missing), shardshuffle=False, handler=wds.ignore_and_continue)
    with pytest.raises(ValueError, match="1 error"):
        list(dataset)
    with tarfile.open(missing, "w"):
        pass
    with pytest.raises(ValueError, match="fewer shards than workers"):
        list(dataset)


def test_an_empty_check_pickled_without_its_reader_still_explains() -> None:
    from cloudshards.datasetstages import _EmptyCheck

    check = _EmptyCheck(3)
    del check.__dict__["reader"]  # as unpickled from a pipeline saved before it had one
    with pytest.raises(ValueError, match="fewer shards than workers"):
        list(check([]))


def test_select_and_rename_files(make_shards: Any) -> None:
    shards = make_shards([3])
    ds = wds.WebDataset(
        shards.spec(),
        shardshuffle=False,
        select_files=lambda name: not name.endswith(".bin"),
        rename_files=lambda name: name.replace(".json", ".meta.json"),
    )
    sample = next(iter(ds))
    assert set(sample) == {"__key__", "__url__", "__local_path__", "cls", "meta.json"}


def test_gzipped_shards(make_shards: Any, tmp_path: Path) -> None:
    import gzip

    shards = make_shards([4])
    gz = tmp_path / "shard.tar.gz"
    gz.write_bytes(gzip.compress(shards.paths[0].read_bytes()))
    assert keys_of(wds.WebDataset(str(gz), shardshuffle=False)) == shards.keys


def test_duplicate_field_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("a.txt", "a.TXT"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ShardFormatError, match="txt"):
        list(wds.WebDataset(str(path), shardshuffle=False))


def test_decode_to_tuple_batched_pipeline(make_shards: Any) -> None:
    shards = make_shards([5, 5])
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).decode().to_tuple("json", "cls")
    batches = list(ds.batched(4))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    first_json, first_cls = batches[0]
    assert first_json[0] == {"key": "s0000_000000", "shard": 0, "index": 0}
    assert first_cls.tolist() == [0, 1, 2, 3]
    assert [len(b[1]) for b in ds.batched(4, partial=False)] == [4, 4]


def test_memory_filesystem_dataset(make_shards: Any) -> None:
    import fsspec

    shards = make_shards([2, 3])
    fs = fsspec.filesystem("memory")
    for path in shards.paths:
        fs.pipe(f"/pipeline-test/{path.name}", path.read_bytes())
    try:
        ds = wds.WebDataset("memory://pipeline-test/shard-{000000..000001}.tar", shardshuffle=False)
        assert keys_of(ds) == shards.keys
        globbed = wds.WebDataset("memory://pipeline-test/shard-*.tar", shardshuffle=False)
        assert keys_of(globbed) == shards.keys
    finally:
        fs.rm("/pipeline-test", recursive=True)


def test_member_size_limit(make_shards: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards([2], payload_bytes=5000)
    with pytest.raises(ShardFormatError, match=r"\.bin") as info:
        list(wds.WebDataset(shards.spec(), shardshuffle=False, max_member_bytes=4096))
    assert info.value.member is not None
    monkeypatch.setenv("CLOUDSHARDS_MAX_MEMBER_BYTES", "4096")
    with pytest.raises(ShardFormatError):
        list(wds.WebDataset(shards.spec(), shardshuffle=False))
    assert (
        len(keys_of(wds.WebDataset(shards.spec(), shardshuffle=False, max_member_bytes=5000))) == 2
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_webloader_follows_the_datasets_explicit_epoch(make_shards: Any, workers: int) -> None:
    shards = make_shards([3] * 6)

    def order(epoch: int) -> list[str]:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5)
        ds.set_epoch(epoch)
        return keys_of(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))

    assert order(3) != order(4)
    ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers)
    ds.set_epoch(3)  # a job restarted at epoch 3
    assert keys_of(loader) == order(3)
    assert keys_of(loader) == order(4)  # and counts on from there
    loader.set_epoch(1)  # the loader's own explicit epoch wins
    assert keys_of(loader) == order(1)
    ds.set_epoch(7)
    assert keys_of(loader) == order(7)


def test_decode_then_to_tuple_decodes_only_the_kept_fields(make_shards: Any) -> None:
    shards = make_shards([4, 3])
    decoded: list[str] = []

    def spy(key: str, data: bytes) -> Any:
        decoded.append(key)
        return None  # leave it to the default handlers

    narrowed = wds.WebDataset(shards.spec(), shardshuffle=False).decode(spy).to_tuple("cls")
    full = wds.WebDataset(shards.spec(), shardshuffle=False).decode().to_tuple("cls")
    assert list(narrowed) == list(full)
    assert set(decoded) == {".cls"}
    assert len(decoded) == 7
    # webdataset's own spelling, one string of space-separated fields: every field decoded.
    decoded.clear()
    spaced = wds.WebDataset(shards.spec(), shardshuffle=False).decode(spy).to_tuple("bin cls")
    both = list(wds.WebDataset(shards.spec(), shardshuffle=False).decode().to_tuple("bin", "cls"))
    assert list(spaced) == both
    assert all(isinstance(c, int) for _, c in both)
    assert set(decoded) == {".bin", ".cls"}
    # Nothing narrows a decode that is not directly followed by to_tuple.
    decoded.clear()
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).decode(spy)
    list(ds.map(lambda s: s).to_tuple("cls"))
    assert {".cls", ".bin", ".json"} <= set(decoded)


def test_replication_gives_each_model_parallel_group_the_same_samples(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 ranks in groups of 2 (ranks 0-1 and 2-3): a group's ranks read identical samples in
    the same order, shuffle buffer included; the two groups read disjoint halves."""
    shards = make_shards([7, 3, 9, 5, 6])
    monkeypatch.setenv("WORLD_SIZE", "4")
    seen = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=2, replication=2).shuffle(5)
        ds.set_epoch(1)
        seen.append([s["__key__"] for s in ds])
    assert seen[0] == seen[1]
    assert seen[2] == seen[3]
    assert not set(seen[0]) & set(seen[2])
    assert len(seen[0]) == len(seen[2]) == 30 // 2  # balanced between the groups
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="replication=3"):
        next(iter(wds.WebDataset(shards.spec(), replication=3)))


def test_a_stage_that_raises_closes_the_open_shard_at_once(make_shards: Any) -> None:
    """The error's traceback keeps the pipeline's iterators alive (a reference cycle), so the
    shard a reader had open stayed open until the garbage collector ran, which then warned
    of an unclosed file in whatever code ran next. It is closed when the error leaves."""
    import os

    shards = make_shards([4])
    path = os.path.realpath(shards.paths[0])

    def open_copies() -> int:
        fds = os.listdir("/proc/self/fd")
        return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == path)

    def explode(sample: dict[str, Any]) -> dict[str, Any]:
        if sample["__key__"] == shards.keys[1]:
            raise KeyError("a bad sample")
        return sample

    ds = wds.WebDataset(str(path), shardshuffle=False).map(explode)
    it = iter(ds)
    next(it)
    assert open_copies() == 1
    with pytest.raises(KeyError) as info:
        next(it)
    assert info.value.__traceback__ is not None  # held, as a handler or a test holds it
    assert open_copies() == 0
