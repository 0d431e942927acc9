"""TarWriter / ShardWriter: round trips through every decoder, webdataset parity, atomicity."""

from __future__ import annotations

import gc
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import warnings
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av  # a declared test dependency: missing, these tests must fail, not skip
import fsspec
import numpy as np
import pytest
import torch
import webdataset
from PIL import Image

import cloudshards
from cloudshards import ShardWriter, TarWriter, torch_audio, torch_video
from cloudshards.decoders import allow_unsafe_decoders
from cloudshards.errors import ConfigError

SIZE = (24, 32)  # H, W: even, for yuv420p video


def encode_image(array: np.ndarray[Any, Any], fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **options)
    return out.getvalue()


def image(index: int) -> np.ndarray[Any, Any]:
    """A smooth image (JPEG-friendly) that differs per sample."""
    y, x = np.mgrid[0 : SIZE[0], 0 : SIZE[1]]
    return np.stack([x * 6 + index * 10, y * 9, (x + y) * 4 + index], axis=-1).astype(np.uint8)


def frame_colors(index: int) -> list[tuple[int, int, int]]:
    return [(40 + 30 * t, 90 + index * 20, 200 - 25 * t) for t in range(6)]


def encode_video(fmt: str, codec: str, colors: list[tuple[int, int, int]], rate: int = 6) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.height, stream.width = SIZE
        stream.pix_fmt = "yuv420p"
        for color in colors:
            frame = av.VideoFrame.from_ndarray(np.full((*SIZE, 3), color, np.uint8), "rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def tone(index: int, rate: int) -> np.ndarray[Any, Any]:
    """Two channels of int16 samples, (frames, channels)."""
    t = np.arange(rate // 4)
    left = (np.sin(t * (0.05 + index / 100)) * 12000).astype(np.int16)
    return np.stack([left, -left // 2], axis=1)


def encode_wav(samples: np.ndarray[Any, Any], rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(samples.shape[1])
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()


def encode_flac(samples: np.ndarray[Any, Any], rate: int) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1).copy(), "s16", "stereo")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return out.getvalue()


def has_encoder(name: str) -> bool:
    try:
        av.codec.Codec(name, "w")
    except Exception:
        return False
    return True


VIDEO_CODECS = {"mp4": "libx264" if has_encoder("libx264") else "mpeg4", "webm": "libvpx"}


def media_sample(index: int) -> dict[str, Any]:
    """One sample with every field type, as written (bytes, or values for the encoders)."""
    pixels = image(index)
    sample: dict[str, Any] = {
        "__key__": f"clip/{index:04d}",
        "jpg": encode_image(pixels, "JPEG", quality=95),
        "png": encode_image(pixels, "PNG"),
        "webp": encode_image(pixels, "WEBP", lossless=True),
        "enc.png": pixels,  # encoded by the writer (PNG, lossless)
        "enc.jpg": pixels,  # encoded by the writer (JPEG quality 100)
        "json": {"index": index, "caption": f"clip {index}", "tags": ["a", "b"]},
        "txt": f"caption {index} é",
        "txt.gz": f"compressed {index}",
        "cls": index % 3,
        "npy": np.arange(12, dtype=np.float32).reshape(3, 4) * index,
        "npz": {"a": np.arange(index + 1), "b": np.eye(2)},
        "pth": {"w": torch.arange(4, dtype=torch.float32) * index},
        "pyd": {"index": index, "tuple": (1, 2)},
        "wav": encode_wav(tone(index, 16000), 16000),
        "flac": encode_flac(tone(index, 8000), 8000),
    }
    for ext, codec in VIDEO_CODECS.items():
        if has_encoder(codec):
            sample[ext] = encode_video(ext, codec, frame_colors(index))
    return sample


def check_decoded(decoded: dict[str, Any], index: int) -> None:
    """Compare a sample decoded with ("rgb8", torch_video, torch_audio) to what was written."""
    pixels = image(index)
    assert decoded["__key__"] == f"clip/{index:04d}"
    for field, tolerance in [("jpg", 6.0), ("enc.jpg", 2.0)]:
        error = np.abs(decoded[field].astype(int) - pixels.astype(int))
        assert decoded[field].shape == pixels.shape
        assert error.mean() < tolerance, (field, error.mean())
    for field in ("png", "webp", "enc.png"):
        assert np.array_equal(decoded[field], pixels), field
    assert decoded["json"] == {"index": index, "caption": f"clip {index}", "tags": ["a", "b"]}
    assert decoded["txt"] == f"caption {index} é"
    assert decoded["txt.gz"] == f"compressed {index}"
    assert decoded["cls"] == index % 3
    assert np.array_equal(decoded["npy"], np.arange(12, dtype=np.float32).reshape(3, 4) * index)
    assert decoded["npy"].dtype == np.float32
    assert set(decoded["npz"]) == {"a", "b"}
    assert np.array_equal(decoded["npz"]["a"], np.arange(index + 1))
    assert torch.equal(decoded["pth"]["w"], torch.arange(4, dtype=torch.float32) * index)
    assert decoded["pyd"] == {"index": index, "tuple": (1, 2)}
    for field, rate in (("wav", 16000), ("flac", 8000)):
        waveform, sample_rate = decoded[field]
        assert sample_rate == rate
        expected = tone(index, rate).T.astype(np.float32) / 32768
        assert np.array_equal(waveform.numpy(), expected), field
    for ext in VIDEO_CODECS:
        if ext not in decoded:
            continue
        video, _audio, info = decoded[ext]
        assert video.shape == (6, *SIZE, 3), ext
        assert info["video_fps"] == 6.0
        means = video.float().mean(dim=(1, 2))
        expected_colors = torch.tensor(frame_colors(index), dtype=torch.float32)
        assert torch.allclose(means, expected_colors, atol=6), (ext, means)


@pytest.fixture
def unsafe_decoding() -> Iterator[None]:
    allow_unsafe_decoders(True)  # the samples hold a pickle (.pyd) field
    yield
    allow_unsafe_decoders(False)


def test_every_decoder_round_trips_through_shardwriter(
    tmp_path: Path, unsafe_decoding: None, caplog: pytest.LogCaptureFixture
) -> None:
    assert has_encoder(VIDEO_CODECS["mp4"])  # the codecs this test relies on exist here
    names: list[str] = []
    with ShardWriter(str(tmp_path / "media-%06d.tar"), maxcount=2, post=names.append) as sink:
        for index in range(5):
            sink.write(media_sample(index))
    assert names == [str(tmp_path / f"media-{i:06d}.tar") for i in range(3)]
    assert sink.written == names
    dataset = cloudshards.WebDataset(
        str(tmp_path / "media-{000000..000002}.tar"), shardshuffle=False
    ).decode("rgb8", torch_video, torch_audio)
    decoded = list(dataset)
    assert len(decoded) == 5
    for index, sample in enumerate(decoded):
        check_decoded(sample, index)


def read_with_webdataset(spec: str) -> list[dict[str, Any]]:
    dataset = webdataset.WebDataset(spec, shardshuffle=False).decode("rgb8")
    with warnings.catch_warnings():
        # webdataset 1.0.2 leaves gzipped shards' files for the garbage collector to close.
        warnings.simplefilter("ignore", ResourceWarning)
        samples = [
            {k: v for k, v in s.items() if k not in ("__url__", "__local_path__")} for s in dataset
        ]
        gc.collect()
    return samples


def assert_same_values(ours: Any, theirs: Any) -> None:
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs)
        for key in theirs:
            assert_same_values(ours[key], theirs[key])
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype
        assert np.array_equal(ours, theirs)
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs)
    else:
        assert ours == theirs


def test_webdataset_reads_the_same_samples_as_from_its_own_writer(tmp_path: Path) -> None:
    samples = [media_sample(index) for index in range(5)]
    with ShardWriter(str(tmp_path / "ours-%03d.tar"), maxcount=2) as ours:
        for sample in samples:
            ours.write(sample)
    with webdataset.ShardWriter(str(tmp_path / "theirs-%03d.tar"), maxcount=2, verbose=0) as w:
        for sample in samples:
            w.write(sample)
    for shard in range(3):  # the same shard boundaries, shard by shard
        ours_read = read_with_webdataset(str(tmp_path / f"ours-{shard:03d}.tar"))
        theirs_read = read_with_webdataset(str(tmp_path / f"theirs-{shard:03d}.tar"))
        assert [s["__key__"] for s in ours_read] == [s["__key__"] for s in theirs_read]
        assert len(ours_read) == (2 if shard < 2 else 1)
        for a, b in zip(ours_read, theirs_read, strict=True):
            assert_same_values(a, b)
    # Raw members too: the same names, and the same bytes except where the encoder embeds a time.
    with (
        tarfile.open(tmp_path / "ours-000.tar") as a,
        tarfile.open(tmp_path / "theirs-000.tar") as b,
    ):
        names = [m.name for m in a.getmembers()]
        assert names == [m.name for m in b.getmembers() if m.type != tarfile.XHDTYPE]
        for name in names:
            if not name.endswith((".npz", ".pth", ".gz")):
                assert a.extractfile(name).read() == b.extractfile(name).read(), name  # type: ignore[union-attr]


def test_members_have_no_pax_header_unless_needed(tmp_path: Path) -> None:
    path = tmp_path / "plain.tar"
    with TarWriter(str(path), mtime=1_700_000_000) as sink:
        sink.write({"__key__": "a", "txt": "x"})
        sink.write({"__key__": "long/" + "n" * 200, "txt": "y"})
        sink.write({"__key__": "ü", "txt": "z"})
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["a.txt", "long/" + "n" * 200 + ".txt", "ü.txt"]
    assert [bool(m.pax_headers) for m in members] == [False, True, True]
    assert all(m.mtime == 1_700_000_000 and m.mode == 0o444 for m in members)
    assert all(m.uname == "bigdata" and m.gname == "bigdata" for m in members)
    # webdataset's own writer puts a PAX header before every member (float mtime): twice the size.
    with webdataset.TarWriter(str(tmp_path / "theirs.tar")) as sink:
        sink.write({"__key__": "a", "txt": "x"})
    with tarfile.open(tmp_path / "theirs.tar") as tar:
        assert tar.getmembers()[0].pax_headers


def test_format_is_honoured(tmp_path: Path) -> None:
    with TarWriter(str(tmp_path / "u.tar"), format="USTAR_FORMAT") as sink:
        with pytest.raises(ValueError, match=r"too long|unicode|name"):
            sink.write({"__key__": "ü" * 200, "txt": "x"})
        sink.abort()
    with pytest.raises(ConfigError, match="unknown tar format"):
        TarWriter(str(tmp_path / "v.tar"), format="NOPE")
    assert not (tmp_path / "v.tar").exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("suffix", [".tar.gz", ".tgz", ".tar.xz", ".tar.bz2"])
def test_compressed_shards_follow_the_name(tmp_path: Path, suffix: str) -> None:
    path = str(tmp_path / f"data{suffix}")
    with TarWriter(path) as sink:
        for index in range(3):
            sink.write({"__key__": f"k{index}", "cls": index, "txt": "hello" * 50})
    with tarfile.open(path) as tar:  # a real compressed tar
        assert len(tar.getmembers()) == 6
    if suffix in (".tar.gz", ".tgz"):
        assert Path(path).read_bytes()[:2] == b"\x1f\x8b"
        decoded = list(cloudshards.WebDataset(path, shardshuffle=False).decode())
        assert [s["cls"] for s in decoded] == [0, 1, 2]
        assert [s["cls"] for s in read_with_webdataset(path)] == [0, 1, 2]


def test_tarwriter_on_a_stream_leaves_it_open(tmp_path: Path) -> None:
    stream = io.BytesIO()
    with TarWriter(stream, encoder=False) as sink:
        size = sink.write({"__key__": "k", "bin": b"12345", "txt": "abc", "__meta__": "m"})
    assert size == 8
    assert not stream.closed
    with tarfile.open(fileobj=io.BytesIO(stream.getvalue())) as tar:
        assert tar.getnames() == ["k.bin", "k.txt"]
    stream = io.BytesIO()
    with TarWriter(stream, keep_meta=True) as sink:
        sink.write({"__key__": "k", "txt": "abc", "__meta__": "m"})
    with tarfile.open(fileobj=io.BytesIO(stream.getvalue())) as tar:
        assert tar.getnames() == ["k.__meta__", "k.txt"]


def test_shard_boundaries_match_webdataset(tmp_path: Path) -> None:
    samples = [{"__key__": f"k{i:03d}", "bin": bytes(100 + 37 * i)} for i in range(23)]
    for maxcount, maxsize in [(5, 3e9), (100, 1500), (4, 900)]:
        ours_dir, theirs_dir = tmp_path / f"o{maxcount}", tmp_path / f"t{maxcount}"
        ours_dir.mkdir()
        theirs_dir.mkdir()
        with ShardWriter(str(ours_dir / "%02d.tar"), maxcount=maxcount, maxsize=maxsize) as a:
            for sample in samples:
                a.write(sample)
        with webdataset.ShardWriter(
            str(theirs_dir / "%02d.tar"), maxcount=maxcount, maxsize=maxsize, verbose=0
        ) as b:
            for sample in samples:
                b.write(sample)
        assert sorted(os.listdir(ours_dir)) == sorted(os.listdir(theirs_dir))
        for name in sorted(os.listdir(ours_dir)):
            with tarfile.open(ours_dir / name) as x, tarfile.open(theirs_dir / name) as y:
                assert x.getnames() == [m.name for m in y.getmembers() if m.type != b"x"]
        assert a.total == b.total == 23


def test_start_shard_opener_and_no_empty_shard(tmp_path: Path) -> None:
    opened: list[str] = []

    def opener(name: str) -> Any:
        opened.append(name)
        return open(name, "wb")  # the ShardWriter closes it

    with ShardWriter(str(tmp_path / "s-%d.tar"), maxcount=2, start_shard=7, opener=opener) as w:
        for index in range(3):
            w.write({"__key__": str(index), "txt": "x"})
    assert opened == [str(tmp_path / "s-7.tar"), str(tmp_path / "s-8.tar")]
    with tarfile.open(tmp_path / "s-8.tar") as tar:  # closed by the writer, complete
        assert tar.getnames() == ["2.txt"]
    with ShardWriter(str(tmp_path / "empty-%d.tar")):
        pass  # webdataset would leave an empty shard here
    assert sorted(os.listdir(tmp_path)) == ["s-7.tar", "s-8.tar"]


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="%d-style"):
        ShardWriter(str(tmp_path / "no-pattern.tar"))
    with pytest.raises(ConfigError, match="positive"):
        ShardWriter(str(tmp_path / "%d.tar"), maxcount=0)
    with pytest.raises(ConfigError, match="unknown protocol"):
        ShardWriter("nope://bucket/%d.tar").write({"__key__": "k", "txt": "x"})
    with TarWriter(str(tmp_path / "bad.tar")) as sink:
        with pytest.raises(ConfigError, match="__key__"):
            sink.write({"txt": "no key"})
        with pytest.raises(ConfigError, match=r"'weird' of sample 'k'.*no encoder for \.weird"):
            sink.write({"__key__": "k", "weird": object()})
        with pytest.raises(ConfigError, match="'png' of sample 'k'"):
            sink.write({"__key__": "k", "png": np.full((4, 4), 2.0)})  # floats outside [0, 1]
        with pytest.raises(ConfigError, match=r"field '' of sample 'k'.*needs a name"):
            sink.write({"__key__": "k", "": b"x"})
        sink.write({"__key__": "ok", "txt": "still usable after refused samples"})
    with (
        TarWriter(str(tmp_path / "raw.tar"), encoder=False) as sink,
        pytest.raises(ConfigError, match="sample 'k' has a field without a name"),
    ):
        sink.write({"__key__": "k", "": b"x"})
    with tarfile.open(tmp_path / "bad.tar") as tar:
        assert tar.getnames() == ["ok.txt"]


