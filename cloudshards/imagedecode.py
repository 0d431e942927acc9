"""Image decoding under webdataset's imagespecs (Pillow); the media extensions and optional imports.

Image outputs equal webdataset 1.0.2's bit for bit: type, dtype, shape, value range, CHW for torch.
"""

from __future__ import annotations

import importlib
import io
import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from cloudshards.errors import ConfigError, DecodeError

if TYPE_CHECKING:
    pass

__all__ = [
    "AUDIO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "IMAGE_FORMATS",
    "IMAGE_SPECS",
    "VIDEO_EXTENSIONS",
    "ImageHandler",
    "decode_image",
    "image_formats",
    "imagehandler",
    "import_optional",
    "open_image",
]

logger = logging.getLogger(__name__)

_IMAGE_EXTENSION_WORDS = (
    "blp bmp dib bufr cur pcx dcx dds ps eps fit fits fli flc ftc ftu gbr gif grib h5 hdf png "
    "apng jp2 j2k jpc jpf jpx j2c icns ico im iim tif tiff jfif jpe jpg jpeg mpg mpeg msp pcd "
    "pxr pbm pgm ppm pnm psd bw rgb rgba sgi ras tga icb vda vst webp wmf emf xbm xpm"
)
#: Extensions the image handler decodes: every format Pillow can open (webdataset's list).
#: A list, as in webdataset, so ``IMAGE_EXTENSIONS + ["xyz"]`` keeps working; do not mutate it.
IMAGE_EXTENSIONS: list[str] = _IMAGE_EXTENSION_WORDS.split()
#: Extensions :func:`torch_video` and :func:`torch_audio` handle (webdataset's, case-sensitive).
VIDEO_EXTENSIONS = frozenset(["mp4", "ogv", "mjpeg", "avi", "mov", "h264", "mpg", "webm", "wmv"])
AUDIO_EXTENSIONS = frozenset(["flac", "mp3", "sox", "wav", "m4a", "ogg", "wma"])

#: Most pixels a video frame may have before decoding it is refused: 8K UHD (7680 x 4320).
DEFAULT_MAX_VIDEO_PIXELS = 7680 * 4320

ArrayType = Literal["numpy", "torch", "pil"]
ElementType = Literal["uint8", "float"]
Mode = Literal["l", "rgb", "rgba"]

#: imagespec -> (array type, element type, mode), exactly webdataset's ``imagespecs``.
IMAGE_SPECS: Mapping[str, tuple[ArrayType, ElementType | None, Mode]] = MappingProxyType(
    {
        "l8": ("numpy", "uint8", "l"),
        "rgb8": ("numpy", "uint8", "rgb"),
        "rgba8": ("numpy", "uint8", "rgba"),
        "l": ("numpy", "float", "l"),
        "rgb": ("numpy", "float", "rgb"),
        "rgba": ("numpy", "float", "rgba"),
        "torchl8": ("torch", "uint8", "l"),
        "torchrgb8": ("torch", "uint8", "rgb"),
        "torchrgba8": ("torch", "uint8", "rgba"),
        "torchl": ("torch", "float", "l"),
        "torchrgb": ("torch", "float", "rgb"),
        "torch": ("torch", "float", "rgb"),
        "torchrgba": ("torch", "float", "rgba"),
        "pill": ("pil", None, "l"),
        "pil": ("pil", None, "rgb"),
        "pilrgb": ("pil", None, "rgb"),
        "pilrgba": ("pil", None, "rgba"),
    }
)

# webdataset computes ``astype(float32) / 255.0``; one float32 ufunc pass with the same float32
# operands rounds identically (tested over all 256 inputs) and skips an intermediate array.
_MAX_UINT8 = np.float32(255.0)


def import_optional(name: str, what: str) -> ModuleType:
    """Import an optional package, or raise an ImportError naming what needs it and the fix."""
    # import_module also keeps optional packages without type stubs out of mypy's view.
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        install = 'pip install "cloudshards[video]"' if name == "av" else f"pip install {name}"
        raise ImportError(f"{what} needs the {name} package: {install}") from exc


#: Pillow formats decoded by default, in the order they are tried: those whose header gives the
#: size decoding makes, so ``PIL.Image.MAX_IMAGE_PIXELS`` is checked before any decoding.
#: Containers are left out: an ICNS or ICO header names one size and embeds a PNG of another
#: (a 660 KB ``.icns`` reporting 256x256 decoded a 13,000^2 PNG), and Pillow picks the format
#: from the content, whatever the field's extension. Widen it per handler with ``formats=``.
IMAGE_FORMATS: tuple[str, ...] = (
    "JPEG",
    "PNG",
    "WEBP",
    "GIF",
    "BMP",
    "TIFF",
    "PPM",
    "TGA",
    "AVIF",
    "JPEG2000",
    "QOI",
    "SGI",
    "PCX",
)

