"""Whole videos and sounds as webdataset decodes them (``torch_video``, ``torch_audio``), for
code migrating from it; training code wants :mod:`cloudshards.clips`. Both are bounded by the
decode limit, checked as they decode.
"""

from __future__ import annotations

import io
import itertools
import wave
from typing import TYPE_CHECKING, Any

import numpy as np

from cloudshards import inflate
from cloudshards.errors import DecodeError
from cloudshards.imagedecode import (
    AUDIO_EXTENSIONS,
    DEFAULT_MAX_VIDEO_PIXELS,
    VIDEO_EXTENSIONS,
    import_optional,
)

if TYPE_CHECKING:
    import torch

__all__ = ["reformat", "torch_audio", "torch_video"]


def torch_video(key: str, data: bytes) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None:
    """Decode a video like ``torchvision.io.read_video(path, pts_unit="sec")``, with PyAV.

    Args:
        key: The field with a leading dot; handles mp4 ogv mjpeg avi mov h264 mpg webm wmv.
        data: The encoded video.

    Returns:
        ``(video, audio, info)``: uint8 frames THWC (RGB), audio ``[channels, samples]`` in the
        stream's sample format, and ``{"video_fps": float, "audio_fps": int}`` for the streams
        present; None for other extensions.

    Raises:
        DecodeError: A frame has more than :data:`DEFAULT_MAX_VIDEO_PIXELS` pixels, or the
            frames and sound together are over the decode limit (:class:`Decoder`'s
            ``max_bytes``), checked frame by frame as they decode (clips,
            :class:`~cloudshards.clips.VideoClip`, decode far less).
        ImportError: PyAV is missing (``pip install "cloudshards[video]"``).
    """
    if key.rpartition(".")[2] not in VIDEO_EXTENSIONS:
        return None
    av = import_optional("av", "decoding video")
    import torch

    chunks: list[np.ndarray[Any, Any]] = []
    info: dict[str, Any] = {}
    budget = _Budget("the video's frames and sound")
    with av.open(io.BytesIO(data)) as container:
        streams = [*container.streams.video[:1], *container.streams.audio[:1]]
        video_streams = container.streams.video
        frames = _FrameStack(_frame_count(container, video_streams), budget)
        for stream in streams:
            if stream.type == "video" and stream.average_rate is not None:
                info["video_fps"] = float(stream.average_rate)
            elif stream.type == "audio":
                info["audio_fps"] = stream.rate
        # demux() without streams would demux every stream, so skip it when there are none.
        for packet in container.demux(*streams) if streams else ():
            for frame in packet.decode():
                if packet.stream.type == "video":
                    if frame.width * frame.height > DEFAULT_MAX_VIDEO_PIXELS:
                        raise DecodeError(
                            f"a frame of {frame.width}x{frame.height} pixels is over "
                            f"{DEFAULT_MAX_VIDEO_PIXELS:,} pixels"
                        )
                    frames.add(reformat(frame, format="rgb24").to_ndarray())
                else:
                    chunks.append(budget.take(_planar(frame)))
    stacked = frames.array()
    video = (
        torch.from_numpy(stacked)
        if stacked is not None
        else torch.empty((0, 1, 1, 3), dtype=torch.uint8)
    )
    audio = (
        torch.from_numpy(np.concatenate(chunks, axis=1))
        if chunks
        else torch.empty((1, 0), dtype=torch.float32)
    )
    return video, audio, info


def _frame_count(container: Any, streams: Any) -> int:
    """The video's frame count from its header, else estimated from its duration and rate
    (webm and mkv headers give no count); 0 when neither says."""
    if not streams:
        return 0
    stream = streams[0]
    if stream.frames:
        return int(stream.frames)
    seconds = float(stream.duration * stream.time_base) if stream.duration else 0.0
    seconds = seconds or (container.duration / 1e6 if container.duration else 0.0)
    rate = float(stream.average_rate) if stream.average_rate else 0.0
    return round(seconds * rate) + 1 if seconds and rate else 0


