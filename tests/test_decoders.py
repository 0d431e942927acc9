"""Tests for cloudshards.decoders: webdataset 1.0.2 parity, safe defaults, errors, media."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import pickle
import sys
import wave
from collections.abc import Callable
from typing import Any

import av  # a declared test dependency: missing, these tests must fail, not skip
import numpy as np
import pytest
import torch
import webdataset.autodecode as wds_autodecode
from PIL import Image, UnidentifiedImageError

from cloudshards import decoders
from cloudshards.decoders import (
    IMAGE_EXTENSIONS,
    IMAGE_SPECS,
    UNSAFE,
    Continue,
    Decoder,
    DecodingError,
    ImageHandler,
    allow_unsafe_decoders,
    basichandlers,
    default_decoder,
    gzfilter,
    handle_extension,
    imagehandler,
    make_decoder,
    register_decoder,
    torch_audio,
    torch_loads,
    torch_video,
)
from cloudshards.errors import ConfigError, DecodeError

URL = "s3://bucket/train-000.tar"


class Opaque:
    """Any class instance: weights_only torch.load must refuse it."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.fixture(autouse=True)
def safe_mode(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("CLOUDSHARDS_ALLOW_PICKLE", raising=False)
    allow_unsafe_decoders(False)
    yield
    allow_unsafe_decoders(False)


def sample(**fields: Any) -> dict[str, Any]:
    return {"__key__": "dir/k0001", "__url__": URL, **fields}


def encode(img: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **options)
    return out.getvalue()


def make_images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (13, 17, 3), dtype=np.uint8), "RGB")
    gray = Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16), "L")  # every value
    rgba = Image.fromarray(rng.integers(0, 256, (11, 9, 4), dtype=np.uint8), "RGBA")
    palette = rgb.quantize(colors=16)
    assert palette.mode == "P"
    return {
        "rgb.jpg": encode(rgb, "JPEG", quality=90),
        "rgb.png": encode(rgb, "PNG"),
        "rgb.ppm": encode(rgb, "PPM"),
        "rgb.webp": encode(rgb, "WEBP"),
        "gray.jpg": encode(gray, "JPEG"),
        "gray.png": encode(gray, "PNG"),
        "rgba.png": encode(rgba, "PNG"),
        "rgba.webp": encode(rgba, "WEBP", lossless=True),
        "palette.png": encode(palette, "PNG"),
    }


IMAGES = make_images()


def assert_same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    if isinstance(theirs, Image.Image):
        assert (ours.mode, ours.size) == (theirs.mode, theirs.size)
        assert ours.tobytes() == theirs.tobytes()
    elif isinstance(theirs, np.ndarray):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
        assert ours.flags.writeable == theirs.flags.writeable
        assert ours.flags.c_contiguous == theirs.flags.c_contiguous
        assert ours.tobytes() == theirs.tobytes()  # bit for bit, floats included
    elif isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
        assert ours.is_contiguous() == theirs.is_contiguous()
        assert torch.equal(ours, theirs)
        assert ours.numpy().tobytes() == theirs.numpy().tobytes()
    else:
        assert ours == theirs


def test_image_tables_match_webdataset() -> None:
    assert IMAGE_EXTENSIONS == wds_autodecode.IMAGE_EXTENSIONS
    assert dict(IMAGE_SPECS) == wds_autodecode.imagespecs


@pytest.mark.parametrize("spec", list(wds_autodecode.imagespecs))
@pytest.mark.parametrize("name", list(IMAGES))
def test_images_decode_exactly_like_webdataset(name: str, spec: str) -> None:
    field = name.split(".", 1)[1]
    raw = sample(**{field: IMAGES[name]})
    theirs = wds_autodecode.Decoder([wds_autodecode.imagehandler(spec)])(dict(raw))
    ours = make_decoder(spec)(dict(raw))
    assert_same(ours[field], theirs[field])
    if spec.startswith("torch") and ours[field].ndim == 3:
        assert ours[field].shape[0] in (3, 4)  # CHW


def test_float_conversion_is_bit_exact_for_every_uint8() -> None:
    values = np.arange(256, dtype=np.uint8)
    expected = values.astype(np.float32) / 255.0
    decoded = make_decoder("l")(sample(png=IMAGES["gray.png"]))["png"]
    assert decoded.ravel().tobytes() == expected.tobytes()