#: Pillow formats that run another program on the image's bytes: EPS is rendered by Ghostscript
#: (``gs``), a PostScript interpreter with a history of ``-dSAFER`` escapes. A field is never
#: opened as one of these unless unsafe decoders are allowed (:mod:`cloudshards.unsafe`), which
#: also adds them to the default formats.
_RUNS_PROGRAMS = ("EPS",)
#: How PostScript starts: text, or the binary DOS EPS header.
_POSTSCRIPT_MAGIC = (b"%!PS", b"\xc5\xd0\xd3\xc6")


def image_formats(formats: Iterable[str] | None) -> tuple[str, ...]:
    """The Pillow format names ``formats`` stands for, upper-case and checked.

    Args:
        formats: Pillow format names (``"ICO"``), or None for :data:`IMAGE_FORMATS`.

    Raises:
        ConfigError: A name is not a format Pillow opens; the message lists the valid ones.
    """
    if formats is None:
        return IMAGE_FORMATS
    chosen = tuple(dict.fromkeys(name.upper() for name in formats))
    try:
        import PIL.Image
    except ImportError:
        return chosen  # decoding says what to install
    PIL.Image.init()
    unknown = [name for name in chosen if name not in PIL.Image.OPEN]
    if unknown:
        valid = " ".join(sorted(PIL.Image.OPEN))
        raise ConfigError(f"unknown image formats {unknown}; Pillow opens: {valid}")
    return chosen


def open_image(data: bytes, formats: Iterable[str] | None = None) -> Any:
    """``PIL.Image.open`` on in-memory bytes, limited to ``formats``.

    Pillow picks the format from the content, whatever the field's extension, so the limit is
    what stops a ``.jpg`` field holding PostScript from running Ghostscript, or one holding an
    ICNS from decoding an embedded PNG larger than its header says.

    Args:
        data: Encoded image.
        formats: Pillow format names to accept; None: :data:`IMAGE_FORMATS`. Formats that run
            a program (EPS) are accepted only when unsafe decoders are allowed, and then by
            default.

    Raises:
        DecodeError: The bytes are in a format Pillow knows but ``formats`` leaves out (the
            message names it), or PostScript while unsafe decoders are not allowed.
        PIL.UnidentifiedImageError: Bytes that no format Pillow knows accepts.
    """
    import PIL.Image

    from cloudshards.unsafe import opt_in_advice, unsafe_allowed  # unsafe imports this module

    chosen = image_formats(formats)
    if not unsafe_allowed():
        chosen = tuple(name for name in chosen if name not in _RUNS_PROGRAMS)
    elif formats is None:
        chosen += _RUNS_PROGRAMS
    try:
        return PIL.Image.open(io.BytesIO(data), formats=chosen)
    except PIL.UnidentifiedImageError:
        found = _identify(data, chosen)
        if found is None:
            raise
        if found in _RUNS_PROGRAMS and not unsafe_allowed():
            raise DecodeError(
                "the image is PostScript (EPS), which Pillow renders by running Ghostscript on "
                f"its bytes: refused; {opt_in_advice()}"
            ) from None
        raise DecodeError(
            f"the image is {found}, which is not among the formats decoded "
            f"({', '.join(chosen)}): refused before decoding, since its header need not give "
            "the size decoding makes (ICNS and ICO embed PNGs of any size); if such images are "
            f"expected, add {found!r} to ImageHandler's formats="
        ) from None


def _identify(data: bytes, tried: tuple[str, ...]) -> str | None:
    """The format another Pillow plugin would take ``data`` for, by its magic bytes alone
    (the plugins' ``accept`` checks: nothing is parsed), or None."""
    import PIL.Image

    if data.lstrip()[:4] in _POSTSCRIPT_MAGIC:
        return "EPS"
    prefix = data[:16]  # what Image.open hands the checks
    for name, (_, accept) in PIL.Image.OPEN.items():
        if name in tried or accept is None:
            continue
        result = accept(prefix)
        if result and not isinstance(result, str):  # a string: "maybe", with a warning
            return str(name)
    return None