class _FrameStack:
    """Frames written straight into one array sized from the stream's frame count (grown if the
    header undercounts): a whole video costs about its own size at the peak, where a list of
    frames stacked at the end costs twice that (the allocator keeps the freed frames)."""

    def __init__(self, expected: int, budget: _Budget) -> None:
        self.expected, self.budget, self.count = max(expected, 1), budget, 0
        self.out: np.ndarray[Any, Any] | None = None

    def add(self, frame: np.ndarray[Any, Any]) -> None:
        self.budget.take(frame)
        if self.out is None:
            room = max(1, self.budget.limit // max(frame.nbytes, 1))
            self.out = np.empty((min(self.expected, room), *frame.shape), frame.dtype)
        elif frame.shape != self.out.shape[1:]:
            raise DecodeError(f"the frame size changes mid-video ({frame.shape[:2]})")
        if self.count == len(self.out):
            grown = np.empty((self.count + self.count // 2 + 1, *frame.shape), frame.dtype)
            grown[: self.count] = self.out
            self.out = grown
        self.out[self.count] = frame
        self.count += 1

    def array(self) -> np.ndarray[Any, Any] | None:
        return None if self.out is None else self.out[: self.count]


class _Budget:
    """Counts the bytes a field has decoded into so far against the decode limit."""

    def __init__(self, what: str) -> None:
        self.what, self.limit, self.used = what, inflate.decode_limit(), 0

    def take(self, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        self.used += array.nbytes
        if self.used > self.limit:
            raise inflate.too_big(self.what, None, self.limit)
        return array


_reformat_threads = [True]  # PyAV takes reformat(threads=...) (older releases do not)


def reformat(frame: Any, **kwargs: Any) -> Any:
    """``frame.reformat(**kwargs)`` with one swscale thread: PyAV's default (0) starts a pool
    of threads per conversion, which oversubscribes the cores of DataLoader workers and made
    whole-video decoding 2.6x slower on a loaded machine (``benchmarks/bench_video.py``)."""
    if _reformat_threads[0]:
        try:
            return frame.reformat(threads=1, **kwargs)
        except TypeError:
            _reformat_threads[0] = False
    return frame.reformat(**kwargs)


def _planar(frame: Any) -> np.ndarray[Any, Any]:
    array: np.ndarray[Any, Any] = frame.to_ndarray()
    if frame.format.is_planar:
        return array
    # Packed audio comes back as (1, samples * channels), interleaved.
    return array.reshape(-1, len(frame.layout.channels)).T


def torch_audio(key: str, data: bytes) -> tuple[torch.Tensor, int] | None:
    """Decode audio like ``torchaudio.load``: PCM WAV with the stdlib, other formats with PyAV.

    Args:
        key: The field with a leading dot; handles flac mp3 sox wav m4a ogg wma.
        data: The encoded audio.

    Returns:
        ``(waveform, sample_rate)`` with a float32 ``[channels, samples]`` waveform in [-1, 1],
        or None for other extensions.

    Raises:
        ImportError: The format needs PyAV and it is missing (``pip install "cloudshards[video]"``).
    """
    extension = key.rpartition(".")[2]
    if extension not in AUDIO_EXTENSIONS:
        return None
    import torch

    if extension == "wav":
        try:
            waveform, rate = _read_pcm_wav(data)
        except wave.Error as exc:
            if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
                raise  # corrupt data: a decode error, not a reason to ask for PyAV
            # The stdlib reads integer PCM only; float or extensible WAVs go through PyAV.
            waveform, rate = _read_av_audio(data, f"decoding this WAV ({exc})")
    else:
        waveform, rate = _read_av_audio(data, f"decoding .{extension} audio")
    return torch.from_numpy(waveform), rate


def _read_pcm_wav(data: bytes) -> tuple[np.ndarray[Any, np.dtype[np.float32]], int]:
    with wave.open(io.BytesIO(data), "rb") as reader:
        channels, width = reader.getnchannels(), reader.getsampwidth()
        # A WAV written to a pipe declares 0xFFFFFFFF bytes of data (its size was unknown):
        # count what the bytes hold, never more.
        count = min(reader.getnframes(), len(data) // (channels * width))
        limit = inflate.decode_limit()
        if count * channels * 4 > limit:
            raise inflate.too_big("the WAV's samples", count * channels * 4, limit)
        rate, raw = reader.getframerate(), reader.readframes(count)
        raw = raw[: len(raw) // (channels * width) * (channels * width)]
    samples: np.ndarray[Any, Any]
    if width == 1:  # 8-bit WAV is unsigned, centred on 128
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif width == 3:
        # Put each 24-bit sample in the top of an int32, then shift back to sign-extend it.
        padded = np.zeros((len(raw) // 3, 4), np.uint8)
        padded[:, 1:] = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        samples = (padded.view("<i4").ravel() >> 8).astype(np.float32) / np.float32(1 << 23)
    elif width in (2, 4):
        ints = np.frombuffer(raw, f"<i{width}")
        samples = ints.astype(np.float32) / np.float32(1 << (8 * width - 1))
    else:
        raise wave.Error(f"unsupported sample width {width}")
    return np.ascontiguousarray(samples.reshape(-1, channels).T), rate


def _read_av_audio(data: bytes, what: str) -> tuple[np.ndarray[Any, np.dtype[np.float32]], int]:
    av = import_optional("av", what)
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.audio:
            raise ValueError("no audio stream found")
        stream = container.streams.audio[0]
        # Float planar at the stream's own layout and rate: torchaudio's normalised output.
        resampler = av.AudioResampler(format="fltp")
        budget = _Budget("the audio's samples")
        chunks = [
            budget.take(out.to_ndarray())
            for frame in itertools.chain(container.decode(stream), [None])
            for out in resampler.resample(frame)
        ]
        rate = int(stream.rate)
        channels = len(stream.layout.channels)
    if not chunks:
        return np.zeros((channels, 0), np.float32), rate
    return np.concatenate(chunks, axis=1), rate
