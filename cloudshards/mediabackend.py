"""Which library decodes video and audio clips: torchcodec where it loads, PyAV otherwise.

torchcodec (PyTorch's own decoder, what HF datasets and LitData moved to) needs FFmpeg's shared
libraries on the machine (Debian's ``ffmpeg`` package) and a release built for the installed
torch; on this project's CPU torch 2.13 that is torchcodec 0.13 (0.14 and later load CUDA's
libnvrtc). PyAV carries its own FFmpeg. Both give the same frames (see docs/video.md).
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Literal

from cloudshards import config
from cloudshards.errors import ConfigError, DecodeError
from cloudshards.imagedecode import import_optional

__all__ = ["BACKENDS", "Backend", "media_backend", "opening_error", "torchcodec_error"]

logger = logging.getLogger("cloudshards.decoders")

Backend = Literal["torchcodec", "pyav"]
#: What ``backend=`` and ``CLOUDSHARDS_MEDIA_BACKEND`` accept.
BACKENDS = ("auto", "torchcodec", "pyav")

_lock = threading.Lock()
_torchcodec_error: list[str | None] = []  # one entry once probed: None when it loads
_logged: set[str] = set()


def torchcodec_error() -> str | None:
    """Why torchcodec cannot decode here (not installed, FFmpeg missing...), or None."""
    with _lock:
        if not _torchcodec_error:
            try:
                importlib.import_module("torchcodec.decoders")
            except (ImportError, OSError, RuntimeError) as exc:
                # torchcodec raises RuntimeError when no FFmpeg it supports can be loaded.
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                _torchcodec_error.append(f"{type(exc).__name__}: {first}")
            else:
                _torchcodec_error.append(None)
        return _torchcodec_error[0]


def media_backend(requested: str | None = None) -> Backend:
    """The backend to decode with: ``requested``, else ``CLOUDSHARDS_MEDIA_BACKEND``, else auto.

    Auto is torchcodec when it loads, else PyAV; the choice is logged once per process.

    Raises:
        ConfigError: An unknown backend name.
        ImportError: The backend asked for cannot be loaded (the message says why).
    """
    choice = requested or config.env_str("MEDIA_BACKEND") or "auto"
    if choice not in BACKENDS:
        raise ConfigError(f"media backend {choice!r} is not one of {', '.join(BACKENDS)}")
    why = torchcodec_error() if choice in ("auto", "torchcodec") else None
    if choice == "torchcodec" and why is not None:
        raise ImportError(
            f"torchcodec was asked for but cannot be loaded ({why}); it needs FFmpeg's shared "
            "libraries (Debian/Ubuntu: apt-get install ffmpeg) and a release built for this "
            "torch; or use backend='pyav'"
        )
    backend: Backend = "pyav" if choice == "pyav" or why is not None else "torchcodec"
    if backend == "pyav":
        import_optional("av", "decoding video and audio clips")
    with _lock:
        if choice not in _logged:
            _logged.add(choice)
            reason = f" (torchcodec: {why})" if choice == "auto" and why else ""
            logger.info("video and audio clips decode with %s%s", backend, reason)
    return backend


def opening_error(exc: Exception, kind: str) -> DecodeError:
    """A clear error for torchcodec failing to open a ``kind`` ("video", "audio") stream: its
    first line, and "no ... stream" for its internal-error wording of that case."""
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else type(exc).__name__
    if "stream is unknown" in first:
        return DecodeError(f"no {kind} stream")
    return DecodeError(first)