def decode_image(data: bytes, imagespec: str, formats: Iterable[str] | None = None) -> Any:
    """Decode encoded image bytes the way webdataset's ``ImageHandler(imagespec)`` does.

    Args:
        data: Encoded image.
        imagespec: One of :data:`IMAGE_SPECS`.
        formats: Pillow formats to decode (see :func:`open_image`); None:
            :data:`IMAGE_FORMATS`.

    Returns:
        A ``PIL.Image.Image``, an HWC (or HW) numpy array, or a CHW (or HW) torch tensor;
        floats are float32 in [0, 1], integers uint8.

    Raises:
        DecodeError: The image has more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels (read
            from its header, before any decoding; Pillow itself only warns below twice that).
            Setting it to None turns the check off. Or the image is in a format that
            ``formats`` leaves out (see :func:`open_image`).
        ImportError: Pillow is not installed.
        KeyError: ``imagespec`` is unknown (:class:`ImageHandler` validates it up front).
    """
    try:
        import PIL.Image
    except ImportError as exc:
        raise ImportError('decoding images needs Pillow: pip install "cloudshards[image]"') from exc

    atype, etype, mode = IMAGE_SPECS[imagespec]
    limit = PIL.Image.MAX_IMAGE_PIXELS
    advice = (
        f"(Pillow's PIL.Image.MAX_IMAGE_PIXELS = {limit}; raise it in every worker if such "
        "images are expected)"
    )
    try:
        opened = open_image(data, formats)
        width, height = opened.size
        if limit is not None and width * height > limit:
            # Pillow only warns up to twice the limit, and decodes: a 21 KB PNG of 13,000^2
            # pixels became a 2.6 GiB tensor. Refused from the header, before any decoding.
            raise DecodeError(
                f"image of {width}x{height} = {width * height} pixels is over the limit {advice}"
            )
        opened.load()  # decodes everything; the in-memory stream needs no closing
    except PIL.Image.DecompressionBombError as exc:
        raise DecodeError(f"{exc} {advice}") from exc
    if atype == "pil":
        # A plain Image like webdataset's (it converts a second time to the same mode; that
        # only copies).
        return opened.convert(mode.upper())
    # convert() to the mode the image already has is a full copy: skipping it saves ~7% of the
    # CPU time of turning a 256x256 JPEG into an array (measured; see benchmarks/bench_decode.py).
    img = opened if opened.mode == mode.upper() else opened.convert(mode.upper())

    # After convert() the array is HW (L) or HWC with 3 or 4 channels, so webdataset's channel
    # fix-ups (mean, repeat, concatenate) never run. np.asarray wraps Pillow's bytes read-only.
    array: np.ndarray[Any, np.dtype[np.uint8]] = np.asarray(img)
    if atype == "numpy":
        if etype == "float":
            return np.divide(array, _MAX_UINT8, dtype=np.float32)
        return array

    import torch

    if array.ndim == 3:
        array = array.transpose(2, 0, 1)
    if etype == "float":
        # Transpose and convert in one pass straight into a contiguous CHW float32 array.
        return torch.from_numpy(np.divide(array, _MAX_UINT8, dtype=np.float32, order="C"))
    # A writable contiguous copy: torch warns on read-only arrays and wants CHW contiguous.
    return torch.from_numpy(np.array(array, order="C"))


class ImageHandler:
    """Decode image fields to the form an imagespec names (webdataset's ``ImageHandler``).

    ``l8 rgb8 rgba8`` give numpy uint8, ``l rgb rgba`` numpy float32 in [0, 1] (HW or HWC);
    ``torchl8 torchrgb8 torchrgba8`` torch uint8, ``torchl torchrgb torch torchrgba`` torch
    float32 (HW or CHW); ``pill pil pilrgb pilrgba`` PIL images in mode L, RGB, RGB, RGBA.

    Args:
        imagespec: One of :data:`IMAGE_SPECS`.
        extensions: Extensions to decode (case-insensitive); default :data:`IMAGE_EXTENSIONS`.
        formats: Pillow formats to decode, whatever the extension says (Pillow reads the
            format from the content); default :data:`IMAGE_FORMATS`. A field in another
            format is a :class:`DecodeError` naming it. Widen it only for formats whose
            decoded size the header gives, or for data you trust:
            ``formats=(*IMAGE_FORMATS, "ICO")``.

    Raises:
        ConfigError: ``imagespec`` is unknown, or a format is not one Pillow opens; the
            message lists the valid ones.
    """

    def __init__(
        self,
        imagespec: str,
        extensions: Iterable[str] | None = None,
        *,
        formats: Iterable[str] | None = None,
    ) -> None:
        if imagespec not in IMAGE_SPECS:
            valid = " ".join(IMAGE_SPECS)
            raise ConfigError(f"unknown imagespec {imagespec!r}; valid imagespecs: {valid}")
        self.imagespec = imagespec
        chosen = IMAGE_EXTENSIONS if extensions is None else extensions
        self.extensions = frozenset(extension.lower() for extension in chosen)
        self.formats = None if formats is None else image_formats(formats)

    def __call__(self, key: str, data: bytes) -> Any:
        """Decode ``data`` if the last extension of ``key`` is an image extension, else None.

        Args:
            key: The field name with a leading dot, e.g. ``".jpg"`` or ``".seg.png"``.
            data: Encoded image bytes.

        Returns:
            The decoded image, or None when ``key`` is not an image extension.
        """
        if key.rpartition(".")[2].lower() not in self.extensions:
            return None
        return decode_image(data, self.imagespec, self.formats)

    def __repr__(self) -> str:
        return f"ImageHandler({self.imagespec!r})"


def imagehandler(
    imagespec: str,
    extensions: Iterable[str] | None = None,
    *,
    formats: Iterable[str] | None = None,
) -> ImageHandler:
    """Create an :class:`ImageHandler` (webdataset's lower-case alias).

    Args:
        imagespec: One of :data:`IMAGE_SPECS`.
        extensions: Extensions to decode; default :data:`IMAGE_EXTENSIONS`.
        formats: Pillow formats to decode; default :data:`IMAGE_FORMATS`.

    Returns:
        The handler.
    """
    return ImageHandler(imagespec, extensions, formats=formats)