def leftovers(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def write_then_fail(writer: ShardWriter | TarWriter, count: int, check: Any = None) -> None:
    """Write ``count`` samples inside ``with writer``, run ``check``, then raise RuntimeError."""
    with writer:
        for index in range(count):
            writer.write({"__key__": f"k{index}", "txt": "x" * 1000})
        if check is not None:
            check()
        raise RuntimeError("boom")


def test_exception_in_with_discards_the_shard_in_progress(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail(ShardWriter(str(tmp_path / "out-%03d.tar"), maxcount=3), 5)
    assert leftovers(tmp_path) == ["out-000.tar"]  # the finished shard; no partial one
    with tarfile.open(tmp_path / "out-000.tar") as tar:
        assert len(tar.getnames()) == 3
    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail(TarWriter(str(tmp_path / "single.tar")), 1)
    assert leftovers(tmp_path) == ["out-000.tar"]


FULL_DISK_WRITER = """
import os, resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # a disk that fills at 1 MiB
from cloudshards import ShardWriter
try:
    with ShardWriter(sys.argv[1], maxcount=100) as sink:
        for index in range(30):
            sink.write({"__key__": f"k{index}", "bin": os.urandom(100_000)})
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path: Path) -> None:
    """The disk fills (EFBIG here, ENOSPC alike) with a full write buffer: closing the file
    flushes it and fails again, and the temporary file must go all the same, or a full disk
    stays full and the rerun fails too."""
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK_WRITER, str(tmp_path / "s-%03d.tar")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.startswith("ShardOpenError write failed"), result.stdout
    assert "s-000.tar" in result.stdout
    assert "could not clean up" not in result.stderr
    assert leftovers(tmp_path) == []


def test_a_failed_cleanup_is_logged_without_secrets(
    memory_root: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend's error text can hold a signed upload URL (a GCS resumable session is a
    bearer credential): the warning shows it redacted."""
    fs = fsspec.filesystem("memory")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError("upload https://storage.example/b/o?upload_id=1&X-Goog-Signature=SECRET1")

    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.DEBUG, "cloudshards"):
        patch.setattr(type(fs), "rm", refuse)
        writer = ShardWriter(f"memory://{memory_root}/c-%02d.tar")
        with pytest.raises(RuntimeError, match="boom"):
            write_then_fail(writer, 1)
    assert "could not clean up" in caplog.text
    assert "storage.example" in caplog.text
    assert "SECRET1" not in caplog.text


def test_unclosed_writer_collected_by_gc_publishes_nothing(tmp_path: Path) -> None:
    writer = TarWriter(str(tmp_path / "dropped.tar"))
    writer.write({"__key__": "k", "bin": bytes(3 << 20)})  # past the 1 MiB write buffer
    assert len(leftovers(tmp_path)) == 1
    assert leftovers(tmp_path)[0].startswith(".dropped.tar.")
    assert leftovers(tmp_path)[0].endswith(".partial")
    del writer
    gc.collect()
    assert leftovers(tmp_path) == []


def test_published_file_has_normal_permissions_and_replaces_old(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.write_bytes(b"")
    path = tmp_path / "sub" / "dir" / "x.tar"  # parent directories are created
    for content in ("first", "second"):
        with TarWriter(str(path)) as sink:
            sink.write({"__key__": "k", "txt": content})
    assert path.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777
    assert [s["txt"] for s in cloudshards.WebDataset(str(path)).decode()] == ["second"]
    assert leftovers(path.parent) == ["x.tar"]


@pytest.fixture
def memory_root() -> Iterator[str]:
    fs = fsspec.filesystem("memory")
    root = "/cloudshards-writer-test"
    yield root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_other_fsspec_filesystems_write_through_a_temporary_name(memory_root: str) -> None:
    fs = fsspec.filesystem("memory")
    with ShardWriter(f"memory://{memory_root}/m-%02d.tar", maxcount=2) as sink:
        for index in range(3):
            sink.write({"__key__": f"k{index}", "json": {"i": index}})
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(memory_root, detail=False)) == [
        "m-00.tar",
        "m-01.tar",
    ]
    decoded = cloudshards.WebDataset(f"memory://{memory_root}/m-{{00..01}}.tar").decode()
    assert [s["json"]["i"] for s in decoded] == [0, 1, 2]

    def partial_exists() -> None:
        assert any(".partial" in p for p in fs.find(memory_root))

    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail(ShardWriter(f"memory://{memory_root}/f-%02d.tar"), 1, partial_exists)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(memory_root)) == ["m-00.tar", "m-01.tar"]


