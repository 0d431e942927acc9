"""Balanced epochs: every rank and worker yields exactly the same number of samples, with no
duplicate ("drop") or at most one repeat each ("pad"), whatever the shard sizes."""

from __future__ import annotations

import logging
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudshards as wds
from cloudshards.balance import assign_samples, resolve_sample_counts
from cloudshards.errors import ConfigError

UNEVEN = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # 44 samples


def keys_of(dataset: Any) -> list[str]:
    return [sample["__key__"] for sample in dataset]


@pytest.mark.parametrize("seed", range(20))
def test_assignment_is_equal_disjoint_and_contiguous(seed: int) -> None:
    rng = random.Random(seed)
    counts = [rng.randrange(0, 12) for _ in range(rng.randrange(1, 12))]
    order = list(range(len(counts)))
    rng.shuffle(order)
    consumers = rng.randrange(1, 9)
    total = sum(counts)
    for mode in ("drop", "pad"):
        taken: Counter[tuple[int, int]] = Counter()
        lengths = []
        for consumer in range(consumers):
            segments = list(
                assign_samples(
                    ({"url": f"u{i}", "shard_index": i} for i in order),
                    dict(enumerate(counts)),
                    consumer=consumer,
                    num_consumers=consumers,
                    mode=mode,
                )
            )
            length = 0
            for segment in segments:
                assert segment["take"] > 0
                assert segment["skip"] + segment["take"] <= counts[segment["shard_index"]]
                for i in range(segment["skip"], segment["skip"] + segment["take"]):
                    if not segment.get("pad"):
                        taken[(segment["shard_index"], i)] += 1
                length += segment["take"]
            # Only the first and last segment may be partial shards (locality).
            real = [segment for segment in segments if not segment.get("pad")]
            for segment in real[1:-1]:
                assert segment["take"] == counts[segment["shard_index"]]
            lengths.append(length)
        expected = total // consumers if mode == "drop" else -(-total // consumers)
        assert lengths == [expected] * consumers
        assert all(n == 1 for n in taken.values())  # never twice, except the pad repeats
        assert total - len(taken) == (total % consumers if mode == "drop" else 0)


@pytest.mark.parametrize("drop_at", range(-1, 6))
def test_drop_leaves_out_the_drawn_sample_of_a_longer_run(drop_at: int) -> None:
    """17 samples, 4 consumers: consumer 0's run holds 5 and it takes 4; ``drop_at`` says
    which it leaves out (modulo 5); the other runs and the shards read do not change."""
    runs = []
    for consumer in range(4):
        segments = assign_samples(
            [{"url": "u0", "shard_index": 0}],
            {0: 17},
            consumer=consumer,
            num_consumers=4,
            mode="drop",
            drop_at=drop_at,
        )
        runs.append([i for s in segments for i in range(s["skip"], s["skip"] + s["take"])])
    left_out = drop_at % 5
    assert runs[0] == [i for i in range(5) if i != left_out]
    assert runs[1:] == [list(range(5, 9)), list(range(9, 13)), list(range(13, 17))]