def test_image_handler_extensions() -> None:
    handler = imagehandler("rgb8", ["PNG"])
    assert handler(".txt", b"x") is None
    assert handler(".jpg", IMAGES["rgb.jpg"]) is None
    assert handler(".seg.PNG", IMAGES["rgb.png"]).shape == (13, 17, 3)
    assert ImageHandler("pil")(".JPG", IMAGES["rgb.jpg"]).mode == "RGB"
    assert repr(handler) == "ImageHandler('rgb8')"


def test_unknown_imagespec_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match="torchrgb8") as info:
        make_decoder("rgb16")
    assert isinstance(info.value, ValueError)
    assert "'rgb16'" in str(info.value)


def test_basic_fields_round_trip_like_webdataset() -> None:
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    npz = io.BytesIO()
    np.savez(npz, a=array, b=np.ones(2))
    npy = io.BytesIO()
    np.save(npy, array)
    raw = sample(
        json=json.dumps({"a": [1, 2], "b": "é"}).encode(),
        txt="héllo\n".encode(),
        cls=b" 7\n",
        id=b"42",
        npy=npy.getvalue(),
        npz=npz.getvalue(),
        bin=b"\x00\x01",
    )
    ours, theirs = Decoder([])(dict(raw)), wds_autodecode.Decoder([])(dict(raw))
    assert ours.keys() == theirs.keys()
    for k in ("__key__", "__url__", "json", "txt", "cls", "id", "bin"):
        assert ours[k] == theirs[k]
    assert ours["json"] == {"a": [1, 2], "b": "é"}
    assert ours["cls"] == 7
    assert_same(ours["npy"], theirs["npy"])
    assert ours["npz"].keys() == {"a", "b"}
    assert np.array_equal(ours["npz"]["a"], array)
    assert ours["bin"] == b"\x00\x01"
    assert default_decoder(dict(raw))["cls"] == 7


def test_npy_object_arrays_are_refused() -> None:
    out = io.BytesIO()
    np.save(out, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DecodeError, match="allow_pickle"):
        Decoder([])(sample(npy=out.getvalue()))


def test_pth_loads_tensors_with_weights_only() -> None:
    out = io.BytesIO()
    tensors: dict[str, Any] = {"w": torch.arange(6.0).reshape(2, 3), "step": 3}
    torch.save(tensors, out)
    decoded = Decoder([])(sample(pth=out.getvalue()))["pth"]
    assert torch.equal(decoded["w"], tensors["w"])
    assert decoded["step"] == 3


def test_pth_refuses_arbitrary_objects_unless_unsafe() -> None:
    out = io.BytesIO()
    torch.save({"obj": Opaque(5)}, out)
    with pytest.raises(DecodeError, match="weights_only=True") as info:
        Decoder([])(sample(pth=out.getvalue()))
    assert "allow_unsafe_decoders" in str(info.value)
    assert "Opaque" in str(info.value)
    allow_unsafe_decoders()
    assert torch_loads(out.getvalue())["obj"].value == 5


def test_pickle_is_refused_by_default() -> None:
    assert {"pkl", "pickle", "pyd"} == UNSAFE
    for ext in sorted(UNSAFE):
        with pytest.raises(DecodeError) as info:
            Decoder([])(sample(**{ext: pickle.dumps({"x": 1})}))
        message = str(info.value)
        assert "allow_unsafe_decoders()" in message
        assert "CLOUDSHARDS_ALLOW_PICKLE=1" in message
        assert info.value.field == ext


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\nshowpage\n"