KILLED_WRITER = """
import os, sys, time
from cloudshards import ShardWriter
sink = ShardWriter(sys.argv[1], maxcount=4, storage_options={storage_options})
for index in range(10):  # shards 0 and 1 finish; shard 2 gets 2 of its 4 samples
    sink.write({{"__key__": f"k{{index:03d}}", "bin": os.urandom({sample_bytes})}})
print("READY", flush=True)
time.sleep(600)
"""


def run_killed_writer(
    pattern: str, storage_options: Any = None, sample_bytes: int = 600_000, env: Any = None
) -> None:
    """Run a ShardWriter in a subprocess, SIGKILL it in the middle of its third shard."""
    script = KILLED_WRITER.format(storage_options=repr(storage_options), sample_bytes=sample_bytes)
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), pattern],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "READY"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
    assert process.returncode == -signal.SIGKILL


@pytest.mark.timeout(180)
def test_killed_writer_leaves_no_complete_looking_shard(tmp_path: Path) -> None:
    run_killed_writer(str(tmp_path / "train-%06d.tar"))
    names = leftovers(tmp_path)
    # The third shard's bytes were on disk (1.2 MB > the write buffer), under a hidden name.
    partial = [n for n in names if n.startswith(".train-000002.tar.") and n.endswith(".partial")]
    assert len(partial) == 1
    assert (tmp_path / partial[0]).stat().st_size > 0
    assert [n for n in names if not n.startswith(".")] == ["train-000000.tar", "train-000001.tar"]
    shards = cloudshards.expand_urls(str(tmp_path / "train-*.tar"))
    assert [Path(s).name for s in shards] == ["train-000000.tar", "train-000001.tar"]
    keys = [s["__key__"] for s in cloudshards.WebDataset(shards, shardshuffle=False)]
    assert keys == [f"k{index:03d}" for index in range(8)]


