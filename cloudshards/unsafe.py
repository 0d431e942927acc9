"""Field loaders that can run code or need optional packages: pickle and ``torch.load`` (off
unless the user opts in), msgpack and CBOR.

The opt-in is per process: :func:`allow_unsafe_decoders`, or ``CLOUDSHARDS_ALLOW_PICKLE=1``,
which DataLoader workers started with ``spawn`` inherit.
"""

from __future__ import annotations

import importlib
import io
import logging
import pickle
from typing import Any

from cloudshards import config, inflate
from cloudshards.errors import DecodeError
from cloudshards.imagedecode import import_optional

__all__ = [
    "allow_unsafe_decoders",
    "cbor_loads",
    "msgpack_loads",
    "opt_in_advice",
    "torch_loads",
    "unpickle_loads",
    "unsafe_allowed",
]

logger = logging.getLogger("cloudshards.decoders")

_OPT_IN = (
    "if you trust the data, call cloudshards.decoders.allow_unsafe_decoders() "
    "or set CLOUDSHARDS_ALLOW_PICKLE=1"
)
_enabled = False


def allow_unsafe_decoders(enable: bool = True) -> None:
    """Turn on (or off) decoders that can run arbitrary code: pickle and full ``torch.load``.

    The switch is per process. DataLoader workers started with ``spawn`` do not see a call made
    inside ``main()``; set ``CLOUDSHARDS_ALLOW_PICKLE=1`` instead, which they inherit.

    Args:
        enable: True to allow ``pkl``/``pickle``/``pyd`` and ``torch.load(weights_only=False)``.
    """
    global _enabled
    _enabled = enable
    if enable:
        logger.warning("unsafe decoders enabled: pickle and torch.load can run arbitrary code")


def opt_in_advice() -> str:
    """How to allow the decoders that can run code (or why it cannot be), for messages."""
    if config.webdataset_secure():
        return "refused under WDS_SECURE (webdataset's enforce_security)"
    return _OPT_IN


def unsafe_allowed() -> bool:
    """Whether pickle and full ``torch.load`` may run (see :func:`allow_unsafe_decoders`;
    never under webdataset's ``WDS_SECURE``)."""
    if config.webdataset_secure():
        return False
    return _enabled or config.env_bool("ALLOW_PICKLE")


def unpickle_loads(data: bytes) -> Any:
    """Unpickle ``data``, only when unsafe decoding is allowed.

    Raises:
        DecodeError: Unsafe decoding is off; the message says how to turn it on.
    """
    if not unsafe_allowed():
        raise DecodeError(f"refusing to unpickle: pickle can run arbitrary code; {opt_in_advice()}")
    return pickle.loads(data)  # noqa: S301 - the user opted in explicitly


def torch_loads(data: bytes) -> Any:
    """Load a ``torch.save`` payload on the CPU, with ``weights_only=True`` unless unsafe.

    Raises:
        DecodeError: The payload holds objects ``weights_only`` refuses.
    """
    import torch

    unsafe = unsafe_allowed()
    if data[:4] == b"PK\x03\x04":  # the zip format of torch.save: bound what it inflates
        inflate.check_zip(data, inflate.decode_limit(), ".pth archive")
    try:
        return torch.load(io.BytesIO(data), weights_only=not unsafe, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if unsafe:
            raise
        raise DecodeError(
            f"torch.load(weights_only=True) refused: {_why(exc)}; {opt_in_advice()}"
        ) from exc


def _why(exc: BaseException) -> str:
    # torch's weights-only message is a page long; keep its one informative sentence.
    text = str(exc)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
    return text.strip().split("\n", 1)[0].split(". ", 1)[0] or type(exc).__name__


def msgpack_loads(data: bytes) -> Any:
    """Load msgpack data; needs the ``msgpack`` package."""
    return import_optional("msgpack", "decoding .mp/.msg").unpackb(data)


def cbor_loads(data: bytes) -> Any:
    """Load CBOR data with ``cbor`` (webdataset's choice) or else ``cbor2``."""
    try:
        module = importlib.import_module("cbor")
    except ImportError:
        module = import_optional("cbor2", "decoding .cbor")
    return module.loads(data)
