"""Sample encoders for the writers: webdataset 1.0.2's ``writer`` encoders by extension.

Values that are already bytes or str are written as they are; others go through the encoder
for the field's last extension (images with Pillow, arrays as ``.npy``, JSON, ...).
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cloudshards.errors import ConfigError
from cloudshards.imagedecode import import_optional
from cloudshards.tensorbin import tenbin_dumps
from cloudshards.types import Sample

__all__ = [
    "Encoder",
    "default_handlers",
    "encode_based_on_extension",
    "imageencoder",
    "make_encoder",
]

#: Encodes a whole sample into a sample of bytes (and ``__key__``).
Encoder = Callable[[Sample], Sample]


def imageencoder(image: Any, format: str = "PNG") -> bytes:
    """Encode a PIL image or an HW/HWC array (uint8, or float in [0, 1]) with Pillow.

    As webdataset 1.0.2's: ``"jpg"`` (any case) and ``"JPEG"`` at quality 100 (the writers'
    ``jpg jpeg img image`` fields all ask for ``"jpg"``), other spellings of JPEG at Pillow's
    default; ``"img"``/``"image"`` as PPM. WebP (which webdataset does not write) losslessly.

    Raises:
        ValueError: Float values outside [0, 1], or an array that is not an image.
    """
    import PIL.Image

    if isinstance(image, np.ndarray):
        if image.dtype.kind == "f":
            if image.size and (image.min() <= -0.001 or image.max() >= 1.001):
                raise ValueError(f"image values out of range {image.min()} {image.max()}")
            image = (np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)
        if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise ValueError(f"an image array must be HW or HWC, got shape {image.shape}")
        image = PIL.Image.fromarray(
            image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image
        )
    elif not isinstance(image, PIL.Image.Image):
        raise ValueError(f"cannot encode {type(image).__name__} as an image")
    format = {"JPG": "JPEG", "IMG": "PPM", "IMAGE": "PPM"}.get(format.upper(), format)
    # webdataset compares the spelling as given: "jpeg" gets Pillow's default quality
    options: dict[str, Any] = {"quality": 100} if format in ("JPEG", "tiff") else {}
    if format.upper() == "WEBP":
        options = {"lossless": True}
    with io.BytesIO() as out:
        image.save(out, format=format, **options)
        return out.getvalue()


def _torch_dumps(data: Any) -> bytes:
    import torch

    out = io.BytesIO()
    torch.save(data, out)
    return out.getvalue()


def _npy_dumps(data: Any) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, np.asarray(data), allow_pickle=False)
    return out.getvalue()


def _npz_dumps(data: Mapping[str, Any]) -> bytes:
    if not isinstance(data, Mapping):
        raise ValueError(f"npz fields take a dict of arrays, got {type(data).__name__}")
    out = io.BytesIO()
    arrays: dict[str, Any] = {str(k): np.asarray(v) for k, v in data.items()}
    np.savez_compressed(out, **arrays)
    return out.getvalue()


def _cbor_dumps(data: Any) -> bytes:
    try:
        module = import_optional("cbor", "encoding .cbor")
    except ImportError:
        module = import_optional("cbor2", "encoding .cbor")
    result: bytes = module.dumps(data)
    return result


def _msgpack_dumps(data: Any) -> bytes:
    result: bytes = import_optional("msgpack", "encoding .mp/.msg").packb(data)
    return result


def _image(fmt: str) -> Callable[[Any], bytes]:
    return lambda data: imageencoder(data, fmt)


def _make_handlers() -> dict[str, Callable[[Any], bytes]]:
    table: list[tuple[str, Callable[[Any], bytes]]] = [
        ("cls cls2 class count index inx id", lambda x: str(x).encode("ascii")),
        ("txt text transcript html htm", lambda x: x.encode("utf-8")),
        ("pyd pickle", pickle.dumps),  # writing pickle is safe; reading it is opt-in
        ("pth", _torch_dumps),
        ("npy", _npy_dumps),
        ("npz", _npz_dumps),
        ("ten tenbin tb", tenbin_dumps),
        ("json jsn", lambda x: json.dumps(x).encode("utf-8")),
        ("mp msgpack msg", _msgpack_dumps),
        ("cbor", _cbor_dumps),
        ("jpg jpeg img image", _image("jpg")),
        *((ext, _image(ext)) for ext in ("png", "pbm", "pgm", "ppm", "webp")),
        ("tiff tif", _image("tiff")),
    ]
    return {ext: fn for words, fn in table for ext in words.split()}


#: Extension -> encoder, as in webdataset's ``writer.default_handlers`` (plus ``webp``).
default_handlers: dict[str, Callable[[Any], bytes]] = _make_handlers()


def _encode_field(data: Any, field: str, handlers: Mapping[str, Callable[[Any], bytes]]) -> Any:
    if not field:
        raise ValueError("a field needs a name (its member would be named after the key alone)")
    if field[0] == "_":
        if not isinstance(data, str):
            raise ValueError(f"metadata field {field!r} must be a string")
        return data
    compress = field.endswith(".gz")
    name = field[:-3] if compress else field
    if isinstance(data, (bytes, bytearray, memoryview)):
        result = bytes(data) if compress else data
    elif isinstance(data, str):
        result = data.encode("utf-8")
    else:
        extension = name.rpartition(".")[2].lower()
        handler = handlers.get(extension)
        if handler is None:
            raise ValueError(f"no encoder for .{extension} ({type(data).__name__}); pass bytes")
        result = handler(data)
    return gzip.compress(result, mtime=0) if compress else result


def encode_based_on_extension(
    sample: Sample, handlers: Mapping[str, Callable[[Any], bytes]]
) -> Sample:
    """Encode every field of ``sample`` by its last extension; bytes and str pass as they are.

    Raises:
        ConfigError: A field has no encoder, or its value does not fit it; names key and field.
    """
    result: Sample = {}
    for field, value in sample.items():
        try:
            result[field] = _encode_field(value, field, handlers)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"cannot encode field {field!r} of sample {sample.get('__key__')!r}: {exc}"
            ) from exc
    return result


def make_encoder(spec: bool | Mapping[str, Callable[[Any], bytes]] | Encoder | None) -> Encoder:
    """Build a sample encoder: True (default handlers), False/None (none), a dict, a callable.

    Raises:
        ConfigError: ``spec`` is none of those.
    """
    if spec is False or spec is None:
        return lambda sample: sample
    if spec is True:
        return lambda sample: encode_based_on_extension(sample, default_handlers)
    if isinstance(spec, Mapping):
        handlers = dict(spec)
        return lambda sample: encode_based_on_extension(sample, handlers)
    if callable(spec):
        return spec
    raise ConfigError(f"encoder must be True, False, a dict or a callable, got {spec!r}")