def test_json_encoder_output_is_plain_json(tmp_path: Path) -> None:
    path = tmp_path / "j.tar"
    with TarWriter(str(path)) as sink:
        sink.write({"__key__": "k", "json": {"a": [1, 2]}, "cls": 7, "txt": "t"})
    with tarfile.open(path) as tar:
        member = tar.extractfile("k.json")
        assert member is not None
        assert json.loads(member.read()) == {"a": [1, 2]}
        cls = tar.extractfile("k.cls")
        assert cls is not None
        assert cls.read() == b"7"


def _members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]


def test_a_dash_writes_the_shard_to_standard_output(tmp_path: Path) -> None:
    """``TarWriter("-")`` streams to stdout (``make_shards.py | aws s3 cp - s3://...``), as
    webdataset's does: no file named ``-`` appears, and stdout is not closed."""
    code = textwrap.dedent(
        """
        import sys, cloudshards as wds
        with wds.TarWriter("-") as w:
            w.write({"__key__": "a", "txt": "hello"})
        sys.stdout.buffer.write(b"")  # still open
        """
    )
    root = str(Path(cloudshards.__file__).parents[1])  # this checkout's, from another cwd
    env = {**os.environ, "PYTHONPATH": root}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, timeout=120
    )
    assert result.returncode == 0, result.stderr.decode()
    assert _members(result.stdout) == {"a.txt": b"hello"}
    assert not (tmp_path / "-").exists()


