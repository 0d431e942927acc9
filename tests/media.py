"""Videos and sounds made with PyAV for the clip tests: every frame shows its number in binary."""

from __future__ import annotations

import fractions
import io
from typing import Any

import av
import numpy as np

#: (codec, container) pairs PyAV's own FFmpeg writes here.
VIDEO_FORMATS = [("mpeg4", "mp4"), ("libx264", "mp4"), ("libvpx-vp9", "webm")]


def frame_image(index: int, height: int, width: int) -> np.ndarray[Any, Any]:
    """Frame ``index``: its number's 8 bits as white or black 8x8 blocks along the top, over
    a colour that changes from frame to frame."""
    image = np.zeros((height, width, 3), np.uint8)
    image[..., 0] = (index * 8) % 256
    image[..., 2] = 255 - (index * 8) % 256
    image[8:, : width // 4, 1] = 200 if index % 2 else 40
    for bit in range(8):
        image[:8, bit * 8 : bit * 8 + 8] = 255 if index >> bit & 1 else 0
    return image


def frame_number(frame: Any) -> int:
    """The number :func:`frame_image` drew on a decoded ``[3, H, W]`` frame (full size)."""
    blocks = [float(frame[:, 2:6, bit * 8 + 2 : bit * 8 + 6].float().mean()) for bit in range(8)]
    return sum(1 << bit for bit, level in enumerate(blocks) if level > 128)


def encode_video(
    codec: str = "mpeg4",
    container: str = "mp4",
    *,
    frames: int = 48,
    size: tuple[int, int] = (48, 64),
    fps: int = 24,
    gop: int = 12,
    vfr: bool = False,
    audio_seconds: float = 0.0,
) -> bytes:
    """Encode ``frames`` frames of ``frame_image``; ``vfr`` alternates 20 and 40 ms frames;
    ``audio_seconds`` adds a 440 Hz stereo AAC (mp4) or Opus (webm) track."""
    height, width = size
    out = io.BytesIO()
    with av.open(out, "w", format=container) as writer:
        stream = writer.add_stream(codec, rate=fps, options={"g": str(gop)})
        stream.bit_rate, stream.codec_context.gop_size = 4_000_000, gop
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if vfr:
            stream.codec_context.time_base = fractions.Fraction(1, 1000)
        sound = None
        if audio_seconds:
            sound = writer.add_stream("aac" if container == "mp4" else "libopus", rate=48000)
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_image(index, height, width), format="rgb24")
            if vfr:
                frame.pts = sum(40 if k % 2 else 20 for k in range(index))
                frame.time_base = fractions.Fraction(1, 1000)
            for packet in stream.encode(frame):
                writer.mux(packet)
        for packet in stream.encode(None):
            writer.mux(packet)
        if sound is not None:
            _encode_tone(writer, sound, audio_seconds, 48000, 2)
    return out.getvalue()


def tone(seconds: float, rate: int, channels: int) -> np.ndarray[Any, Any]:
    """A 440 Hz sine on the first channel, 660 Hz on the second, float32 in [-0.5, 0.5]."""
    t = np.arange(round(seconds * rate)) / rate
    waves = [0.5 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]
    return np.stack(waves[:channels]).astype(np.float32)


def _encode_tone(writer: Any, stream: Any, seconds: float, rate: int, channels: int) -> None:
    samples = tone(seconds, rate, channels)
    step = stream.codec_context.frame_size or 1024
    layout = "stereo" if channels == 2 else "mono"
    for start in range(0, samples.shape[1], step):
        chunk = np.ascontiguousarray(samples[:, start : start + step])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate, frame.pts = rate, start
        for packet in stream.encode(frame):
            writer.mux(packet)
    for packet in stream.encode(None):
        writer.mux(packet)


def encode_audio(
    codec: str = "pcm_s16le",
    container: str = "wav",
    *,
    seconds: float = 3.0,
    rate: int = 44100,
    channels: int = 2,
) -> bytes:
    """Encode :func:`tone` as ``codec`` in ``container`` (wav, flac, mp3...)."""
    out = io.BytesIO()
    with av.open(out, "w", format=container) as writer:
        layout = "stereo" if channels == 2 else "mono"
        stream = writer.add_stream(codec, rate=rate, layout=layout)
        _encode_tone(writer, stream, seconds, rate, channels)
    return out.getvalue()


def resolution_change(tmp_path: Any) -> bytes:
    """An h264 mkv whose frames go from 64x48 to 160x160 halfway (two encodes joined with
    FFmpeg's concat demuxer, ``-c copy``): the header says 64x48."""
    import subprocess
    from pathlib import Path

    root = Path(tmp_path)
    for name, size in (("a", (48, 64)), ("b", (160, 160))):
        (root / f"{name}.mkv").write_bytes(
            encode_video("libx264", "matroska", frames=24, size=size)
        )
    (root / "list.txt").write_text("file 'a.mkv'\nfile 'b.mkv'\n")
    joined = root / "joined.mkv"
    concat = ["-f", "concat", "-safe", "0", "-i", str(root / "list.txt"), "-c", "copy"]
    subprocess.run(["ffmpeg", "-y", "-loglevel", "error", *concat, str(joined)], check=True)
    return joined.read_bytes()


def gapped_sound(seconds: int = 60, gap_s: int = 20_000) -> bytes:
    """Opus in mp4 whose packets after the first are stamped ``gap_s`` seconds later: a track
    that claims to last hours, where reaching a window means decoding through the gap."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as writer:
        stream = writer.add_stream("libopus", rate=48000)
        stream.bit_rate, stream.layout = 6000, "mono"
        packets = []
        for start in range(0, seconds * 48000, 960):
            wave = (0.1 * np.sin(np.arange(start, start + 960) / 10)).astype(np.float32)
            frame = av.AudioFrame.from_ndarray(wave[None], format="flt", layout="mono")
            frame.sample_rate, frame.pts = 48000, start
            packets += stream.encode(frame)
        packets += stream.encode(None)
        for index, packet in enumerate(packets):
            if index:
                packet.pts += gap_s * 48000
                packet.dts = packet.pts
            writer.mux(packet)
    return out.getvalue()
