"""Downloads ahead into the node cache: the shards after the next one are written by background
threads at the store's speed, each still fetched once, counted once, and cancelled cleanly when
the reader stops early."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fakes
import pytest

import cloudshards as wds
from cloudshards import prefetch
from cloudshards.cache import entry_name


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    log = tmp_path / "opens.log"
    monkeypatch.setenv(fakes.OPEN_LOG_ENV, str(log))
    return log


def opens(log: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        counts[line] = counts.get(line, 0) + 1
    return counts


def test_later_shards_are_downloaded_ahead_once_each(
    make_shards: Any, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3] * 8, payload_bytes=4000)
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    started: list[str] = []
    original = wds.ShardCache.download_ahead

    def spy(self: Any, url: str, *args: Any, **kw: Any) -> Any:
        thread = original(self, url, *args, **kw)
        if thread is not None:
            started.append(url)
        return thread

    monkeypatch.setattr(wds.ShardCache, "download_ahead", spy)
    monkeypatch.setenv(fakes.OPEN_DELAY_ENV, "0.02")  # a store with first-byte latency
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), prefetch=2)
    got = [(s["__key__"], s["bin"]) for s in ds]
    assert got == [(key, fields["bin"]) for key, fields in shards.samples]
    assert started  # from the shard after the first committed entry on
    assert set(started) <= set(urls[1:])
    assert opens(store) == {str(p): 1 for p in shards.paths}
    for url, path in zip(urls, shards.paths, strict=True):
        assert (cache_dir / "data" / entry_name(url)).read_bytes() == path.read_bytes()
    stats = ds.cache.stats  # type: ignore[union-attr]
    # Shards read back after downloading them ahead are misses, not hits.
    assert (stats.misses, stats.hits, stats.waits) == (8, 0, 0)
    assert prefetch.current_thread_count() == 0


def test_an_early_stop_cancels_the_downloads_ahead(
    make_shards: Any, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards([3] * 6, payload_bytes=200_000)
    urls = [fakes.url_of(p) for p in shards.paths]
    cache_dir = tmp_path / "cache"
    ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache_dir), prefetch=2)
    list(ds)  # one full epoch commits entries; now the same shards under new names
    copies = [tmp_path / f"copy-{i}.tar" for i in range(6)]
    for source, copy in zip(shards.paths, copies, strict=True):
        copy.write_bytes(source.read_bytes())
    monkeypatch.setenv(fakes.DELAY_ENV, "0.05")  # slow reads: the downloads are mid-way
    again = wds.WebDataset(
        [fakes.url_of(p) for p in copies], shardshuffle=False, cache_dir=str(cache_dir)
    )
    it = iter(again)
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert prefetch.current_thread_count() == 0
    deadline = time.monotonic() + 10
    while any(p.name.endswith(".partial") for p in (cache_dir / "data").iterdir()):
        assert time.monotonic() < deadline, "a cancelled download left its partial file"
        time.sleep(0.05)