def test_a_fifo_is_written_into_not_replaced(tmp_path: Path) -> None:
    """A FIFO's reader gets the shard, and the FIFO stays one (a rename replaced it with a
    regular file and its reader got nothing)."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), name="test-reader")
    reader.start()
    try:
        with TarWriter(str(fifo)) as writer:
            writer.write({"__key__": "a", "txt": "hello"})
    finally:
        reader.join(timeout=30)
    assert _members(got[0]) == {"a.txt": b"hello"}
    assert fifo.is_fifo()


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    """A shard path that is a symlink: its target gets the shard (atomically), the link stays."""
    target = tmp_path / "store" / "target.tar"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "link.tar"
    link.symlink_to(target)
    with TarWriter(str(link)) as writer:
        writer.write({"__key__": "a", "txt": "hello"})
    assert link.is_symlink()
    assert _members(target.read_bytes()) == {"a.txt": b"hello"}
    assert sorted(os.listdir(target.parent)) == ["target.tar"]  # no temporary left


def test_a_pipe_url_is_written_into_its_command_with_the_opt_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TarWriter("pipe:aws s3 cp - s3://...")`` and a ``ShardWriter`` pattern of pipes, as
    webdataset writes to clouds: the command gets the shard on its stdin (with the opt-in)."""
    with TarWriter(f"pipe:cat > {tmp_path}/a.tar", allow_pipe=True) as sink:
        sink.write({"__key__": "a", "txt": "hello"})
    assert [s["txt"] for s in cloudshards.WebDataset(str(tmp_path / "a.tar")).decode()] == ["hello"]
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PIPE", "1")
    with ShardWriter(f"pipe:cat > {tmp_path}/s-%02d.tar", maxcount=2) as shards:
        for i in range(5):
            shards.write({"__key__": f"k{i}", "txt": str(i)})
    urls = str(tmp_path / "s-{00..02}.tar")
    assert [s["__key__"] for s in cloudshards.WebDataset(urls, shardshuffle=False)] == [
        f"k{i}" for i in range(5)
    ]


