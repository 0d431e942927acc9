"""Cache writes past the page cache (:mod:`cloudshards.cache.direct`, with
``CLOUDSHARDS_CACHE_O_DIRECT=1``): every byte lands in order whatever the chunking, followers
see the bytes as they come, a filesystem that refuses direct I/O is written through the page
cache instead, and an entry out of the page cache is asked of the disk whole when its hit is
opened."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import random
import time
from pathlib import Path

import fakes
import pytest

from cloudshards.cache import ShardCache, entry_name
from cloudshards.cache import direct as direct_module
from cloudshards.cache.direct import ALIGN, PAGE_CACHE_WRITE, STAGE_BYTES, PartialWriter

O_DIRECT = getattr(os, "O_DIRECT", 0)


def _direct_allowed(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` takes O_DIRECT writes (tmpfs did not, once)."""
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return bool(O_DIRECT)


@pytest.fixture(autouse=True)
def direct_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDSHARDS_CACHE_O_DIRECT", "1")


def _writer(path: Path) -> tuple[int, PartialWriter]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    return fd, PartialWriter(fd)


def _resident(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache (mincore(2))."""
    size = path.stat().st_size
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    libc = ctypes.CDLL(None, use_errno=True)
    vector = (ctypes.c_ubyte * pages)()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as view:
        anchor = ctypes.c_char.from_buffer(view)
        try:
            result = libc.mincore(
                ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector
            )
        finally:
            del anchor
    if result != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector) / pages


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _wait_resident(path: Path, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (fraction := _resident(path)) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return fraction


DATA = random.Random(7).randbytes(3 * STAGE_BYTES + 12_345)


def _chunks(sizes: list[int]) -> list[bytes]:
    out, at = [], 0
    for size in sizes:
        out.append(DATA[at : at + size])
        at += size
    out.append(DATA[at:])
    return out


CHUNKINGS = {
    "one byte, then the rest": [1],
    "just short of a block": [ALIGN - 1, 1, ALIGN + 1],
    "whole blocks": [ALIGN, 2 * ALIGN, 8 * ALIGN],
    "larger than the buffer": [STAGE_BYTES + 3, STAGE_BYTES - 2],
    "ragged": random.Random(3).choices(range(1, 300_000), k=20),
}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("sizes", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
def test_every_byte_lands_in_order_whatever_the_chunking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int], direct: bool
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_CACHE_O_DIRECT", "1" if direct else "0")
    path = tmp_path / "entry.partial"
    fd, writer = _writer(path)
    try:
        assert writer.direct == (direct and _direct_allowed(tmp_path))
        for chunk in _chunks(sizes):
            writer.write(memoryview(chunk))
        writer.finish()
        assert writer.written == len(DATA)
    finally:
        writer.release()
        os.close(fd)
    assert path.read_bytes() == DATA


def test_a_large_part_reaches_the_page_cache_at_most_a_mib_per_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part of several MiB handed to one ``write`` made the kernel fill the file with 2 MiB
    folios: about ten times the system time of 1 MiB writes on these VMs (see
    ``PAGE_CACHE_WRITE``). Every byte still lands, in order."""
    monkeypatch.setenv("CLOUDSHARDS_CACHE_O_DIRECT", "0")
    sizes: list[int] = []
    real_write = os.write

    def write(fd: int, data: bytes | memoryview) -> int:
        sizes.append(len(data))
        return real_write(fd, data)

    path = tmp_path / "entry.partial"
    fd, writer = _writer(path)
    monkeypatch.setattr(os, "write", write)
    data = random.Random(5).randbytes(5 * PAGE_CACHE_WRITE + 12345)
    try:
        writer.write(memoryview(data))
        writer.finish()
    finally:
        monkeypatch.undo()
        writer.release()
        os.close(fd)
    assert path.read_bytes() == data
    assert max(sizes) == PAGE_CACHE_WRITE == 1 << 20
    assert len(sizes) == 6


def test_direct_writes_bypass_the_page_cache(tmp_path: Path) -> None:
    """The file's pages are not filled by this process's writes: they neither cost it the
    CPU nor push other pages out."""
    if not _direct_allowed(tmp_path):
        pytest.fail(f"the test directory {tmp_path} takes no O_DIRECT writes: nothing to check")
    data = random.Random(1).randbytes(20 << 20)
    path = tmp_path / "entry.partial"
    fd, writer = _writer(path)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT
        writer.write(data[:-100])
        writer.write(data[-100:])
        writer.finish()
    finally:
        writer.release()
        os.close(fd)
    assert _resident(path) < 0.05  # only the unaligned end went through the page cache
    assert path.read_bytes() == data


def test_followers_see_the_bytes_as_they_are_written(tmp_path: Path) -> None:
    """A follower reads the partial file while it grows: all but the last unaligned bytes
    (fewer than one block) are in the file after each write, and every byte after finish."""
    path = tmp_path / "entry.partial"
    fd, writer = _writer(path)
    try:
        written = 0
        for chunk in _chunks([10_000, 5, 70_000]):
            writer.write(chunk)
            written += len(chunk)
            on_disk = path.read_bytes()
            assert written - len(on_disk) < ALIGN
            assert on_disk == DATA[: len(on_disk)]
        writer.finish()
        assert path.read_bytes() == DATA
    finally:
        writer.release()
        os.close(fd)


def test_a_filesystem_that_refuses_direct_writes_is_written_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems accept O_DIRECT at open and refuse the writes (EINVAL): the writer
    turns it off and writes the same bytes through the page cache, losing none."""
    if not _direct_allowed(tmp_path):
        pytest.fail(f"the test directory {tmp_path} takes no O_DIRECT writes: nothing to check")
    real_write = os.write
    refused = []

    def refusing(fd: int, data: object) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_module.os, "write", refusing)
    path = tmp_path / "entry.partial"
    fd, writer = _writer(path)
    try:
        for chunk in _chunks([ALIGN * 3 + 1, 100, STAGE_BYTES]):
            writer.write(chunk)
        writer.finish()
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT
    finally:
        writer.release()
        os.close(fd)
    assert len(refused) == 1
    assert path.read_bytes() == DATA


def test_a_full_disk_is_an_os_error_from_the_write_that_meets_it(tmp_path: Path) -> None:
    """The tee tells a full disk from other failures by the OSError's errno: a direct write
    to a full disk raises ENOSPC as a buffered one does."""
    path = tmp_path / "entry.partial"
    fd, writer = _writer(path)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, fd)
        with pytest.raises(OSError, match="No space left") as caught:
            writer.write(DATA)  # more than a block: written at once
        assert caught.value.errno == errno.ENOSPC
    finally:
        writer.release()
        os.close(full)
        os.close(fd)


def test_a_hit_out_of_the_page_cache_is_read_ahead_when_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry out of the page cache (written past it, or evicted) is asked of the disk whole
    when its hit is opened, past the kernel's one-call read-ahead limit (12 MiB here, over
    the 8 MiB this VM's disk reads for one call), before the reader slices it."""
    fakes.register()
    for name in fakes.ENV_KNOBS:
        monkeypatch.delenv(name, raising=False)
    source = tmp_path / "shard.tar"
    source.write_bytes(random.Random(2).randbytes(12 << 20))
    url = fakes.url_of(source)
    cache = ShardCache(tmp_path / "cache")
    stream = cache.open(url)  # a miss: downloaded
    try:
        assert fakes.read_all(stream) == source.read_bytes()
    finally:
        stream.close()
    entry = tmp_path / "cache" / "data" / entry_name(url)
    assert entry.is_file()
    _evict(entry)
    assert _resident(entry) < 0.5
    stream = cache.open(url)  # a hit: opened, nothing read yet
    try:
        assert cache.stats.hits == 1
        assert _wait_resident(entry) == 1.0
    finally:
        stream.close()