@pytest.fixture
def fake_ghostscript(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pillow's Ghostscript, replaced by a script that leaves a mark when it runs."""
    from PIL import EpsImagePlugin

    mark = tmp_path / "gs-ran"
    gs = tmp_path / "gs"
    gs.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", str(gs))
    return mark


@pytest.mark.parametrize("field", ["jpg", "png", "eps"])
def test_a_postscript_image_never_runs_ghostscript_by_default(
    fake_ghostscript: Any, field: str
) -> None:
    # Pillow picks the format from the content: a .jpg field holding EPS would be rendered
    # by running Ghostscript on the shard's PostScript.
    with pytest.raises(DecodeError, match="Ghostscript") as info:
        make_decoder("pil")(sample(**{field: EPS}))
    assert "allow_unsafe_decoders()" in str(info.value)
    assert not fake_ghostscript.exists()


def test_a_postscript_image_goes_to_ghostscript_once_allowed(fake_ghostscript: Any) -> None:
    allow_unsafe_decoders()
    with pytest.raises(DecodeError):  # the fake Ghostscript fails
        make_decoder("pil")(sample(jpg=EPS))
    assert fake_ghostscript.exists()


def test_pickle_after_allow_unsafe_decoders() -> None:
    allow_unsafe_decoders()
    assert Decoder([])(sample(pyd=pickle.dumps({"x": 1})))["pyd"] == {"x": 1}
    allow_unsafe_decoders(False)
    with pytest.raises(DecodeError):
        Decoder([])(sample(pyd=pickle.dumps({"x": 1})))


def test_pickle_with_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PICKLE", "1")
    assert Decoder([])(sample(pkl=pickle.dumps([1, 2])))["pkl"] == [1, 2]
    monkeypatch.setenv("CLOUDSHARDS_ALLOW_PICKLE", "0")
    with pytest.raises(DecodeError):
        Decoder([])(sample(pkl=pickle.dumps([1, 2])))


def test_tenbin_fields_decode_by_default_and_bad_ones_are_decode_errors() -> None:
    from cloudshards.tensorbin import encode_buffer

    data = bytes(encode_buffer([np.arange(3, dtype="int32")]))
    assert Decoder([])(sample(ten=data))["ten"][0].tolist() == [0, 1, 2]
    with pytest.raises(DecodeError, match="tenbin"):
        Decoder([])(sample(ten=b"\x00" * 8))


def test_msgpack_needs_its_package() -> None:
    if importlib.util.find_spec("msgpack") is None:
        with pytest.raises(ImportError, match="pip install msgpack"):
            Decoder([])(sample(msg=b"\x81\xa1a\x01"))
    else:
        assert Decoder([])(sample(msg=b"\x81\xa1a\x01"))["msg"] == {"a": 1}


def test_only_limits_decoded_fields() -> None:
    raw = sample(json=b"[1]", cls=b"3", jpg=IMAGES["rgb.jpg"])
    for only in ("json cls", ["json", "cls"]):
        decoded = make_decoder("rgb", only=only)(dict(raw))
        assert decoded["json"] == [1]
        assert decoded["cls"] == 3
        assert decoded["jpg"] == IMAGES["rgb.jpg"]


def test_partial_passes_decoded_fields_through() -> None:
    raw = sample(cls=3, json=b"{}")
    assert Decoder([], partial=True)(dict(raw)) == {**sample(), "cls": 3, "json": {}}
    with pytest.raises(DecodeError, match="partial=True"):
        Decoder([])(dict(raw))
    with pytest.raises(DecodeError, match="NoneType"):
        Decoder([], partial=True)(sample(cls=None))


def test_gzfilter_continues_decoding() -> None:
    raw = sample(
        **{"json.gz": gzip.compress(b'{"a": 1}'), "jpg.gz": gzip.compress(IMAGES["rgb.jpg"])}
    )
    ours = make_decoder("rgb8")(dict(raw))
    theirs = wds_autodecode.Decoder([wds_autodecode.imagehandler("rgb8")])(dict(raw))
    assert ours["json.gz"] == {"a": 1}
    assert_same(ours["jpg.gz"], theirs["jpg.gz"])
    continued = gzfilter(".txt.gz", gzip.compress(b"hi"))
    assert isinstance(continued, Continue)
    assert (continued.key, continued.data) == (".txt", b"hi")
    assert gzfilter(".txt", b"hi") is None


def test_handle_extension_matches_trailing_components() -> None:
    seg = handle_extension("seg.png", lambda data: "seg")
    anyjpg = handle_extension("jpg JPEG", lambda data: "jpg")
    decoder = Decoder([seg, anyjpg])
    decoded = decoder(sample(**{"seg.png": b"x", "png": b"y", "JPG": b"z", "a.jpeg": b"w"}))
    assert decoded["seg.png"] == "seg"
    assert decoded["png"] == b"y"
    assert decoded["JPG"] == "jpg"
    assert decoded["a.jpeg"] == "jpg"


def test_continue_redispatches_to_later_handlers() -> None:
    def unreverse(key: str, data: bytes) -> Continue | None:
        return Continue(key[: -len(".rev")], data[::-1]) if key.endswith(".rev") else None

    seen: list[str] = []

    def spy(key: str, data: bytes) -> None:
        seen.append(key)

    decoded = Decoder([unreverse, spy])(sample(**{"cls.rev": b"21"}))
    assert decoded["cls.rev"] == 12
    assert seen == [".cls"]


def test_meta_keys_pass_through() -> None:
    raw = {"__key__": b"k1", "__url__": URL, "__local__": b"\xff\xfe", "__n__": 3, "txt": b"t"}
    ours, theirs = Decoder([])(dict(raw)), wds_autodecode.Decoder([])(dict(raw))
    assert (
        ours
        == theirs
        == {"__key__": "k1", "__url__": URL, "__local__": b"\xff\xfe", "__n__": 3, "txt": "t"}
    )


def test_register_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoders, "_registry", dict(decoders._registry))
    register_decoder("csv", lambda data: data.decode().split(","))
    assert Decoder([])(sample(csv=b"a,b"))["csv"] == ["a", "b"]
    assert basichandlers(".x.csv", b"c") == ["c"]
    with pytest.raises(ConfigError, match="overwrite=True"):
        register_decoder("csv", len)
    with pytest.raises(ConfigError, match="overwrite=True"):
        register_decoder("json", len)
    register_decoder("json", len, overwrite=True)
    assert Decoder([])(sample(json=b"{}"))["json"] == 2
    for bad in ("", ".csv", "a b", "x.y"):
        with pytest.raises(ConfigError):
            register_decoder(bad, len)
    with pytest.raises(ConfigError, match="callable"):
        register_decoder("zzz", "not callable")  # type: ignore[arg-type]


