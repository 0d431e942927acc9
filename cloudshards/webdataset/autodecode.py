"""webdataset 1.0.2's ``webdataset.autodecode``: the decoder handler chain and field decoders.

Backed by :mod:`cloudshards.decoders`. Safe by default: ``.pyd``/``.pickle``/``.pkl`` fields
unpickle and ``.pth`` loads with ``weights_only=False`` only after
:func:`cloudshards.allow_unsafe_decoders` (webdataset 1.0.2 does both unless ``WDS_SECURE``).
``.ten``/``.tb`` (tenbin) fields decode to lists of arrays, as in webdataset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from cloudshards import decoders as _decoders
from cloudshards.decoders import (
    IMAGE_EXTENSIONS,
    IMAGE_SPECS,
    Continue,
    Decoder,
    DecodingError,
    ImageHandler,
    basichandlers,
    cbor_loads,
    default_decoder,
    default_post_handlers,
    default_pre_handlers,
    gzfilter,
    handle_extension,
    imagehandler,
    msgpack_loads,
    npy_loads,
    npz_loads,
    tenbin_loads,
    torch_audio,
    torch_loads,
    torch_video,
    unpickle_loads,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "Continue",
    "Decoder",
    "DecodingError",
    "ImageHandler",
    "basichandlers",
    "call_extension_handler",
    "cbor_loads",
    "decoders",
    "default_decoder",
    "default_post_handlers",
    "default_pre_handlers",
    "gzfilter",
    "handle_extension",
    "imagehandler",
    "imagespecs",
    "msgpack_loads",
    "npy_loads",
    "npz_loads",
    "pytorch_weights_only",
    "tenbin_loads",
    "torch_audio",
    "torch_loads",
    "torch_video",
    "unpickle_loads",
]

#: webdataset's ``WDS_PYTORCH_WEIGHTS_ONLY`` default. cloudshards always loads ``.pth`` with
#: ``weights_only=True`` unless unsafe decoders are allowed, whatever this says.
pytorch_weights_only = True

#: Extension -> decoder used by :func:`basichandlers`. The live registry: adding an entry here
#: registers a decoder (as in webdataset), like :func:`cloudshards.register_decoder`.
decoders: dict[str, Callable[[bytes], Any]] = _decoders._registry


#: imagespec -> (array type, element type, mode), webdataset's table (a copy: read only).
imagespecs: dict[str, tuple[str, str | None, str]] = dict(IMAGE_SPECS)


def call_extension_handler(
    key: str, data: bytes, f: Callable[[bytes], Any], extensions: Iterable[str]
) -> Any:
    """Return ``f(data)`` when ``key`` ends with one of the dotted ``extensions``, else None."""
    return handle_extension(list(extensions), f)(key, data)
