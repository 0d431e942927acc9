"""Field decoding: webdataset's handler chain (``Decoder``), the extension registry, media decoders.

Safe by default: pickle and unrestricted ``torch.load`` run only after
:func:`allow_unsafe_decoders` or with ``CLOUDSHARDS_ALLOW_PICKLE=1``; gzip, ``.npz``, ``.npy``
and ``.pth`` inflate at most to the decode limit, and JSON makes objects up to it (see
:class:`Decoder`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cloudshards import inflate
from cloudshards.clips import AudioClip, VideoClip, current_sample
from cloudshards.errors import ConfigError, DecodeError, ShardError
from cloudshards.imagedecode import (
    AUDIO_EXTENSIONS,
    IMAGE_EXTENSIONS,
    IMAGE_FORMATS,
    IMAGE_SPECS,
    VIDEO_EXTENSIONS,
    ImageHandler,
    imagehandler,
)
from cloudshards.inflate import npy_loads, npz_loads
from cloudshards.tensorbin import tenbin_loads
from cloudshards.types import DecodeFn, Sample
from cloudshards.unsafe import (
    allow_unsafe_decoders,
    cbor_loads,
    msgpack_loads,
    torch_loads,
    unpickle_loads,
)
from cloudshards.wholemedia import torch_audio, torch_video

__all__ = [
    "AUDIO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "IMAGE_FORMATS",
    "IMAGE_SPECS",
    "UNSAFE",
    "VIDEO_EXTENSIONS",
    "Continue",
    "Decoder",
    "DecodingError",
    "Handler",
    "ImageHandler",
    "allow_unsafe_decoders",
    "basichandlers",
    "cbor_loads",
    "default_decoder",
    "default_post_handlers",
    "default_pre_handlers",
    "gzfilter",
    "handle_extension",
    "imagehandler",
    "make_decoder",
    "msgpack_loads",
    "npy_loads",
    "npz_loads",
    "register_decoder",
    "tenbin_loads",
    "torch_audio",
    "torch_loads",
    "torch_video",
    "unpickle_loads",
]

logger = logging.getLogger(__name__)

#: webdataset's name for the error a failed field raises; here it is :class:`DecodeError`.
DecodingError = DecodeError

#: A handler: ``(".field", data) -> decoded value``, a :class:`Continue`, or None to pass.
Handler = Callable[[str, bytes], Any]

#: Extensions whose decoders can run arbitrary code; refused unless unsafe decoding is on.
UNSAFE: frozenset[str] = frozenset({"pkl", "pickle", "pyd"})


def _decode_text(data: bytes) -> str:
    return data.decode("utf-8")


def _decode_int(data: bytes) -> int:
    return int(data)


_registry: dict[str, DecodeFn] = {
    **dict.fromkeys(["txt", "text", "transcript"], _decode_text),
    **dict.fromkeys(["cls", "cls2", "index", "inx", "id"], _decode_int),
    **dict.fromkeys(["json", "jsn"], inflate.json_loads),
    **dict.fromkeys(sorted(UNSAFE), unpickle_loads),
    "pth": torch_loads,
    **dict.fromkeys(["ten", "tb"], tenbin_loads),
    **dict.fromkeys(["mp", "msg"], msgpack_loads),
    "npy": npy_loads,
    "npz": npz_loads,
    "cbor": cbor_loads,
}


def register_decoder(ext: str, fn: DecodeFn, *, overwrite: bool = False) -> None:
    """Decode fields whose last extension is ``ext`` with ``fn`` in :func:`basichandlers`.

    Args:
        ext: A single extension without dot, matched case-sensitively (``"jpg"``, ``"seg"``).
        fn: Called with the field's bytes; returns the decoded value.
        overwrite: Replace an existing decoder for ``ext`` (built-in ones included).

    Raises:
        ConfigError: ``ext`` is malformed, ``fn`` is not callable, or ``ext`` is taken.
    """
    if not isinstance(ext, str) or not ext or "." in ext or ext.split() != [ext]:
        raise ConfigError(f"extension {ext!r} must be one word without dots, e.g. 'jpg'")
    if not callable(fn):
        raise ConfigError(f"decoder for {ext!r} must be callable, got {type(fn).__name__}")
    if ext in _registry and not overwrite:
        taken = getattr(_registry[ext], "__qualname__", repr(_registry[ext]))
        raise ConfigError(f"{ext!r} is taken by {taken}; pass overwrite=True to replace it")
    _registry[ext] = fn
    logger.debug("registered decoder %r for .%s", fn, ext)


def basichandlers(key: str, data: bytes) -> Any:
    """Decode by the last extension of ``key`` with the registered decoders, else None.

    Built in: txt text transcript -> str; cls cls2 index inx id -> int; json jsn -> JSON;
    npy -> array; npz -> dict; pth -> ``torch.load``; mp msg -> msgpack; cbor -> CBOR;
    pkl pickle pyd -> unpickle (unsafe, see :func:`allow_unsafe_decoders`).
    """
    decode = _registry.get(key.rpartition(".")[2])
    return None if decode is None else decode(data)


class _ExtensionHandler:
    """Calls ``f(data)`` when the key ends with one of the dotted extension targets."""

    def __init__(self, extensions: str | Iterable[str], f: DecodeFn) -> None:
        words = extensions.split() if isinstance(extensions, str) else list(extensions)
        self.targets = [word.lower().split(".") for word in words]
        self.f = f

    def __call__(self, key: str, data: bytes) -> Any:
        parts = key.lower().split(".")
        for target in self.targets:
            if len(target) <= len(parts) and parts[len(parts) - len(target) :] == target:
                return self.f(data)
        return None


def handle_extension(extensions: str | Iterable[str], f: DecodeFn) -> Handler:
    """Make a handler that applies ``f`` to fields with the given extensions.

    Args:
        extensions: Space-separated extensions, case-insensitive. A dotted one (``"seg.jpg"``)
            needs that many trailing components (``x.seg.jpg`` matches, ``x.jpg`` does not).
        f: Called with the field's bytes.

    Returns:
        A handler for :class:`Decoder`.
    """
    return _ExtensionHandler(extensions, f)


class Continue:
    """Returned by a handler to re-dispatch new data under a new key to the later handlers.

    Args:
        key: The new key, with its leading dot (``".jpg"`` for a decompressed ``".jpg.gz"``).
        data: The new data.
    """

    def __init__(self, key: str, data: bytes) -> None:
        self.key, self.data = key, data


def gzfilter(key: str, data: bytes) -> Continue | None:
    """Gunzip ``.gz`` fields (at most to the decode limit) and continue decoding them under the
    key without ``.gz``."""
    if not key.endswith(".gz"):
        return None
    return Continue(key[:-3], inflate.gunzip(data, inflate.decode_limit()))


default_pre_handlers: list[Handler] = [gzfilter]
default_post_handlers: list[Handler] = [basichandlers]


class Decoder:
    """Decode every field of a sample with a chain of handlers (webdataset's ``Decoder``).

    Each field ``k`` goes as ``("." + k, data)`` through ``pre + handlers + post``; the first
    non-None result wins, a :class:`Continue` hands new key and data to the later handlers, and
    undecoded fields stay bytes. ``__``-prefixed fields pass through (bytes become UTF-8 text).

    Args:
        handlers: Handlers tried after ``pre`` and before ``post``.
        pre: Handlers tried first; default ``[gzfilter]``.
        post: Handlers tried last; default ``[basichandlers]``.
        only: Fields to decode (a list or a space-separated string); the rest pass through.
        partial: Pass fields that are not bytes through instead of raising.
        max_bytes: Most bytes a gzip, ``.npz``, ``.npy`` or ``.pth`` field may inflate to, and
            a JSON field's objects may take (see :func:`cloudshards.inflate.json_loads`): a
            decompression-bomb guard; a pipeline's ``.decode()`` passes its ``max_member_bytes``;
            None: :func:`cloudshards.config.max_decoded_bytes`. Images: Pillow's own limit.

    Raises:
        ConfigError: A handler is not callable, or ``max_bytes`` is negative.
    """

    def __init__(
        self,
        handlers: Iterable[Handler],
        pre: Iterable[Handler] | None = None,
        post: Iterable[Handler] | None = None,
        only: str | Iterable[str] | None = None,
        partial: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        if isinstance(handlers, str):
            raise ConfigError("handlers must be a list; for imagespecs use make_decoder()")
        pre = default_pre_handlers if pre is None else pre
        post = default_post_handlers if post is None else post
        self.handlers: list[Handler] = [*pre, *handlers, *post]
        for handler in self.handlers:
            if not callable(handler):
                raise ConfigError(f"decoder handler {handler!r} is not callable")
        self.only = None if only is None else set(only.split() if isinstance(only, str) else only)
        self.partial = partial
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"max_bytes must not be negative, got {max_bytes}")
        self.max_bytes = max_bytes

    def decode1(self, key: str, data: bytes) -> Any:
        """Decode one field's ``data``; ``key`` is the field name without the leading dot."""
        key = "." + key
        # The handlers' signature is webdataset's (key, data): the limit travels beside it.
        token = inflate.active_limit.set(self.max_bytes)
        try:
            for handler in self.handlers:
                result = handler(key, data)
                if isinstance(result, Continue):
                    key, data = result.key, result.data
                    continue
                if result is not None:
                    return result
            return data
        finally:
            inflate.active_limit.reset(token)

    def decode(self, sample: Sample) -> Sample:
        """Return a new sample with its fields decoded.

        Raises:
            DecodeError: A field failed; names the URL, key, field and the underlying reason.
            ImportError: A decoder needs a package that is not installed.
        """
        if not isinstance(sample, dict):
            raise TypeError(f"a sample must be a dict, got {type(sample).__name__}")
        result: Sample = {}
        token = current_sample.set(sample)  # who is decoding, for clip decoders' seeds
        try:
            self._decode_fields(sample, result)
        finally:
            current_sample.reset(token)
        return result

    def _decode_fields(self, sample: Sample, result: Sample) -> None:
        for k, v in sample.items():
            if k[:2] == "__":
                if isinstance(v, bytes):
                    try:
                        v = v.decode("utf-8")
                    except UnicodeDecodeError:
                        logger.debug("kept %s as bytes: not UTF-8", k)
                result[k] = v
            elif self.only is not None and k not in self.only:
                result[k] = v
            elif isinstance(v, bytes):
                try:
                    result[k] = self.decode1(k, v)
                except ImportError:
                    raise  # a missing package is a setup error, not a bad sample to skip
                except Exception as exn:
                    reason = exn.reason if isinstance(exn, ShardError) else str(exn)
                    raise _error(sample, k, reason or type(exn).__name__) from exn
            elif self.partial and v is not None:
                result[k] = v
            else:
                hint = "" if self.partial else " (partial=True passes such fields through)"
                raise _error(sample, k, f"expected bytes, got {type(v).__name__}{hint}")

    def __call__(self, sample: Sample) -> Sample:
        """Same as :meth:`decode`."""
        return self.decode(sample)


def _error(sample: Sample, field: str, reason: str) -> DecodeError:
    url, key = sample.get("__url__"), sample.get("__key__")
    return DecodeError(
        f"cannot decode field {field!r}: {reason}",
        url=url if isinstance(url, str) else None,
        key=key if isinstance(key, str) else None,
        field=field,
        sample=sample,  # the undecoded sample, as webdataset's DecodingError.sample
    )


def make_decoder(
    *args: str | Handler,
    pre: Iterable[Handler] | None = None,
    post: Iterable[Handler] | None = None,
    only: str | Iterable[str] | None = None,
    partial: bool = False,
    max_bytes: int | None = None,
    video: VideoClip | Mapping[str, Any] | None = None,
    audio: AudioClip | Mapping[str, Any] | None = None,
) -> Decoder:
    """Build the :class:`Decoder` for ``.decode(*args)``: strings are imagespecs; ``video`` and
    ``audio`` (clip decoders, or their arguments as a dict) go before the other handlers.

    Raises:
        ConfigError: An imagespec is unknown (the message lists the valid ones), or a clip
            decoder's arguments are invalid.
    """
    clips: list[Handler] = []
    if video is not None:
        clips.append(video if isinstance(video, VideoClip) else VideoClip(**video))
    if audio is not None:
        clips.append(audio if isinstance(audio, AudioClip) else AudioClip(**audio))
    handlers = [ImageHandler(arg) if isinstance(arg, str) else arg for arg in args]
    return Decoder(
        [*clips, *handlers], pre=pre, post=post, only=only, partial=partial, max_bytes=max_bytes
    )


#: webdataset's ``default_decoder``: gunzip plus the basic handlers, no images.
default_decoder = Decoder([])
