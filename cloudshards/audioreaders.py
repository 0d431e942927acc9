"""Read a window of an encoded audio track, with torchcodec or PyAV, decoding only that window.

Both resample with FFmpeg's libswresample, so they agree sample for sample on PCM and FLAC and
within a small tolerance on lossy formats, whose decoders and encoder delays differ slightly
(mp3's first 25 ms of padding: torchcodec's stream begins after it, PyAV's at 0).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cloudshards import inflate
from cloudshards.errors import DecodeError
from cloudshards.imagedecode import import_optional
from cloudshards.mediabackend import Backend, opening_error

if TYPE_CHECKING:
    import torch

__all__ = ["AudioMeta", "AudioWindow", "read_window"]


@dataclass(frozen=True)
class AudioMeta:
    """An audio stream's facts from its header: rate, channels, begin and duration (seconds;
    0.0 when the header does not say)."""

    sample_rate: int
    channels: int
    begin: float
    duration: float


@dataclass(frozen=True)
class AudioWindow:
    """A decoded window: float32 ``[channels, samples]`` in [-1, 1], its rate and start time."""

    waveform: torch.Tensor
    sample_rate: int
    start: float
    meta: AudioMeta


#: Chooses the window's start (seconds) from the stream's facts.
Placement = Callable[[AudioMeta], float]


def read_window(
    data: bytes,
    backend: Backend,
    *,
    seconds: float,
    sample_rate: int | None,
    mono: bool,
    place: Placement,
    max_bytes: int,
) -> AudioWindow:
    """Decode ``seconds`` of the first audio stream from the start ``place`` picks.

    The waveform always has ``round(seconds * rate)`` samples: zeros pad a short track.

    Raises:
        DecodeError: No audio stream, or the window would take more than ``max_bytes``.
    """
    read = _torchcodec_window if backend == "torchcodec" else _av_window
    return read(data, seconds, sample_rate, mono, place, max_bytes)


def _fit(waveform: torch.Tensor, count: int) -> torch.Tensor:
    import torch

    if waveform.shape[1] >= count:
        return waveform[:, :count].contiguous()
    pad = torch.zeros((waveform.shape[0], count - waveform.shape[1]), dtype=torch.float32)
    return torch.cat([waveform.to(torch.float32), pad], dim=1)


def _checked(count: int, channels: int, max_bytes: int) -> int:
    """``count``, unless a float32 window of that many samples is over the decode limit."""
    if count * channels * 4 > max_bytes:
        what = f"an audio window of {count:,} samples x {channels} channels"
        raise inflate.too_big(what, count * channels * 4, max_bytes)
    return count


def _torchcodec_window(
    data: bytes,
    seconds: float,
    sample_rate: int | None,
    mono: bool,
    place: Placement,
    max_bytes: int,
) -> AudioWindow:
    decoders = import_optional("torchcodec.decoders", "decoding audio with torchcodec")
    try:
        decoder = decoders.AudioDecoder(
            data, sample_rate=sample_rate, num_channels=1 if mono else None
        )
    except (RuntimeError, ValueError) as exc:
        raise opening_error(exc, "audio") from exc
    m = decoder.metadata
    meta = AudioMeta(
        int(m.sample_rate),
        int(m.num_channels),
        float(m.begin_stream_seconds_from_header or 0.0),
        float(m.duration_seconds_from_header or 0.0),
    )
    rate = sample_rate or meta.sample_rate
    count = _checked(round(seconds * rate), 1 if mono else meta.channels, max_bytes)
    start = place(meta)
    samples = decoder.get_samples_played_in_range(start, start + seconds)
    return AudioWindow(_fit(samples.data, count), rate, start, meta)


def _av_window(
    data: bytes,
    seconds: float,
    sample_rate: int | None,
    mono: bool,
    place: Placement,
    max_bytes: int,
) -> AudioWindow:
    import torch

    av = import_optional("av", "decoding audio")
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.audio:
            raise DecodeError("no audio stream")
        stream = container.streams.audio[0]
        base = stream.time_base
        if stream.duration:
            duration = float(stream.duration * base)
        else:
            duration = container.duration / 1e6 if container.duration else 0.0
        begin = float(stream.start_time * base) if stream.start_time else 0.0
        meta = AudioMeta(int(stream.rate), len(stream.layout.channels), begin, duration)
        rate = sample_rate or meta.sample_rate
        channels = 1 if mono else meta.channels
        count = _checked(round(seconds * rate), channels, max_bytes)
        start = place(meta)
        if start > begin:
            container.seek(int(start / base), stream=stream, backward=True, any_frame=False)
        resampler = av.AudioResampler(
            format="fltp", layout="mono" if mono else stream.layout.name, rate=rate
        )
        # Samples before the window (the seek lands on a packet at or before it) are dropped
        # as they arrive, and no more than the window is kept: memory is the window's.
        chunks: list[np.ndarray[Any, Any]] = []
        skip: int | None = None  # samples still to drop, once the first frame's time is known
        have = passed = 0
        for frame in itertools.chain(container.decode(stream), [None]):
            if frame is not None and skip is None:
                first = float(frame.time) if frame.time is not None else start
                skip = max(round((start - first) * rate), 0)
            for out in resampler.resample(frame):
                chunk = out.to_ndarray()
                if skip:
                    dropped = min(skip, chunk.shape[1])
                    chunk, skip = chunk[:, dropped:], skip - dropped
                    passed += dropped
                    if passed * channels * 4 > max_bytes:  # decoding a long way to the window
                        raise DecodeError(
                            f"reaching the window at {start:.2f} s decodes more than the "
                            f"decode limit of {max_bytes:,} bytes before it"
                        )
                if chunk.shape[1]:
                    chunks.append(chunk[:, : count - have])
                    have += chunks[-1].shape[1]
            if have >= count:
                break
    joined = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), np.float32)
    return AudioWindow(_fit(torch.from_numpy(joined), count), rate, start, meta)
