"""A shared cache directory that another user tampers with while a run reads through it: a
subdirectory swapped for a symlink after the first shard, and foreign files left in ``data/``.

Nothing may be written outside the cache, and a foreign file must not stop the run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import fakes
import pytest

import cloudshards as wds
from cloudshards.cache import ShardCache, entry_name
from cloudshards.cache import lock as cachelock
from cloudshards.cache.keys import store_endpoint
from cloudshards.source import OpenOptions


@pytest.fixture
def shards(make_shards: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Three shards, to be read as a remote store (``slowfile://``) so that they are cached."""
    fakes.register()
    for knob in fakes.ENV_KNOBS:
        monkeypatch.delenv(knob, raising=False)
    return make_shards([3, 3, 3], payload_bytes=2000)


@pytest.fixture
def urls(shards: Any) -> list[str]:
    return [fakes.url_of(path) for path in shards.paths]


def swap_for_symlink(cache_dir: Path, sub: str, outside: Path) -> None:
    """What another user of the directory does: move ``sub`` away, put a symlink there."""
    (cache_dir / sub).rename(cache_dir / f"{sub}.old")
    (cache_dir / sub).symlink_to(outside)


def dataset(urls: list[str], cache_dir: Path, **kwargs: Any) -> Any:
    return wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), prefetch=0, **kwargs)


@pytest.mark.parametrize("sub", ["data", "meta", "locks"])
def test_a_subdirectory_swapped_for_a_symlink_mid_run_is_refused(
    urls: list[str], tmp_path: Path, sub: str
) -> None:
    """The subdirectories were checked only when the first shard was opened: a ``data/``
    swapped for a symlink afterwards received every later download."""
    cache_dir, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    it = iter(dataset(urls, cache_dir))
    next(it)
    swap_for_symlink(cache_dir, sub, outside)
    with pytest.raises(wds.CacheError, match=f"{cache_dir / sub} is a symlink"):
        list(it)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("how", ["removed", "replaced by a directory"])
def test_a_cache_emptied_mid_run_is_made_again_and_the_run_goes_on(
    urls: list[str], shards: Any, tmp_path: Path, how: str
) -> None:
    """``rm -rf`` of the cache (or a new directory in its place) while a job reads it: the
    job reads on, and caches into the cache as it is now. Only a symlink is refused."""
    import shutil

    cache_dir = tmp_path / "c"
    it = iter(dataset(urls, cache_dir))
    keys = [next(it)["__key__"]]
    for _ in range(100):  # a download ahead may be writing in it meanwhile
        shutil.rmtree(cache_dir, ignore_errors=True)
        if not cache_dir.exists():
            break
    assert not cache_dir.exists()
    if how != "removed":  # (a download ahead, or its stats, may have made some of them again)
        for sub in ("data", "meta", "locks", "stats"):
            (cache_dir / sub).mkdir(parents=True, exist_ok=True)
    keys += [sample["__key__"] for sample in it]
    assert len(keys) == 9
    assert len(set(keys)) == 9
    entries = [p for p in (cache_dir / "data").iterdir() if not p.name.endswith(".partial")]
    assert len(entries) >= 2  # the shards after the first were cached again


