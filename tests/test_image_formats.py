"""Images decode only in formats whose header gives the decoded size, so the pixel limit holds.

Pillow picks the format from the content, whatever the field's extension: an ICNS header
names one size and embeds a PNG of another, which Pillow decodes in full (docs/security.md).
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from cloudshards.decoders import make_decoder
from cloudshards.errors import ConfigError, DecodeError
from cloudshards.imagedecode import IMAGE_FORMATS, imagehandler

URL = "file:///data/shard-000003.tar"


def sample(**fields: Any) -> dict[str, Any]:
    return {"__key__": "dir/k0001", "__url__": URL, **fields}


def encode(fmt: str, size: tuple[int, int] = (7, 5), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, "red").save(out, format=fmt)
    return out.getvalue()


def icns(png: bytes) -> bytes:
    """An ICNS holding one ``ic08`` (256x256) entry, whatever size the PNG in it has."""
    entry = b"ic08" + struct.pack(">I", 8 + len(png)) + png
    return b"icns" + struct.pack(">I", 8 + len(entry)) + entry


@pytest.mark.parametrize(
    ("fmt", "field"),
    [
        ("JPEG", "jpg"),
        ("PNG", "png"),
        ("WEBP", "webp"),
        ("GIF", "gif"),
        ("BMP", "bmp"),
        ("TIFF", "tiff"),
        ("PPM", "ppm"),
        ("TGA", "tga"),
        ("AVIF", "jpg"),  # not an image extension of its own: the content decides
        ("JPEG2000", "jp2"),
        ("QOI", "png"),
        ("SGI", "sgi"),
        ("PCX", "pcx"),
    ],
)
def test_the_usual_formats_decode(fmt: str, field: str) -> None:
    decoded = make_decoder("rgb8")(sample(**{field: encode(fmt)}))[field]
    assert decoded.shape == (5, 7, 3)
    assert decoded[0, 0, 0] > 200  # red


@pytest.mark.parametrize("field", ["icns", "jpg", "png"])
def test_an_icns_is_refused_whatever_its_extension(field: str) -> None:
    with pytest.raises(DecodeError, match="the image is ICNS") as info:
        make_decoder("rgb")(sample(**{field: icns(encode("PNG", (256, 256), "RGBA"))}))
    assert (info.value.url, info.value.key, info.value.field) == (URL, "dir/k0001", field)
    assert "formats=" in str(info.value)  # says how to allow it


def test_an_ico_is_refused_too() -> None:
    with pytest.raises(DecodeError, match="the image is ICO"):
        make_decoder("rgb8")(sample(ico=encode("ICO", (16, 16))))


def test_formats_can_be_widened_per_handler() -> None:
    handler = imagehandler("rgb8", formats=(*IMAGE_FORMATS, "icns"))
    assert handler.formats is not None
    assert "ICNS" in handler.formats
    decoded = make_decoder(handler)(sample(icns=icns(encode("PNG", (256, 256), "RGBA"))))
    assert decoded["icns"].shape == (256, 256, 3)
    only_png = make_decoder(imagehandler("rgb8", formats=["PNG"]))
    with pytest.raises(DecodeError, match="the image is JPEG"):
        only_png(sample(jpg=encode("JPEG")))


def test_an_unknown_format_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown image formats"):
        imagehandler("rgb8", formats=["JPG"])


def big_png(side: int) -> bytes:
    """An RGBA PNG of ``side``^2 zero pixels, compressed row by row (never held whole)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    squeeze = zlib.compressobj(9)
    row = bytes(1 + 4 * side)
    body = b"".join(squeeze.compress(row) for _ in range(side)) + squeeze.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 6, 0, 0, 0)
    chunks = chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


@pytest.mark.skipif(sys.platform != "linux", reason="bounds memory with RLIMIT_AS")
def test_a_big_png_inside_an_icns_is_refused_before_decoding() -> None:
    """The finding: a ~660 KB .icns whose header says 256x256 holds a 13,000^2 PNG, which
    Pillow decoded (676 MB) before failing. Under 300 MiB more address space it is refused."""
    data = icns(big_png(13_000))
    assert len(data) < 1_000_000
    script = textwrap.dedent(
        """
        import resource, sys
        from cloudshards.decoders import make_decoder
        from cloudshards.errors import DecodeError
        import PIL.Image, numpy
        data = sys.stdin.buffer.read()
        PIL.Image.init()  # load Pillow's plugins before the cap, as a busy worker has
        with open("/proc/self/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize"))
        cap = kib * 1024 + (300 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        try:
            make_decoder("rgb")({"__key__": "k", "__url__": "u", "jpg": data})
        except DecodeError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script],
        input=data,
        capture_output=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,  # this checkout's cloudshards
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "the image is ICNS" in done.stdout.decode(), done.stdout.decode()


def test_rgba_decoding_is_unchanged_for_png() -> None:
    pixels = np.arange(4 * 3 * 4, dtype=np.uint8).reshape(4, 3, 4)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(out, format="PNG")
    decoded = make_decoder("rgba8")(sample(png=out.getvalue()))["png"]
    assert decoded.tobytes() == pixels.tobytes()