def test_errors_name_url_key_field_and_reason() -> None:
    with pytest.raises(DecodeError) as info:
        make_decoder("rgb")(sample(jpg=b"not an image", cls=b"1"))
    error = info.value
    assert isinstance(error, ValueError)
    assert isinstance(error, DecodingError)
    assert DecodingError is DecodeError
    assert (error.key, error.field, error.k, error.url) == ("dir/k0001", "jpg", "jpg", URL)
    message = str(error)
    assert "cannot decode field 'jpg': cannot identify image file" in message
    assert URL in message
    assert "dir/k0001.jpg" in message
    assert isinstance(error.__cause__, UnidentifiedImageError)
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.field) == (DecodeError, message, "jpg")


def test_error_redacts_signed_urls() -> None:
    signed = "https://user:pw@host/shard.tar?X-Amz-Signature=secret"
    with pytest.raises(DecodeError) as info:
        Decoder([])({"__key__": "k", "__url__": signed, "json": b"{"})
    assert "secret" not in str(info.value)
    assert "pw" not in str(info.value)
    assert "cannot decode field 'json': Expecting" in str(info.value)


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="not callable"):
        Decoder([42])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="make_decoder"):
        Decoder("rgb")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dict"):
        Decoder([])([1, 2])  # type: ignore[arg-type]


def test_decoder_pickles_for_dataloader_workers() -> None:
    decoder = make_decoder("torchrgb", handle_extension("cls", int), only="jpg cls")
    clone = pickle.loads(pickle.dumps(decoder))
    raw = sample(jpg=IMAGES["rgb.png"], cls=b"4")
    assert_same(clone(dict(raw))["jpg"], decoder(dict(raw))["jpg"])