def test_drop_leaves_out_other_samples_each_epoch_even_with_one_shard(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard order cannot move the left-over samples of a single shard: the sample left
    out is drawn each epoch (the same on a rerun), never the same one for ever."""
    shards = make_shards([17])
    monkeypatch.setenv("WORLD_SIZE", "4")

    def epoch(number: int) -> list[list[str]]:
        per_rank = []
        for rank in range(4):
            monkeypatch.setenv("RANK", str(rank))
            ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3, balance="drop")
            ds.set_epoch(number)
            per_rank.append(keys_of(ds))
        return per_rank

    dropped = []
    for number in range(8):
        per_rank = epoch(number)
        assert [len(keys) for keys in per_rank] == [4] * 4
        union = Counter(key for keys in per_rank for key in keys)
        assert max(union.values()) == 1
        (left_out,) = set(shards.keys) - set(union)
        dropped.append(left_out)
    assert len(set(dropped)) > 1, dropped
    assert epoch(5) == epoch(5)


def ranks_keys(
    spec: str, monkeypatch: pytest.MonkeyPatch, world: int, **kw: Any
) -> list[list[str]]:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    result = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        result.append(keys_of(wds.WebDataset(spec, seed=3, **kw)))
    return result


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_get_equal_counts_by_default(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    shards = make_shards(UNEVEN)
    for epoch in range(2):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        per_rank = []
        for rank in range(world):
            monkeypatch.setenv("RANK", str(rank))
            ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3)
            ds.set_epoch(epoch)
            per_rank.append(keys_of(ds))
        assert [len(keys) for keys in per_rank] == [44 // world] * world
        union = Counter(key for keys in per_rank for key in keys)
        assert max(union.values()) == 1
        assert set(union) <= set(shards.keys)
        assert len(shards.keys) - len(union) == 44 % world


def test_pad_mode_gives_everyone_the_ceiling(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    per_rank = ranks_keys(shards.spec(), monkeypatch, 3, shardshuffle=True, balance="pad")
    assert [len(keys) for keys in per_rank] == [15, 15, 15]
    union = Counter(key for keys in per_rank for key in keys)
    assert set(union) == set(shards.keys)
    assert sum(union.values()) - len(union) == 1  # one repeat fills the one short rank


def test_balanced_epochs_reshuffle_and_repeat_with_the_seed(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")

    def epoch_keys(epoch: int) -> list[str]:
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=5)
        ds.set_epoch(epoch)
        return keys_of(ds)

    assert epoch_keys(0) != epoch_keys(1)
    assert epoch_keys(1) == epoch_keys(1)


def test_workers_of_every_rank_yield_the_same_count(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    monkeypatch.setenv("WORLD_SIZE", "2")
    counts = []
    seen: Counter[str] = Counter()
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = wds.WebDataset(shards.spec(), shardshuffle=True, seed=1).batched(4)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        batches = list(loader)
        counts.append(len(batches))
        for batch in batches:
            seen.update(batch["__key__"])
    # 44 samples / 4 consumers = 11 each = 3 batches (4, 4, 3) per worker = 6 per rank.
    assert counts == [6, 6]
    assert max(seen.values()) == 1
    assert len(seen) == 44


def test_counts_come_from_an_index_a_mapping_or_one_counting_pass(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([2, 5, 3])
    urls = [str(p) for p in shards.paths]
    mapping = dict(zip(urls, [2, 5, 3], strict=True))
    assert resolve_sample_counts(urls, counts=mapping) == [2, 5, 3]
    with pytest.raises(ConfigError, match="3 shards"):
        resolve_sample_counts(urls, counts=[1, 2])
    with caplog.at_level(logging.WARNING):
        assert resolve_sample_counts(urls) == [2, 5, 3]
        assert "counting the samples of 3 shards" in caplog.text
        caplog.clear()
        assert resolve_sample_counts(urls) == [2, 5, 3]  # remembered: no second pass
        assert "counting" not in caplog.text
    index = wds.build_index(urls)
    wds.write_index(index, str(shards.paths[0].parent / "shard.index.json"))
    assert resolve_sample_counts(urls, index=str(shards.paths[0].parent / "shard.index.json")) == [
        2,
        5,
        3,
    ]


def write_members(path: Path, names: list[str], size: int) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"x" * size))


@pytest.mark.parametrize("same_size", [False, True])
def test_a_rewritten_shard_is_recounted(tmp_path: Path, same_size: bool) -> None:
    """The node remembers counts per shard *version*: a shard rewritten in place (a new size,
    or the same size and a new mtime) is counted again, so its new samples are all read."""
    shard = tmp_path / "shard-000000.tar"
    write_members(shard, ["a.bin"], 2048)
    assert resolve_sample_counts([str(shard)]) == [1]
    before = shard.stat()
    if same_size:
        # Four 512-byte members instead of one of 2048: tarfile pads both to one 10 KiB record.
        write_members(shard, ["a.bin", "b.bin", "c.bin", "d.bin"], 512)
        assert shard.stat().st_size == before.st_size
    else:
        write_members(shard, [f"{k}.bin" for k in "abcd"], 4096)
        assert shard.stat().st_size != before.st_size
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert resolve_sample_counts([str(shard)]) == [4]


def test_a_shard_shorter_than_its_count_still_keeps_ranks_equal(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([4, 4])
    wrong = {str(shards.paths[0]): 4, str(shards.paths[1]): 6}  # the second really has 4
    urls = [str(p) for p in shards.paths]
    per_rank = ranks_keys(urls, monkeypatch, 2, sample_counts=wrong, shardshuffle=False)
    assert [len(keys) for keys in per_rank] == [5, 5]
    assert "fewer samples than its count said" in caplog.text


def test_with_epoch_or_one_rank_does_not_balance(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3, 1, 4])
    assert len(keys_of(wds.WebDataset(shards.spec(), shardshuffle=False))) == 8
    per_rank = ranks_keys(shards.spec(), monkeypatch, 2, shardshuffle=False, empty_check=False)
    assert sorted(len(k) for k in per_rank) == [4, 4]
    monkeypatch.setenv("RANK", "0")
    ds = wds.WebDataset(shards.spec(), shardshuffle=False).with_epoch(6)
    assert len(keys_of(ds)) == 6


def test_balance_refuses_what_it_cannot_combine_with(make_shards: Any) -> None:
    shards = make_shards([2, 2])
    with pytest.raises(ConfigError, match="balance"):
        wds.WebDataset(shards.spec(), balance="fair")
    with pytest.raises(ConfigError, match="resampled"):
        wds.WebDataset(shards.spec(), balance="drop", resampled=True)
    with pytest.raises(ConfigError, match="nodesplitter"):
        wds.WebDataset(shards.spec(), balance="drop", nodesplitter=lambda src: src)


def test_fewer_shards_than_consumers_is_explained(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([3, 3])
    ranks_keys(shards.spec(), monkeypatch, 3, balance=None, empty_check=False)
    assert "2 shards for 3 consumers" in caplog.text
    assert "balance='drop'" in caplog.text


def test_rank_and_world_size_can_be_given_explicitly(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(UNEVEN)
    from_env = ranks_keys(shards.spec(), monkeypatch, 3, shardshuffle=True)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    explicit = [
        keys_of(wds.WebDataset(shards.spec(), seed=3, shardshuffle=True, rank=r, world_size=3))
        for r in range(3)
    ]
    assert explicit == from_env
    with pytest.raises(ConfigError, match="give both"):
        wds.WebDataset(shards.spec(), rank=1)
    with pytest.raises(ConfigError, match="0 <= rank < world_size"):
        wds.WebDataset(shards.spec(), rank=3, world_size=3)


def test_slurm_variables_give_the_rank(make_shards: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_shards(UNEVEN)
    from_env = ranks_keys(shards.spec(), monkeypatch, 2, shardshuffle=True)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    slurm = []
    for rank in range(2):
        monkeypatch.setenv("SLURM_PROCID", str(rank))
        slurm.append(keys_of(wds.WebDataset(shards.spec(), seed=3, shardshuffle=True)))
    assert slurm == from_env


def test_the_index_next_to_the_shards_is_found_once_then_remembered(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shards = make_shards([2, 5, 3])
    urls = [str(p) for p in shards.paths]
    from cloudshards.indexed import default_index_url

    location = default_index_url(urls)
    wds.write_index(wds.build_index(urls), location)
    with caplog.at_level(logging.WARNING):
        assert resolve_sample_counts(urls) == [2, 5, 3]
        Path(location).unlink()  # later asks never go back to the store
        assert resolve_sample_counts(urls) == [2, 5, 3]
    assert "counting" not in caplog.text


# --- gaps found by the mutation check (integration/mutation.py) ------------------------------


def test_counting_skips_metadata_like_the_dataset(tmp_path: Path) -> None:
    from cloudshards.balance import count_shard_samples
    from cloudshards.source import FetchOptions, OpenOptions

    shard = tmp_path / "shard-000000.tar"
    write_members(shard, ["__meta__/info.json", "__a.jpg", "__a.txt", "b.jpg", "__meta__"], 1)
    assert keys_of(wds.WebDataset(str(shard), shardshuffle=False)) == ["__a", "b"]
    assert count_shard_samples(str(shard), OpenOptions(), FetchOptions()) == 2
    # A pipe: command is opened like a local file (never through the store's client).
    piped = f"pipe:cat {shard}"
    assert count_shard_samples(piped, OpenOptions(allow_pipe=True), FetchOptions()) == 2


def test_counting_opens_local_shards_directly_and_remote_ones_with_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    from cloudshards import balance
    from cloudshards.source import FetchOptions, OpenOptions

    shard = tmp_path / "shard-000000.tar"
    write_members(shard, ["a.jpg", "b.jpg"], 1)
    remote = f"memory://cloudshards-balance-{tmp_path.name}/shard-000000.tar"
    fsspec.filesystem("memory").pipe(remote, shard.read_bytes())
    opened: list[str] = []
    from cloudshards.source import opener

    real_open_remote = opener.open_remote

    def open_remote(url: str, options: Any, **kw: Any) -> Any:
        opened.append(url)
        return real_open_remote(url, options, **kw)

    monkeypatch.setattr(opener, "open_remote", open_remote)
    options, fetch = OpenOptions(allow_pipe=True), FetchOptions()
    for url in (str(shard), f"file://{shard}", f"pipe:cat {shard}", remote):
        assert balance.count_shard_samples(url, options, fetch) == 2
    assert opened == [remote]
    fsspec.filesystem("memory").rm(remote)


def test_counting_through_the_cache_uses_the_callers_fetch_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    from cloudshards import balance
    from cloudshards.cache import ShardCache
    from cloudshards.source import FetchOptions, OpenOptions, opener

    shard = tmp_path / "shard-000000.tar"
    write_members(shard, ["a.jpg", "b.jpg"], 1)
    remote = f"memory://cloudshards-balance-{tmp_path.name}/cached-000000.tar"
    fsspec.filesystem("memory").pipe(remote, shard.read_bytes())
    given: list[Any] = []
    real_open_remote = opener.open_remote

    def open_remote(url: str, options: Any, **kw: Any) -> Any:
        given.append(kw.get("fetch"))
        return real_open_remote(url, options, **kw)

    monkeypatch.setattr(opener, "open_remote", open_remote)
    fetch = FetchOptions(retries=1, stall_timeout_s=7.0)
    cache = ShardCache(tmp_path / "cache")
    try:
        assert balance.count_shard_samples(remote, OpenOptions(), fetch, cache) == 2
    finally:
        fsspec.filesystem("memory").rm(remote)
    assert given == [fetch]  # not the environment's defaults (5 retries, 120 s)
    assert cache.stats.misses == 1


def test_counts_file_goes_where_configured(
    make_shards: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([2, 3])
    directory = tmp_path / "not" / "yet" / "there"
    monkeypatch.setenv("CLOUDSHARDS_COUNTS_DIR", str(directory))
    assert resolve_sample_counts([str(p) for p in shards.paths]) == [2, 3]
    assert [p for p in directory.iterdir() if not p.name.endswith(".lock")]


def test_given_counts_are_checked_then_used_as_they_are(make_shards: Any) -> None:
    shards = make_shards([2, 5])
    urls = [str(p) for p in shards.paths]
    with pytest.raises(ConfigError, match="no entry for"):
        resolve_sample_counts(urls, counts={urls[0]: 2})
    assert resolve_sample_counts(urls, counts=[7, 1]) == [7, 1]  # trusted, not recounted
    assert resolve_sample_counts([]) == []


def test_an_explicit_index_wins_or_fails_loudly(
    make_shards: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cloudshards.errors import ShardOpenError

    shards = make_shards([2, 5, 3])
    urls = [str(p) for p in shards.paths]
    partial = str(tmp_path / "partial.index.json")
    wds.write_index(wds.build_index(urls[:2]), partial)
    with pytest.raises(ShardOpenError, match="index not found"):
        resolve_sample_counts(urls, index=str(tmp_path / "missing.index.json"))
    with pytest.raises(ConfigError, match="does not list 1 of the 3 shards"):
        resolve_sample_counts(urls, index=partial)
    with caplog.at_level(logging.WARNING):
        assert resolve_sample_counts(urls[:2], index=partial) == [2, 5]
    assert "counting" not in caplog.text  # the index is the answer: no pass, no counts file
    assert resolve_sample_counts(urls[:2]) == [2, 5]
    assert "counting the samples of 2 shards once" in caplog.text


def test_an_index_at_the_default_place_that_lacks_a_shard_is_ignored(
    make_shards: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from cloudshards.indexed import default_index_url

    shards = make_shards([2, 5, 3])
    urls = [str(p) for p in shards.paths]
    wds.write_index(wds.build_index(urls[:2]), default_index_url(urls))
    with caplog.at_level(logging.WARNING):
        assert resolve_sample_counts(urls) == [2, 5, 3]
    assert "counting the samples of 3 shards once" in caplog.text


def test_the_counting_pass_gets_the_fetch_options_and_at_most_eight_threads(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from cloudshards import balance
    from cloudshards.source import FetchOptions

    seen: list[Any] = []
    active, most, gated = [0], [0], [False]
    changed = threading.Condition()

    def count(url: str, options: Any, fetch: Any, cache: Any) -> int:
        with changed:
            seen.append(fetch)
            active[0] += 1
            most[0] = max(most[0], active[0])
            changed.notify_all()
            if gated[0]:  # stay until eight run at once, then a little more: a ninth would show
                changed.wait_for(lambda: active[0] >= 8, timeout=5)
        if gated[0]:
            time.sleep(0.1)
        with changed:
            active[0] -= 1
            changed.notify_all()
        return 1

    monkeypatch.setattr(balance, "count_shard_samples", count)
    shards = make_shards([1] * 10)
    urls = [str(p) for p in shards.paths]
    mine = FetchOptions(retries=7)
    assert resolve_sample_counts(urls[:2], fetch=mine) == [1, 1]
    assert seen == [mine, mine]
    seen.clear()
    assert resolve_sample_counts(urls[2:]) == [1] * 8
    assert len(seen) == 8
    assert all(isinstance(f, FetchOptions) for f in seen)
    most[0], gated[0] = 0, True
    assert resolve_sample_counts(urls[::-1]) == [1] * 10  # new keys: counted again
    assert most[0] == 8


def test_saved_counts_are_read_without_waiting_for_the_counting_lock(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A complete counts file is read without the lock (a rank counting other shards holds
    it); a process that did wait finds what the counter saved meanwhile and counts nothing."""
    import fcntl
    import threading

    from cloudshards import balance

    shards = make_shards([2, 3])
    urls = [str(p) for p in shards.paths]
    assert resolve_sample_counts(urls) == [2, 3]
    directory = Path(os.environ["CLOUDSHARDS_COUNTS_DIR"])
    (saved,) = [p for p in directory.iterdir() if not p.name.endswith(".lock")]
    content = saved.read_bytes()

    def no_counting(*args: Any) -> int:
        raise AssertionError("counted again")

    monkeypatch.setattr(balance, "count_shard_samples", no_counting)
    reads = threading.Event()
    real_read = balance._read_counts

    def read(path: Path) -> Any:
        result = real_read(path)
        reads.set()
        return result

    monkeypatch.setattr(balance, "_read_counts", read)
    results: list[Any] = []

    def resolve() -> None:
        try:
            results.append(resolve_sample_counts(urls))
        except BaseException as exc:  # reported by the assertions below
            results.append(exc)

    with open(str(saved) + ".lock", "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        thread = threading.Thread(target=resolve)
        thread.start()
        thread.join(timeout=10)
        assert results == [[2, 3]]  # did not wait for the lock
        saved.unlink()
        reads.clear()
        thread = threading.Thread(target=resolve)
        thread.start()
        assert reads.wait(timeout=10)  # it found no counts file: now it waits for the lock
        thread.join(timeout=0.3)
        assert thread.is_alive()
        saved.write_bytes(content)  # what the process holding the lock saved
    thread.join(timeout=10)
    assert results == [[2, 3], [2, 3]]


def test_padding_repeats_the_consumers_own_first_sample() -> None:
    shards = [{"url": "u0", "shard_index": 0}]
    segments = list(assign_samples(shards, {0: 3}, consumer=1, num_consumers=2, mode="pad"))
    assert segments == [
        {"url": "u0", "shard_index": 0, "skip": 2, "take": 1, "count": 3},
        {"url": "u0", "shard_index": 0, "skip": 2, "take": 1, "pad": True},
    ]
    # Fewer samples than consumers: the epoch's first sample, from a shard that has one.
    shards = [{"url": "u0", "shard_index": 0}, {"url": "u1", "shard_index": 1}]
    segments = list(assign_samples(shards, {0: 0, 1: 1}, consumer=2, num_consumers=3, mode="pad"))
    assert segments == [{"url": "u1", "shard_index": 1, "skip": 0, "take": 1, "pad": True}]


def test_limit_and_subsample_take_a_balanced_run_of_each_epoch(make_shards: Any) -> None:
    shards = make_shards([9, 14, 5, 20, 11, 7, 13, 16])  # 95 samples
    per_rank = {}
    for rank in (0, 1):
        data = wds.WebDataset(
            shards.spec(), shardshuffle=True, seed=3, limit=41, rank=rank, world_size=2
        )
        data.set_epoch(0)
        per_rank[rank] = keys_of(data)
    both = per_rank[0] + per_rank[1]
    assert len(per_rank[0]) == len(per_rank[1]) == 20  # 41 // 2 each
    assert len(set(both)) == 40
    assert set(both) <= set(shards.keys)
    data = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3, subsample=0.25)
    epochs = []
    for epoch in (0, 1):
        data.set_epoch(epoch)
        epochs.append(keys_of(data))
        assert len(epochs[-1]) == len(set(epochs[-1])) == int(0.25 * 95)
    assert set(epochs[0]) != set(epochs[1])  # another subset each epoch
    again = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3, subsample=0.25)
    again.set_epoch(1)
    assert keys_of(again) == epochs[1]  # deterministic for (seed, epoch)