def test_a_data_directory_swapped_as_a_download_starts_gets_no_file(
    urls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapped after the shard's open checked the directories, before its partial file is
    created: the download is refused, nothing is created outside."""
    cache_dir, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    ShardCache(cache_dir)._ensure_ready()

    def swap(point: str) -> None:
        if point == "before_claim" and not (cache_dir / "data").is_symlink():
            swap_for_symlink(cache_dir, "data", outside)

    monkeypatch.setattr(cachelock, "_checkpoint", swap)
    with pytest.raises(wds.CacheError, match=f"{cache_dir / 'data'} is a symlink"):
        list(dataset(urls[:1], cache_dir))
    assert list(outside.iterdir()) == []


def test_a_data_directory_swapped_before_the_commit_receives_no_entry(
    shards: Any,
    urls: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Swapped while the shard downloads: the reader still gets every sample, the entry is
    not cached, and nothing is renamed (or removed) through the symlink."""
    cache_dir, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    planted = outside / (entry_name(urls[0], store_endpoint(urls[0], OpenOptions())) + ".partial")
    planted.write_text("not the cache's\n")

    def swap(point: str) -> None:
        if point == "before_rename":
            swap_for_symlink(cache_dir, "data", outside)

    monkeypatch.setattr(cachelock, "_checkpoint", swap)
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        samples = list(dataset(urls[:1], cache_dir))
    assert [s["__key__"] for s in samples] == shards.keys[:3]
    assert sorted(p.name for p in outside.iterdir()) == [planted.name]
    assert planted.read_text() == "not the cache's\n"
    assert "cannot commit" in caplog.text
    assert "is a symlink" in caplog.text


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_foreign_file_in_data_is_skipped_by_eviction(
    shards: Any, urls: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """A symlink, FIFO or directory in ``data/`` made every eviction raise, which stopped the
    run. Eviction skips it (one warning naming it) and leaves it alone."""
    cache_dir = tmp_path / "c"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (cache_dir / "data").mkdir(parents=True)
    planted = cache_dir / "data" / "0000planted"
    if kind == "symlink":
        planted.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(planted)
    else:
        planted.mkdir()
    budget = max(path.stat().st_size for path in shards.paths) + 100  # room for one shard
    with caplog.at_level(logging.WARNING, logger="cloudshards"):
        ds = dataset(urls, cache_dir, cache_size=budget)
        samples = list(ds)
    assert [s["__key__"] for s in samples] == shards.keys
    assert ds.cache.stats.evictions == 2  # each later shard evicted the one before
    warnings = [r.getMessage() for r in caplog.records if "0000planted" in r.getMessage()]
    assert len(warnings) == 1
    assert "not a regular file" in warnings[0]
    assert os.path.lexists(planted)
    assert victim.read_text() == "precious\n"


def test_cache_info_counts_entries_and_never_follows_what_is_planted(tmp_path: Path) -> None:
    """``cache_info`` (and ``cloudshards cache``) count the entries; a symlink, FIFO or
    directory planted in ``data/`` is neither counted nor followed (a dangling link raised)."""
    from cloudshards.cache import cache_info

    data = tmp_path / "cache" / "data"
    data.mkdir(parents=True)
    (data / "0123-shard.tar").write_bytes(b"x" * 100)
    (data / "4567-shard.tar.partial").write_bytes(b"y")
    (data / "dangling").symlink_to(tmp_path / "nowhere")
    (data / "big-link").symlink_to("/proc/kcore")
    os.mkfifo(data / "fifo")
    (data / "directory").mkdir()
    info = cache_info(tmp_path / "cache")
    assert (info["entries"], info["bytes"], info["partial"]) == (1, 100, 1)


def swap_after_check(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, outside: Path, subs: tuple[str, ...]
) -> None:
    """Swap ``data/`` for a symlink right after the cache's own check of ``subs`` passed: the
    window between a check by path and the open that follows it."""
    real = ShardCache._check_dirs

    def check_then_swap(self: ShardCache, *checked: str) -> None:
        real(self, *checked)
        if checked == subs and not (cache_dir / "data").is_symlink():
            swap_for_symlink(cache_dir, "data", outside)

    monkeypatch.setattr(ShardCache, "_check_dirs", check_then_swap)


def test_a_data_directory_swapped_after_its_check_gets_no_partial_file(
    urls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The partial file was created by path after the directory's check: a symlink swapped
    in between received it. It is created in the directory checked, or refused."""
    cache_dir, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    swap_after_check(monkeypatch, cache_dir, outside, ("data",))
    with pytest.raises(wds.CacheError, match=f"{cache_dir / 'data'} is a symlink"):
        list(dataset(urls[:1], cache_dir))
    assert list(outside.iterdir()) == []


def test_a_data_directory_swapped_after_its_check_serves_no_planted_entry(
    shards: Any, urls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache hit was opened by path after the directory's check: a symlink swapped in
    between was read, found not to match the entry's record, and removed: another user's
    file, deleted through the link. Nothing is opened or removed through it now."""
    cache_dir, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    assert [s["__key__"] for s in dataset(urls[:1], cache_dir)] == shards.keys[:3]
    (entry,) = (p for p in (cache_dir / "data").iterdir() if not p.name.endswith(".partial"))
    with wds.TarWriter(str(outside / entry.name)) as sink:
        sink.write({"__key__": "planted", "txt": "not the dataset's"})
    real = ShardCache._ensure_ready

    def ready_then_swap(self: ShardCache) -> None:
        real(self)
        if not (cache_dir / "data").is_symlink():
            swap_for_symlink(cache_dir, "data", outside)

    monkeypatch.setattr(ShardCache, "_ensure_ready", ready_then_swap)
    with pytest.raises(wds.CacheError, match=f"{cache_dir / 'data'} is a symlink"):
        list(dataset(urls[:1], cache_dir))
    assert sorted(p.name for p in outside.iterdir()) == [entry.name]


def test_a_data_directory_swapped_before_the_reservation_loses_and_gains_nothing(
    urls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapped after the download's check, before it clears a dead partial file and reserves
    room (with a budget): the clearing removed, and the reservation created, files named
    like the cache's in the other user's directory."""
    cache_dir, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    planted = outside / (entry_name(urls[0], store_endpoint(urls[0], OpenOptions())) + ".partial")
    planted.write_text("not the cache's\n")
    swap_after_check(monkeypatch, cache_dir, outside, ("data", "locks"))
    with pytest.raises(wds.CacheError, match=f"{cache_dir / 'data'} is a symlink"):
        list(dataset(urls[:1], cache_dir, cache_size=10**9))
    assert sorted(p.name for p in outside.iterdir()) == [planted.name]
    assert planted.read_text() == "not the cache's\n"
