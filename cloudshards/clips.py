"""Clip decoders: a few frames of a video, a window of audio, decoding only what they need.

:class:`VideoClip` and :class:`AudioClip` are handlers (``(".mp4", data) -> clip``) for a
:class:`~cloudshards.decoders.Decoder`, and what ``.decode(video=..., audio=...)`` adds. Where a
clip starts is drawn from a seed made of (the pipeline's seed, the epoch, the sample's URL and
key, the field): the same clips come back when an epoch is resumed, on the same world or
another, and another epoch draws other clips. Rank and worker are left out on purpose, so a
sample's clip does not depend on who reads it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Iterable, Mapping
from contextvars import ContextVar
from typing import Any, Literal

from cloudshards import inflate
from cloudshards.dist import derive_seed
from cloudshards.errors import ConfigError, DecodeError
from cloudshards.imagedecode import AUDIO_EXTENSIONS, DEFAULT_MAX_VIDEO_PIXELS, VIDEO_EXTENSIONS
from cloudshards.mediabackend import BACKENDS, media_backend
from cloudshards.seeding import default_seed
from cloudshards.stages.base import current_context

__all__ = [
    "DEFAULT_MAX_FRAMES",
    "DEFAULT_MAX_PIXELS",
    "AudioClip",
    "VideoClip",
    "current_sample",
]

#: Most frames one clip may decode (counting from the key frame before it): 10 minutes at 30 fps.
DEFAULT_MAX_FRAMES = 18_000
#: Most pixels a video frame may have: 8K UHD (7680 x 4320).
DEFAULT_MAX_PIXELS = DEFAULT_MAX_VIDEO_PIXELS

Start = Literal["random", "center", "first"]
_STARTS = ("random", "center", "first")

#: The sample a :class:`~cloudshards.decoders.Decoder` is decoding (set once per sample; its
#: ``__url__`` and ``__key__`` are read only when a clip is drawn).
current_sample: ContextVar[Mapping[str, Any] | None] = ContextVar(
    "cloudshards_current_sample", default=None
)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class _ClipHandler:
    """What video and audio clips share: extensions, start, seed and backend."""

    def __init__(
        self,
        extensions: str | Iterable[str],
        start: str,
        seed: int | None,
        backend: str | None,
    ) -> None:
        words = extensions.split() if isinstance(extensions, str) else list(extensions)
        self.extensions: Collection[str] = frozenset(word.lower() for word in words)
        if start not in _STARTS:
            raise ConfigError(f"start={start!r} is not one of {', '.join(_STARTS)}")
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
        self.start, self.seed, self.backend = start, seed, backend

    def handles(self, key: str) -> bool:
        """Whether ``key`` (``".mp4"``, ``".clip.webm"``) ends with one of the extensions."""
        return key.rpartition(".")[2].lower() in self.extensions

    def position(self, key: str, data: bytes) -> float:
        """Where in [0, 1) of the room left this sample's clip starts: 0 first, 0.5 centred,
        else a draw seeded by (seed, epoch, sample, field)."""
        if self.start != "random":
            return 0.0 if self.start == "first" else 0.5
        context = current_context()
        base = self.seed
        if base is None:
            base = context.seed if context is not None else default_seed()
        epoch = context.epoch if context is not None else 0
        sample = current_sample.get()
        if sample is None:  # called outside a Decoder: the content names the sample
            ident: object = hashlib.blake2b(data, digest_size=16).hexdigest()
        else:
            url, name = sample.get("__url__"), sample.get("__key__")
            url = url if isinstance(url, str) else ""
            # The shard's file name, not its whole URL: a copy of the dataset elsewhere (local,
            # another bucket, signed URLs) draws the same clips.
            ident = (url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1], _text(name))
        return random.Random(derive_seed(base, epoch, ident, key, "clip")).random()


class VideoClip(_ClipHandler):
    """Decode ``num_frames`` frames of a video field, seeking to the key frame before them.

    Frames are taken every ``stride`` frames, or at ``fps`` frames per second of the video's
    time (variable frame rates follow the timestamps); a video too short repeats its last frame.
    A field with more than ``max_pixels`` pixels per frame, a clip needing more than
    ``max_frames`` frames decoded, or frames over the decode limit (:class:`Decoder`'s
    ``max_bytes``) are a :class:`~cloudshards.errors.DecodeError` before anything is decoded.

    Args:
        num_frames: Frames in the clip.
        stride: Frames between two clip frames (ignored when ``fps`` is given).
        fps: Sample the clip at this rate in seconds of video instead of by stride.
        start: ``"random"`` (seeded, see the module), ``"center"`` or ``"first"``.
        size: ``(height, width)`` to resize every frame to while decoding.
        layout: ``"TCHW"`` (torchcodec's) or ``"THWC"`` (torchvision's ``read_video``).
        seed: Seed for the start; default the pipeline's.
        backend: ``"torchcodec"``, ``"pyav"`` or ``"auto"`` (default; also
            ``CLOUDSHARDS_MEDIA_BACKEND``).
        extensions: Field extensions to decode (default webdataset's video extensions).
        threads: FFmpeg decoding threads per video.
        max_frames: See above; default :data:`DEFAULT_MAX_FRAMES`.
        max_pixels: See above; default :data:`DEFAULT_MAX_PIXELS`.

    Returns (per field): a dict with ``frames`` (uint8 tensor), ``timestamps`` (float64 seconds),
    and the video's ``fps``, ``duration`` (seconds), ``height``, ``width`` and ``num_frames``.
    """

    def __init__(
        self,
        num_frames: int = 16,
        *,
        stride: int = 1,
        fps: float | None = None,
        start: Start = "random",
        size: tuple[int, int] | None = None,
        layout: Literal["TCHW", "THWC"] = "TCHW",
        seed: int | None = None,
        backend: str | None = None,
        extensions: str | Iterable[str] = VIDEO_EXTENSIONS,
        threads: int = 1,
        max_frames: int = DEFAULT_MAX_FRAMES,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        super().__init__(extensions, start, seed, backend)
        if num_frames < 1 or stride < 1 or threads < 1 or max_frames < 1 or max_pixels < 1:
            raise ConfigError("num_frames, stride, threads, max_frames, max_pixels must be >= 1")
        if fps is not None and not fps > 0:
            raise ConfigError(f"fps must be positive, got {fps}")
        if size is not None and (len(size) != 2 or min(size) < 1):
            raise ConfigError(f"size must be (height, width), got {size!r}")
        if layout not in ("TCHW", "THWC"):
            raise ConfigError(f"layout must be 'TCHW' or 'THWC', got {layout!r}")
        self.num_frames, self.stride, self.fps = num_frames, stride, fps
        self.size = None if size is None else (int(size[0]), int(size[1]))
        self.layout, self.threads = layout, threads
        self.max_frames, self.max_pixels = max_frames, max_pixels

    def __call__(self, key: str, data: bytes) -> dict[str, Any] | None:
        """Decode the clip of field ``key`` (with its leading dot), or None for other fields."""
        if not self.handles(key):
            return None
        from cloudshards.videoreaders import open_video

        backend = media_backend(self.backend)
        reader = open_video(data, backend, self.size, self.threads, self.max_frames)
        meta = reader.meta
        if meta.num_frames < 1:
            raise DecodeError("the video has no frames")
        if meta.width * meta.height > self.max_pixels:
            raise DecodeError(
                f"frames of {meta.width}x{meta.height} pixels are over max_pixels="
                f"{self.max_pixels:,} (VideoClip(max_pixels=...) raises it)"
            )
        height, width = self.size or (meta.height, meta.width)
        limit = inflate.decode_limit()
        if self.num_frames * 3 * height * width > limit:
            raise inflate.too_big(f"a clip of {self.num_frames} frames", None, limit)
        where = self.position(key, data)
        times: list[float] | None = None
        if self.fps is None:
            span = (self.num_frames - 1) * self.stride + 1
            first = int(where * (max(meta.num_frames - span, 0) + 1))
            last_index = meta.num_frames - 1
            indices = [min(first + i * self.stride, last_index) for i in range(self.num_frames)]
        else:
            room = max(meta.duration - self.num_frames / self.fps, 0.0)
            t0 = meta.begin + where * room
            latest = meta.begin + max(meta.duration - 1e-6, 0.0)
            times = [min(t0 + i / self.fps, latest) for i in range(self.num_frames)]
            indices = reader.index_at(times)
        cost = reader.decode_cost(min(indices), max(indices))
        if cost > self.max_frames:
            raise DecodeError(
                f"the clip needs {cost:,} frames decoded, over max_frames={self.max_frames:,} "
                "(VideoClip(max_frames=...) raises it)"
            )
        played_at = getattr(reader, "frames_played_at", None)
        if times is not None and played_at is not None:
            frames, stamps = played_at(times)
        else:
            frames, stamps = reader.frames(indices)
        if self.layout == "THWC":
            frames = frames.permute(0, 2, 3, 1).contiguous()
        return {
            "frames": frames,
            "timestamps": stamps,
            "fps": meta.fps,
            "duration": meta.duration,
            "height": meta.height,
            "width": meta.width,
            "num_frames": meta.num_frames,
        }

    def __repr__(self) -> str:
        how = f"fps={self.fps}" if self.fps is not None else f"stride={self.stride}"
        return f"VideoClip({self.num_frames}, {how}, start={self.start!r}, size={self.size})"


class AudioClip(_ClipHandler):
    """Decode a window of ``seconds`` from an audio field, seeking to it first.

    The waveform is float32 ``[channels, round(seconds * sample_rate)]`` in [-1, 1], zero-padded
    past the end of a short track, and at most the decode limit in bytes.

    Args:
        seconds: Length of the window.
        sample_rate: Resample to this rate (default: the file's).
        mono: Mix the channels down to one.
        start: ``"random"`` (seeded, see the module), ``"center"`` or ``"first"``.
        seed: Seed for the start; default the pipeline's.
        backend: ``"torchcodec"``, ``"pyav"`` or ``"auto"`` (as :class:`VideoClip`).
        extensions: Field extensions to decode (default webdataset's audio ones; add ``"mp4"``
            to take the sound of videos).

    Returns (per field): a dict with ``waveform``, ``sample_rate``, ``start`` (seconds) and the
    track's ``duration`` (seconds, 0.0 when its header does not say) and ``channels``.
    """

    def __init__(
        self,
        seconds: float = 1.0,
        *,
        sample_rate: int | None = None,
        mono: bool = False,
        start: Start = "random",
        seed: int | None = None,
        backend: str | None = None,
        extensions: str | Iterable[str] = AUDIO_EXTENSIONS,
    ) -> None:
        super().__init__(extensions, start, seed, backend)
        if not seconds > 0:
            raise ConfigError(f"seconds must be positive, got {seconds}")
        if sample_rate is not None and sample_rate < 1:
            raise ConfigError(f"sample_rate must be positive, got {sample_rate}")
        self.seconds, self.sample_rate, self.mono = float(seconds), sample_rate, mono

    def __call__(self, key: str, data: bytes) -> dict[str, Any] | None:
        """Decode the window of field ``key`` (with its leading dot), or None for other fields."""
        if not self.handles(key):
            return None
        from cloudshards.audioreaders import AudioMeta, read_window

        where = self.position(key, data)

        def place(meta: AudioMeta) -> float:
            return meta.begin + where * max(meta.duration - self.seconds, 0.0)

        window = read_window(
            data,
            media_backend(self.backend),
            seconds=self.seconds,
            sample_rate=self.sample_rate,
            mono=self.mono,
            place=place,
            max_bytes=inflate.decode_limit(),
        )
        return {
            "waveform": window.waveform,
            "sample_rate": window.sample_rate,
            "start": window.start,
            "duration": window.meta.duration,
            "channels": window.meta.channels,
        }

    def __repr__(self) -> str:
        return f"AudioClip({self.seconds}, sample_rate={self.sample_rate}, mono={self.mono})"
