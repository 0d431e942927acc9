"""Read chosen frames of an encoded video, with torchcodec or PyAV, decoding only what they need.

Both readers number frames in presentation order, as torchcodec's exact mode does, and give
the same frames, resized or not (tested): both convert to RGB, then resize with FFmpeg's
bilinear scaler. A reader checks its budget before it decodes anything.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from cloudshards.errors import DecodeError
from cloudshards.imagedecode import import_optional
from cloudshards.mediabackend import Backend, opening_error
from cloudshards.wholemedia import reformat

if TYPE_CHECKING:
    import torch

__all__ = ["VideoMeta", "VideoReader", "open_video"]

Size = tuple[int, int]


@dataclass(frozen=True)
class VideoMeta:
    """A video stream's facts, from its packets (no frame decoded).

    Attributes:
        width: Frame width in pixels.
        height: Frame height in pixels.
        fps: Average frames per second.
        begin: Presentation time of the first frame (seconds).
        end: When the last frame stops showing (seconds).
        num_frames: Frames in the stream.
    """

    width: int
    height: int
    fps: float
    begin: float
    end: float
    num_frames: int

    @property
    def duration(self) -> float:
        """``end - begin`` in seconds."""
        return self.end - self.begin


class VideoReader(Protocol):
    """One open video: its facts and the frames at given indices or times."""

    meta: VideoMeta

    def index_at(self, seconds: Sequence[float]) -> list[int]:
        """The index of the frame showing at each time (the last one that began by then)."""

    def decode_cost(self, first: int, last: int) -> int:
        """How many frames decoding ``first``..``last`` takes (from the key frame before)."""

    def frames(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 frames ``[T, 3, H, W]`` (RGB, resized if asked) and their times (seconds)."""


def open_video(
    data: bytes, backend: Backend, size: Size | None, threads: int, max_frames: int
) -> VideoReader:
    """Open ``data`` with ``backend``; ``size`` is the ``(height, width)`` frames come out at;
    decoding more than ``max_frames`` frames for one call is a :class:`DecodeError`."""
    if backend == "torchcodec":
        return _TorchcodecVideo(data, size, threads)
    return _AvVideo(data, size, threads, max_frames)


