"""Clip decoding: the frames and sound windows users train on, from both decoders, within budget.

Every test video's frame shows its number in binary (tests/media.py), so a decoded frame says
which frame it is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from media import (
    VIDEO_FORMATS,
    encode_audio,
    encode_video,
    frame_number,
    gapped_sound,
    resolution_change,
    tone,
)

import cloudshards as wds
from cloudshards import mediabackend
from cloudshards.clips import AudioClip, VideoClip
from cloudshards.decoders import Decoder
from cloudshards.errors import ConfigError, DecodeError

BACKENDS = ["pyav", "torchcodec"]


def frame_numbers(frames: torch.Tensor) -> list[int]:
    """Which frame each decoded ``[T, 3, H, W]`` frame is."""
    return [frame_number(frame) for frame in frames]


def clip(handler: Any, field: str, data: bytes, key: str = "k", url: str = "u") -> Any:
    """Decode ``data`` as the field ``field`` (``"mp4"``) of a sample, as a pipeline does."""
    return Decoder([handler])({"__key__": key, "__url__": url, field: data})[field]


def test_torchcodec_loads_in_the_test_environment() -> None:
    # The project installs torchcodec 0.13 and Debian's FFmpeg for its tests: both decoders
    # below are really exercised, none falls back silently.
    assert mediabackend.torchcodec_error() is None
    assert mediabackend.media_backend() == "torchcodec"


def test_the_backend_can_be_forced_and_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(mediabackend, "_logged", set())
    monkeypatch.setenv("CLOUDSHARDS_MEDIA_BACKEND", "pyav")
    with caplog.at_level(logging.INFO, logger="cloudshards.decoders"):
        assert mediabackend.media_backend() == "pyav"
        assert mediabackend.media_backend() == "pyav"
    assert [r.getMessage() for r in caplog.records] == ["video and audio clips decode with pyav"]
    monkeypatch.setenv("CLOUDSHARDS_MEDIA_BACKEND", "ffmpeg")
    with pytest.raises(ConfigError, match="ffmpeg"):
        mediabackend.media_backend()


@pytest.mark.parametrize(("codec", "container"), VIDEO_FORMATS)
@pytest.mark.parametrize("vfr", [False, True])
def test_both_decoders_give_the_same_clip_of_the_right_frames(
    codec: str, container: str, vfr: bool
) -> None:
    data = encode_video(codec, container, frames=40, vfr=vfr)
    clips = [clip(VideoClip(6, stride=3, backend=b), container, data) for b in BACKENDS]
    first = frame_numbers(clips[0]["frames"])[0]
    for got in clips:
        assert got["frames"].shape == (6, 3, 48, 64)
        assert got["frames"].dtype == torch.uint8
        assert frame_numbers(got["frames"]) == [first + 3 * i for i in range(6)]
        assert got["num_frames"] == 40
        assert (got["height"], got["width"]) == (48, 64)
        assert torch.all(got["timestamps"][1:] > got["timestamps"][:-1])
    assert torch.equal(clips[0]["frames"], clips[1]["frames"])
    assert torch.equal(clips[0]["timestamps"], clips[1]["timestamps"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fps_sampling_follows_timestamps(backend: str) -> None:
    steady = encode_video(frames=48, fps=24)
    got = clip(VideoClip(4, fps=8, start="first", backend=backend), "mp4", steady)
    assert frame_numbers(got["frames"]) == [0, 3, 6, 9]
    assert got["fps"] == 24.0
    # Variable frame rate: frames last 20 and 40 ms in turn (they start at 0, 20, 60, 80, 120,
    # 140, 180, 200, 240, 260, 300 ms), so at 0, 0.1, 0.2, 0.3 s frames 0, 3, 7 and 10 show.
    varying = encode_video("libvpx-vp9", "webm", frames=30, vfr=True)
    got = clip(VideoClip(4, fps=10, start="first", backend=backend), "webm", varying)
    assert frame_numbers(got["frames"]) == [0, 3, 7, 10]
    assert got["timestamps"].tolist() == pytest.approx([0.0, 0.08, 0.2, 0.3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_placement_and_short_videos(backend: str) -> None:
    data = encode_video(frames=30)
    center = clip(VideoClip(10, start="center", backend=backend), "mp4", data)
    assert frame_numbers(center["frames"]) == list(range(10, 20))
    short = clip(VideoClip(8, stride=2, start="first", backend=backend), "mp4", data[:])
    assert frame_numbers(short["frames"]) == [0, 2, 4, 6, 8, 10, 12, 14]
    tiny = encode_video(frames=3)
    repeated = clip(VideoClip(5, backend=backend), "mp4", tiny)
    assert frame_numbers(repeated["frames"]) == [0, 1, 2, 2, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_resize_and_layout(backend: str) -> None:
    data = encode_video("libx264", "mp4", frames=20, size=(64, 96))
    small = clip(VideoClip(4, size=(32, 48), layout="THWC", backend=backend), "mp4", data)
    assert small["frames"].shape == (4, 32, 48, 3)
    assert (small["height"], small["width"]) == (64, 96)  # the video's own size
    full = clip(VideoClip(4, backend=backend), "mp4", data)["frames"].float()
    # Bilinear and antialiased: close to torch's filter, not the nearest pixels.
    expected = torch.nn.functional.interpolate(full, (32, 48), mode="bilinear", antialias=True)
    assert (small["frames"].permute(0, 3, 1, 2).float() - expected).abs().mean() < 1


def test_resized_frames_are_equal_across_decoders() -> None:
    data = encode_video("libx264", "mp4", frames=20, size=(64, 96))
    a, b = (clip(VideoClip(4, size=(30, 40), backend=x), "mp4", data) for x in BACKENDS)
    assert torch.equal(a["frames"], b["frames"])


def test_random_starts_are_seeded_by_sample_and_epoch_not_by_reader() -> None:
    data = encode_video(frames=200, gop=24)
    handler = VideoClip(4)

    def first(key: str) -> int:
        return frame_numbers(clip(handler, "mp4", data, key=key)["frames"])[0]

    starts = {key: first(key) for key in "abcdef"}
    assert len(set(starts.values())) > 1  # keys draw different clips
    assert {key: first(key) for key in "abcdef"} == starts
    # Another backend draws the same starts.
    other = VideoClip(4, backend="pyav")
    assert frame_numbers(clip(other, "mp4", data, key="c")["frames"])[0] == starts["c"]
    # The same shard elsewhere (another store, a signed URL) draws the same clip.
    moved = clip(handler, "mp4", data, key="a", url="https://h/data/u?X-Amz-Signature=1")
    assert frame_numbers(moved["frames"])[0] == starts["a"]


def write_video_shards(tmp_path: Path, shards: int = 2, per_shard: int = 4) -> str:
    for shard in range(shards):
        with wds.TarWriter(str(tmp_path / f"v-{shard}.tar")) as sink:
            for index in range(per_shard):
                frames = 60 + 20 * index
                data = encode_video(frames=frames, gop=10)
                sink.write({"__key__": f"s{shard}-{index}", "mp4": data, "cls": index})
    return str(tmp_path / f"v-{{0..{shards - 1}}}.tar")


def epoch_clips(urls: str, epoch: int, workers: int, backend: str = "auto") -> dict[str, list[int]]:
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, seed=5)
        .decode(video=VideoClip(4, stride=2, backend=backend))
        .to_tuple("__key__", "mp4")
    )
    dataset.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    return {key: frame_numbers(video["frames"]) for key, video in loader}


def test_clips_through_a_pipeline_with_workers_are_the_in_process_ones(tmp_path: Path) -> None:
    urls = write_video_shards(tmp_path)
    in_process = epoch_clips(urls, 0, workers=0)
    assert len(in_process) == 8
    assert epoch_clips(urls, 0, workers=2) == in_process
    assert epoch_clips(urls, 0, workers=2, backend="pyav") == in_process  # PyAV in the workers
    assert epoch_clips(urls, 1, workers=2) != in_process  # each epoch draws other clips


def test_decode_video_takes_its_arguments_as_a_dict(tmp_path: Path) -> None:
    urls = write_video_shards(tmp_path, shards=1, per_shard=1)
    dataset = wds.WebDataset(urls, shardshuffle=False).decode(video={"num_frames": 3})
    (sample,) = list(dataset)
    assert sample["mp4"]["frames"].shape == (3, 3, 48, 64)
    assert sample["cls"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_budgets_refuse_before_decoding(backend: str) -> None:
    data = encode_video("libx264", "mp4", frames=120, gop=120)  # one key frame
    with pytest.raises(DecodeError, match=r"'mp4'.*max_pixels=1,000.*shard u, member 'k.mp4'"):
        clip(VideoClip(4, max_pixels=1000, backend=backend), "mp4", data)
    with pytest.raises(DecodeError, match="over max_frames=50"):
        clip(VideoClip(4, start="center", max_frames=50, backend=backend), "mp4", data)
    bounded = Decoder([VideoClip(16, backend=backend)], max_bytes=16 * 3 * 48 * 64 - 1)
    with pytest.raises(DecodeError, match="decode limit"):
        bounded({"__key__": "k", "mp4": data})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_broken_videos_are_decode_errors_naming_the_field(backend: str, damage: str) -> None:
    data = encode_video(frames=30)
    broken = b"\x00\x01garbage" * 50 if damage == "garbage" else data[: len(data) // 3]
    with pytest.raises(DecodeError, match="'mp4'"):
        clip(VideoClip(4, start="center", backend=backend), "mp4", broken)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_field_without_the_stream_says_so(backend: str) -> None:
    sound_only = encode_audio("aac", "mp4", seconds=1.0, rate=48000)
    with pytest.raises(DecodeError, match=r"cannot decode field 'mp4': no video stream \("):
        clip(VideoClip(4, backend=backend), "mp4", sound_only)
    silent = encode_video(frames=10)
    with pytest.raises(DecodeError, match=r"cannot decode field 'mp4': no audio stream \("):
        clip(AudioClip(0.5, extensions="mp4", backend=backend), "mp4", silent)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resolution_change_past_the_header_is_refused(backend: str, tmp_path: Path) -> None:
    # The budgets were checked on the header's 64x48; the 160x160 frames must not come back.
    with pytest.raises(DecodeError, match=r"cannot decode field 'mkv': .*member 'k\.mkv'") as info:
        clip(
            VideoClip(8, start="center", backend=backend, extensions="mkv"),
            "mkv",
            resolution_change(tmp_path),
        )
    if backend == "pyav":
        assert "the frame size changes mid-video (64x48 to 160x160)" in str(info.value)


def test_a_window_far_past_where_decoding_starts_is_refused() -> None:
    # PyAV: reaching a window hours into a gapped track would decode (and hold) the gap.
    handler = AudioClip(1.0, start="center", backend="pyav", extensions="m4a")
    refused = r"reaching the window at .* before it \(member 'k\.m4a'\)"
    with pytest.raises(DecodeError, match=refused):
        Decoder([handler], max_bytes=4 << 20)({"__key__": "k", "m4a": gapped_sound()})


def test_whole_video_decoding_is_bounded_by_the_decode_limit() -> None:
    data = encode_video(frames=30)
    decoder = Decoder([wds.torch_video], max_bytes=10 * 48 * 64 * 3)
    with pytest.raises(DecodeError, match="decode limit"):
        decoder({"__key__": "k", "mp4": data})
    video, _, _ = Decoder([wds.torch_video])({"__key__": "k", "mp4": data})["mp4"]
    assert video.shape == (30, 48, 64, 3)


def test_clip_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="start"):
        VideoClip(4, start="middle")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="backend"):
        VideoClip(4, backend="opencv")
    with pytest.raises(ConfigError, match="num_frames"):
        VideoClip(0)
    with pytest.raises(ConfigError, match="size"):
        VideoClip(4, size=(0, 10))
    with pytest.raises(ConfigError, match="seconds"):
        AudioClip(0)
    assert clip(VideoClip(4), "jpg", b"x") == b"x"  # other fields pass through


AUDIO_FORMATS = [("pcm_s16le", "wav"), ("flac", "flac"), ("libmp3lame", "mp3")]


@pytest.mark.parametrize(("codec", "container"), AUDIO_FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_audio_windows_hold_the_sound_at_their_start(
    codec: str, container: str, backend: str
) -> None:
    data = encode_audio(codec, container, seconds=3.0, rate=16000)
    got = clip(AudioClip(0.5, start="first", backend=backend), container, data)
    assert got["waveform"].shape == (2, 8000)
    assert got["waveform"].dtype == torch.float32
    assert got["sample_rate"] == 16000
    assert got["channels"] == 2
    assert got["duration"] == pytest.approx(3.0, abs=0.1)  # mp3: the header's estimate
    if container != "mp3":  # lossless: the samples themselves
        begin = round(got["start"] * 16000)
        expected = tone(3.0, 16000, 2)[:, begin : begin + 8000]
        np.testing.assert_allclose(got["waveform"].numpy(), expected, atol=2e-4)
    else:  # lossy: the tone's energy
        assert float(got["waveform"][0, 2000:].abs().max()) == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize(("codec", "container"), AUDIO_FORMATS)
def test_both_decoders_give_the_same_window(codec: str, container: str) -> None:
    data = encode_audio(codec, container, seconds=3.0)
    for args in [{}, {"sample_rate": 16000, "mono": True}]:
        a, b = (clip(AudioClip(1.0, **args, backend=x), container, data) for x in BACKENDS)
        assert a["waveform"].shape == b["waveform"].shape
        if container == "mp3":
            # mp3's 25 ms of encoder delay: torchcodec's stream begins after it, PyAV's at 0,
            # so the drawn start differs by up to that much.
            assert a["start"] == pytest.approx(b["start"], abs=0.03)
            continue
        assert a["start"] == b["start"]
        tolerance = 0.0 if not args else 0.02  # resamplers differ in their last digits
        assert float((a["waveform"] - b["waveform"]).abs().max()) <= tolerance


@pytest.mark.parametrize("backend", BACKENDS)
def test_audio_resampled_mono_padded(backend: str) -> None:
    data = encode_audio(seconds=1.0, rate=44100)
    got = clip(AudioClip(2.0, sample_rate=8000, mono=True, backend=backend), "wav", data)
    assert got["waveform"].shape == (1, 16000)
    assert got["start"] == 0.0  # a short track starts at its beginning
    assert float(got["waveform"][0, 8100:].abs().max()) == 0.0  # zeros past the end
    assert float(got["waveform"][0, 1000:7000].abs().max()) > 0.3


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sound_of_a_video(backend: str) -> None:
    data = encode_video(frames=48, audio_seconds=2.0)
    handler = AudioClip(0.5, sample_rate=16000, extensions="mp4", backend=backend)
    got = clip(handler, "mp4", data)
    assert got["waveform"].shape == (2, 8000)
    rms = got["waveform"].pow(2).mean(dim=1).sqrt()  # sines of amplitude 0.5 and 0.3
    assert rms.tolist() == pytest.approx([0.5 / 2**0.5, 0.3 / 2**0.5], abs=0.02)
    frames = clip(VideoClip(4, backend=backend), "mp4", data)["frames"]
    assert frames.shape == (4, 3, 48, 64)


def test_audio_windows_are_bounded_by_the_decode_limit() -> None:
    data = encode_audio(seconds=1.0)
    decoder = Decoder([AudioClip(10.0)], max_bytes=1000)
    with pytest.raises(DecodeError, match="decode limit"):
        decoder({"__key__": "k", "wav": data})
    with pytest.raises(DecodeError, match="decode limit"):
        Decoder([wds.torch_audio], max_bytes=1000)({"__key__": "k", "wav": data})