def write_wav(samples: np.ndarray[Any, Any], width: int, rate: int) -> bytes:
    """Write frames x channels integer samples as a PCM WAV of the given sample width."""
    if width == 1:
        raw = (samples + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in samples.ravel())
    else:
        raw = samples.astype(f"<i{width}").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(samples.shape[1])
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(raw)
    return out.getvalue()


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_torch_audio_reads_pcm_wav(width: int) -> None:
    rng = np.random.default_rng(width)
    scale = 1 << (8 * width - 1)
    samples = rng.integers(-scale, scale, (300, 2), dtype=np.int64)
    decoded = Decoder([torch_audio])(sample(wav=write_wav(samples, width, 16000)))["wav"]
    waveform, rate = decoded
    assert rate == 16000
    assert waveform.dtype == torch.float32
    assert waveform.shape == (2, 300)
    expected = samples.T.astype(np.float32) / np.float32(scale)
    assert np.array_equal(waveform.numpy(), expected)
    assert torch_audio(".txt", b"") is None


def test_torch_audio_reads_a_wav_written_to_a_pipe() -> None:
    # A WAV streamed to a pipe (ffmpeg ... -f wav pipe:1) cannot know its size and declares
    # 0xFFFFFFFF bytes in its RIFF and data chunks: its samples are the bytes that follow.
    samples = np.arange(-600, 600, dtype=np.int64).reshape(600, 2)
    data = bytearray(write_wav(samples, 2, 16000))
    data[4:8] = b"\xff\xff\xff\xff"
    at = data.index(b"data") + 4
    data[at : at + 4] = b"\xff\xff\xff\xff"
    waveform, rate = Decoder([torch_audio])(sample(wav=bytes(data)))["wav"]
    assert rate == 16000
    assert np.array_equal(waveform.numpy(), samples.T.astype(np.float32) / np.float32(1 << 15))


def test_video_without_pyav_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` fail
    with pytest.raises(ImportError, match=r'pip install "cloudshards\[video\]"'):
        torch_video(".mp4", b"")
    with pytest.raises(ImportError, match=r'pip install "cloudshards\[video\]"'):
        Decoder([torch_audio])(sample(flac=b""))
    assert torch_video(".txt", b"") is None
    with pytest.raises(DecodeError, match="RIFF"):
        Decoder([torch_audio])(sample(wav=b"not a wav file"))


def encode_av(av: Any, fmt: str, add: Callable[[Any], None]) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        add(container)
    return out.getvalue()


def test_torch_audio_flac_with_pyav() -> None:
    tone = (np.sin(np.arange(2000) / 7) * 20000).astype(np.int16)
    stereo = np.stack([tone, -tone])

    def add(container: Any) -> None:
        stream = container.add_stream("flac", rate=8000, layout="stereo")
        frame = av.AudioFrame.from_ndarray(stereo.T.reshape(1, -1).copy(), "s16", "stereo")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)

    decoded = torch_audio(".flac", encode_av(av, "flac", add))
    assert decoded is not None
    waveform, rate = decoded
    assert rate == 8000
    assert waveform.dtype == torch.float32
    assert np.array_equal(waveform.numpy(), stereo.astype(np.float32) / 32768)


def test_torch_video_with_pyav() -> None:
    colors = [(i * 50, 100, 200 - i * 40) for i in range(5)]

    def add(container: Any) -> None:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for color in colors:
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), color, np.uint8), "rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)

    decoded = Decoder([torch_video])(sample(mp4=encode_av(av, "mp4", add)))["mp4"]
    video, audio, info = decoded
    assert video.dtype == torch.uint8
    assert video.shape == (5, 32, 32, 3)
    assert audio.shape == (1, 0)
    assert info == {"video_fps": 5.0}
    means = video.float().mean(dim=(1, 2))
    assert torch.allclose(means, torch.tensor(colors, dtype=torch.float32), atol=4)


def test_torch_audio_float_wav_falls_back_to_pyav() -> None:
    tone = (np.sin(np.arange(1000) / 5) * 0.5).astype(np.float32)

    def add(container: Any) -> None:
        stream = container.add_stream("pcm_f32le", rate=8000, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone.reshape(1, -1), "flt", "mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)

    data = encode_av(av, "wav", add)
    # The stdlib reads integer PCM only.
    with pytest.raises(wave.Error, match="unknown format"), wave.open(io.BytesIO(data), "rb"):
        pass
    decoded = torch_audio(".wav", data)
    assert decoded is not None
    waveform, rate = decoded
    assert rate == 8000
    assert waveform.shape == (1, 1000)
    assert np.array_equal(waveform.numpy()[0], tone)