class _TorchcodecVideo:
    def __init__(self, data: bytes, size: Size | None, threads: int) -> None:
        decoders = import_optional("torchcodec.decoders", "decoding video with torchcodec")
        transforms = None
        if size is not None:
            transforms = [import_optional("torchcodec.transforms", "resizing").Resize(size)]
        try:
            self._decoder = decoders.VideoDecoder(
                data,
                seek_mode="exact",
                dimension_order="NCHW",
                num_ffmpeg_threads=threads,
                transforms=transforms,
            )
        except (RuntimeError, ValueError) as exc:
            raise opening_error(exc, "video") from exc
        m = self._decoder.metadata
        self.meta = VideoMeta(
            width=int(m.width),
            height=int(m.height),
            fps=float(m.average_fps or 0.0),
            begin=float(m.begin_stream_seconds or 0.0),
            end=float(m.end_stream_seconds or 0.0),
            num_frames=int(m.num_frames or 0),
        )
        # A private helper of torchcodec's; without it, assume the worst (a key frame at 0).
        keys = getattr(self._decoder, "_get_key_frame_indices", None)
        self._keys = sorted(int(i) for i in keys()) if keys is not None else [0]

    def index_at(self, seconds: Sequence[float]) -> list[int]:
        # torchcodec resolves times itself (frames(seconds=...)); this estimate is for budgets.
        rate = self.meta.fps or 1.0
        last = max(self.meta.num_frames - 1, 0)
        return [min(max(int((t - self.meta.begin) * rate), 0), last) for t in seconds]

    def decode_cost(self, first: int, last: int) -> int:
        return last - _key_before(self._keys, first) + 1

    def frames(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._decoder.get_frames_at(list(indices))
        return batch.data, batch.pts_seconds

    def frames_played_at(self, seconds: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """The frames showing at ``seconds`` (torchcodec maps times to frames itself)."""
        batch = self._decoder.get_frames_played_at(list(seconds))
        return batch.data, batch.pts_seconds


def _key_before(keys: Sequence[int], index: int) -> int:
    position = bisect.bisect_right(keys, index) - 1
    return keys[position] if position >= 0 else 0


class _AvVideo:
    def __init__(self, data: bytes, size: Size | None, threads: int, max_frames: int) -> None:
        av = import_optional("av", "decoding video")
        self._data, self._size, self._threads = data, size, threads
        self._max_frames = max_frames
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise DecodeError("no video stream")
            stream = container.streams.video[0]
            base, context = stream.time_base, stream.codec_context
            # Packets an edit list discards (a cut made without re-encoding) show no frame:
            # they are not numbered, as torchcodec does not number them.
            packets = [
                (p.pts if p.pts is not None else p.dts, p.duration or 0, p.is_keyframe)
                for p in container.demux(stream)
                if p.size and (p.pts is not None or p.dts is not None) and not p.is_discard
            ]
            rate = stream.average_rate
            width, height = int(context.width), int(context.height)
        packets.sort()
        self._pts = [pts for pts, _, _ in packets]
        self._base = base
        self._keys = [i for i, (_, _, key) in enumerate(packets) if key] or [0]
        unit = float(base)  # once: Fraction arithmetic per packet costs more than the scan
        times = [pts * unit for pts in self._pts]
        self._times = times
        end = max(((pts + d) * unit for pts, d, _ in packets), default=0.0)
        begin = times[0] if times else 0.0
        fps = float(rate) if rate else (len(times) / (end - begin) if end > begin else 0.0)
        self.meta = VideoMeta(width, height, fps, begin, end, len(times))

    def index_at(self, seconds: Sequence[float]) -> list[int]:
        return [max(bisect.bisect_right(self._times, t + 1e-9) - 1, 0) for t in seconds]

    def decode_cost(self, first: int, last: int) -> int:
        return last - _key_before(self._keys, first) + 1

    def frames(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        wanted = {self._pts[i] for i in indices}
        first, last = min(wanted), max(wanted)
        got = self._decode(self._pts[_key_before(self._keys, min(indices))], first, last, wanted)
        if first not in got:  # the seek landed past the key frame: decode from the start
            got = self._decode(None, first, last, wanted)
        missing = wanted - got.keys()
        if missing:
            raise DecodeError(f"{len(missing)} of the clip's frames did not decode")
        frames = torch.stack([got[self._pts[i]] for i in indices])
        stamps = [float(self._pts[i] * self._base) for i in indices]
        times = torch.tensor(stamps, dtype=torch.float64)
        return frames, times

    def _decode(
        self, seek: int | None, first: int, last: int, wanted: set[int]
    ) -> dict[int, torch.Tensor]:
        import torch

        av = import_optional("av", "decoding video")
        got: dict[int, torch.Tensor] = {}
        decoded = 0
        with av.open(io.BytesIO(self._data)) as container:
            stream = container.streams.video[0]
            stream.codec_context.thread_count = self._threads
            if seek is not None:
                container.seek(seek, stream=stream, backward=True, any_frame=False)
            for frame in container.decode(stream):
                decoded += 1
                if decoded > self._max_frames:
                    raise DecodeError(
                        f"the clip needs more than max_frames={self._max_frames:,} frames "
                        "decoded (VideoClip(max_frames=...) raises it)"
                    )
                if (frame.width, frame.height) != (self.meta.width, self.meta.height):
                    # The header's size is what the pixel and memory budgets were checked on.
                    raise DecodeError(
                        f"the frame size changes mid-video ({self.meta.width}x"
                        f"{self.meta.height} to {frame.width}x{frame.height})"
                    )
                pts = frame.pts
                if pts is None or pts < first:
                    continue
                if pts in wanted:
                    rgb = reformat(frame, format="rgb24")
                    if self._size is not None:  # as torchcodec's Resize: RGB first, then scale
                        height, width = self._size
                        rgb = reformat(rgb, width=width, height=height, interpolation="BILINEAR")
                    array: np.ndarray[Any, Any] = rgb.to_ndarray()
                    got[pts] = torch.from_numpy(array).permute(2, 0, 1)
                if pts >= last:
                    break
        return got
