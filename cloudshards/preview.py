"""One-line previews of sample fields: ``JPEG 640x480 RGB``, a JSON snippet, a video's size.

Used by ``cloudshards cat``. Reads headers where it can (images, arrays, media containers) and
never runs unsafe decoders: pickle and ``torch.save`` payloads are only named.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import numpy as np

from cloudshards.decoders import UNSAFE
from cloudshards.imagedecode import (
    AUDIO_EXTENSIONS,
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    open_image,
)
from cloudshards.inflate import decode_limit, gunzip

__all__ = ["describe"]

logger = logging.getLogger(__name__)

_IMAGES = frozenset(IMAGE_EXTENSIONS)
_JSON = frozenset({"json", "jsn"})
_INTEGERS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})


def describe(field: str, value: Any, width: int = 60) -> str:
    """Describe a field's value in one line of at most about ``width`` characters.

    Args:
        field: The field name (``"jpg"``, ``"seg.png"``, ``"json.gz"``); its last extension
            picks the preview.
        value: The raw bytes (or an already decoded value).
        width: Longest text snippet shown.

    Returns:
        The preview; ``<N bytes>`` when nothing better is known, ``<undecodable ...>`` when the
        bytes do not parse as their extension says.
    """
    if not isinstance(value, (bytes, bytearray, memoryview)):
        return _clip(repr(value), width)
    data = bytes(value)
    extension = field.rpartition(".")[2].lower()
    prefix = ""
    try:
        if extension == "gz":
            data = gunzip(data, decode_limit())  # bounded: a preview must not inflate a bomb
            field, prefix = field[:-3], f"gzip of {len(data):,} B: "
            extension = field.rpartition(".")[2].lower()
        return prefix + _describe_bytes(extension, data, width)
    except Exception as exc:  # a preview must never stop the listing
        logger.debug("preview of %s failed: %r", field, exc)
        return f"{prefix}<undecodable .{extension}: {_clip(str(exc) or type(exc).__name__, 60)}>"


def _describe_bytes(extension: str, data: bytes, width: int) -> str:
    if extension in _IMAGES:
        return _image(data)
    if extension in VIDEO_EXTENSIONS or extension in AUDIO_EXTENSIONS:
        return _media(data)
    if extension in _JSON:
        compact = json.dumps(json.loads(data), ensure_ascii=False, separators=(", ", ": "))
        return _clip(compact, width)
    if extension in _INTEGERS:
        return str(int(data))
    if extension == "npy":
        return _npy(data)
    if extension == "npz":
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return "npz: " + ", ".join(archive.files)
    if extension == "pth":
        return "torch.save payload (not loaded)"
    if extension in UNSAFE:
        return "pickle (not loaded: unsafe)"
    text: str | None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or not all(c.isprintable() or c in "\n\r\t" for c in text[:1000]):
        return f"<{len(data):,} bytes binary: {data[:8].hex(' ')}{' ...' if len(data) > 8 else ''}>"
    return _clip(repr(text), width)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 1)] + "..."


def _image(data: bytes) -> str:
    import PIL.Image

    try:
        with open_image(data) as image:  # reads the header only
            return f"{image.format} {image.width}x{image.height} {image.mode}"
    except PIL.UnidentifiedImageError:
        raise ValueError("not an image Pillow can read") from None


def _npy(data: bytes) -> str:
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    read_header = (
        np.lib.format.read_array_header_1_0
        if version == (1, 0)
        else np.lib.format.read_array_header_2_0
    )
    shape, fortran, dtype = read_header(stream)
    return f"array {dtype} {tuple(shape)}" + (" (Fortran order)" if fortran else "")


def _media(data: bytes) -> str:
    from cloudshards.imagedecode import import_optional

    av = import_optional("av", "previewing video and audio")
    parts: list[str] = []
    with av.open(io.BytesIO(data)) as container:
        for stream in container.streams.video[:1]:
            text = f"video {stream.codec_context.name} {stream.width}x{stream.height}"
            if stream.frames:
                text += f", {stream.frames} frames"
            if stream.average_rate:
                text += f", {float(stream.average_rate):g} fps"
            parts.append(text)
        for stream in container.streams.audio[:1]:
            channels = len(stream.layout.channels)
            parts.append(f"audio {stream.codec_context.name} {stream.rate} Hz, {channels} ch")
        if container.duration is not None:
            parts.append(f"{container.duration / 1e6:.2f} s")
    return "; ".join(parts) or "no video or audio stream"