def test_a_limited_epoch_resumes_exactly(make_shards: Any) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    shards = make_shards([9, 14, 5, 20, 11, 7, 13, 16])

    def build() -> Any:
        data = wds.WebDataset(shards.spec(), shardshuffle=True, seed=3, limit=50).shuffle(10)
        data.set_epoch(2)
        return StatefulDataLoader(data, batch_size=None, num_workers=2)

    everything = keys_of(build())
    loader = build()
    it = iter(loader)
    head = [next(it)["__key__"] for _ in range(17)]
    state = loader.state_dict()
    del it
    restored = build()
    restored.load_state_dict(state)
    assert head + keys_of(restored) == everything
    assert len(everything) == 50


def test_subsample_and_limit_are_checked(make_shards: Any) -> None:
    spec = make_shards([3, 3]).spec()
    for kw in ({"subsample": 0}, {"subsample": 1.5}, {"limit": -1}):
        with pytest.raises(ConfigError, match=r"subsample|limit"):
            wds.WebDataset(spec, **kw)
    with pytest.raises(ConfigError, match="resampled"):
        wds.WebDataset(spec, resampled=True, limit=3)


@pytest.mark.parametrize("balance", ["auto", "drop", None])
def test_nodesplitter_none_lets_each_rank_read_the_shards_it_was_given(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch, balance: str | None
) -> None:
    """webdataset programs that split the URL list per rank themselves turn node splitting
    off with nodesplitter=None: no rank may then lose half of its own shards to a second split;
    its workers still share them without duplicates."""
    shards = make_shards([3, 1, 4, 2])
    urls = [str(p) for p in shards.paths]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        mine = urls[rank::2]
        expected = [
            k for k in shards.keys if any(k.startswith(f"s{i:04d}_") for i in range(rank, 4, 2))
        ]

        def build(mine: list[str] = mine) -> Any:
            return wds.WebDataset(mine, shardshuffle=False, nodesplitter=None, balance=balance)

        assert keys_of(build()) == expected
        read = keys_of(wds.WebLoader(build(), batch_size=None, num_workers=2))
        assert len(set(read)) == len(read)
        assert set(read) <= set(expected)
        # "drop" gives the rank's 2 workers equal runs (one of 7 samples left out).
        assert len(read) == (len(expected) // 2 * 2 if balance == "drop" else len(expected))


def test_workersplitter_none_balances_over_ranks_only(
    make_shards: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3, 1, 4, 2])
    per_rank = ranks_keys(shards.spec(), monkeypatch, 2, balance="drop", workersplitter=None)
    assert [len(k) for k in per_rank] == [5, 5]
    assert sorted(per_rank[0] + per_rank[1]) == sorted(shards.keys)
    monkeypatch.setenv("RANK", "1")
    loader = wds.WebLoader(
        wds.WebDataset(shards.spec(), seed=3, balance="drop", workersplitter=None),
        batch_size=None,
        num_workers=2,
    )
    assert sorted(keys_of(loader)) == sorted(per_rank[1] * 2)  # each worker reads it all