def test_a_pipe_url_needs_the_opt_in(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(ConfigError, match="CLOUDSHARDS_ALLOW_PIPE=1"):
        TarWriter(f"pipe:touch {marker}")
    with (
        pytest.raises(ConfigError, match="allow_pipe=True"),
        ShardWriter(f"pipe:touch {marker}-%d") as shards,
    ):
        shards.write({"__key__": "a", "txt": "x"})
    assert list(tmp_path.iterdir()) == []


def test_a_pipe_command_that_fails_fails_the_close(tmp_path: Path) -> None:
    sink = TarWriter(f"pipe:cat > {tmp_path}/a.tar; exit 3", allow_pipe=True)
    sink.write({"__key__": "a", "txt": "x"})
    with pytest.raises(cloudshards.CloudShardsError, match="exited with status 3"):
        sink.close()


def test_a_discarded_shard_never_reaches_the_end_of_its_command(tmp_path: Path) -> None:
    """An exception inside ``with`` discards the shard: the command (an upload, say) is
    killed before its input ends, children included, so it never completes a partial shard."""
    done = tmp_path / "uploaded"
    command = f"pipe:cat > {tmp_path}/a.tar && touch {done}"

    def write_then_fail() -> None:
        with TarWriter(command, allow_pipe=True) as sink:
            sink.write({"__key__": "a", "txt": "x" * 100_000})
            raise KeyError("the sample source failed")

    with pytest.raises(KeyError):
        write_then_fail()
    assert not done.exists()
