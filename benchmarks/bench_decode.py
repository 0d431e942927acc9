"""Decode throughput: JPEG images/s, cloudshards vs webdataset 1.0.2, and video frames/s (PyAV).

    python benchmarks/bench_decode.py            # 4 shards x 250 JPEGs (256x256), 5 repeats
    python benchmarks/bench_decode.py --quick    # 2 shards x 100 JPEGs, 3 repeats

Images: the same shards (written with webdataset's own TarWriter) are read by both libraries
with the same code, ``WebDataset(urls, shardshuffle=False).decode(SPEC).to_tuple("jpg", "cls")``,
for each imagespec in ``--specs`` (default ``rgb``, webdataset's float HWC array, plus
``torchrgb8`` and ``pil``). Repeats alternate which library goes first; the table shows the
median images/s (wall clock, and per CPU-second of this process, which other jobs on a shared
machine disturb less) and the ratio cloudshards / webdataset. Both must decode the same pixels: the
script compares a checksum of every decoded image and exits with status 2 if they differ.

Video: clips (H.264 in MP4, ``--clip-frames`` frames of ``--clip-size``) written with
cloudshards' ShardWriter are decoded with ``.decode(torch_video)`` (PyAV); frames/s is the
median over repeats, next to PyAV's own decode loop on the same bytes (the backend's ceiling).
webdataset 1.0.2's ``torch_video`` calls ``torchvision.io.read_video``, which is not installed
here (and was removed in torchvision 0.28), so it has no video figure. torchcodec is tried and
reported when it cannot be imported.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
from _common import fmt_rate, format_table, median, use_checkout, versions, warm_page_cache

LIBS = ("webdataset", "cloudshards")


def make_jpeg(rng: np.random.Generator, size: int) -> bytes:
    """A photo-like image: smooth colour fields plus fine noise (~15-30 KB as JPEG q90)."""
    from PIL import Image

    coarse = rng.integers(0, 256, (size // 32 + 1, size // 32 + 1, 3), dtype=np.uint8)
    smooth = Image.fromarray(coarse).resize((size, size), Image.Resampling.BICUBIC)
    pixels = np.asarray(smooth).astype(np.int16) + rng.integers(-12, 13, (size, size, 3))
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_image_shards(directory: Path, shards: int, per_shard: int, size: int) -> str:
    import webdataset

    rng = np.random.default_rng(0)
    for shard in range(shards):
        with webdataset.TarWriter(str(directory / f"img-{shard:06d}.tar")) as sink:
            for index in range(per_shard):
                key = f"s{shard:04d}_{index:06d}"
                sink.write({"__key__": key, "jpg": make_jpeg(rng, size), "cls": index % 10})
    return str(directory / f"img-{{000000..{shards - 1:06d}}}.tar")


def make_clip(frames: int, width: int, height: int, seed: int) -> bytes:
    import av

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for t in range(frames):
            frame = np.roll(base, 4 * t, axis=1)  # a panning picture: real motion vectors
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def write_video_shard(directory: Path, clips: int, frames: int, width: int, height: int) -> str:
    from cloudshards import ShardWriter

    with ShardWriter(str(directory / "video-%06d.tar"), maxcount=clips) as sink:
        for index in range(clips):
            sink.write(
                {"__key__": f"clip{index:04d}", "mp4": make_clip(frames, width, height, index)}
            )
    return str(directory / "video-000000.tar")


# ----------------------------------------------------------------------------------- images


def decode_images(wds: ModuleType, urls: str, spec: str) -> tuple[int, float]:
    """Decode every image; return (count, checksum of the pixels)."""
    count = 0
    checksum = 0.0
    dataset = wds.WebDataset(urls, shardshuffle=False).decode(spec).to_tuple("jpg", "cls")
    for image, cls in dataset:
        count += 1
        if count % 50 == 1:  # a cheap but real check that both libraries decode alike
            array = np.asarray(image, dtype=np.float64)
            checksum += float(array.sum()) + int(cls)
    return count, checksum


def bench_images(
    libs: dict[str, ModuleType], urls: str, specs: list[str], repeats: int
) -> tuple[list[list[str]], bool]:
    rows = []
    same = True
    for spec in specs:
        rates: dict[str, list[float]] = {name: [] for name in libs}
        cpu_rates: dict[str, list[float]] = {name: [] for name in libs}
        results: dict[str, tuple[int, float]] = {}
        for repeat in range(repeats):
            order = list(libs) if repeat % 2 == 0 else list(reversed(libs))
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                count, checksum = decode_images(libs[name], urls, spec)
                elapsed = time.perf_counter() - start
                cpu = time.process_time() - start_cpu
                rates[name].append(count / elapsed)
                cpu_rates[name].append(count / cpu)
                results.setdefault(name, (count, checksum))
                print(f"  {spec:<10} {name:<12} {count} images in {elapsed:.2f} s "
                      f"({cpu:.2f} s CPU): {count / elapsed:,.0f} images/s")  # fmt: skip
        if len(set(results.values())) > 1:
            print(f"MISMATCH for {spec!r}: {results}")
            same = False
        for label, table in (("", rates), (" per CPU-s", cpu_rates)):
            medians = {name: median(values) for name, values in table.items()}
            row = [f'decode("{spec}"){label}', *(fmt_rate(medians[name]) for name in libs)]
            if len(libs) == 2:
                row.append(f"{medians['cloudshards'] / medians['webdataset']:.2f}x")
            rows.append(row)
    return rows, same


# ------------------------------------------------------------------------------------ video


def pyav_frames(data: bytes) -> int:
    """PyAV's own decode loop to RGB arrays: the ceiling for any PyAV-based decoder."""
    import av

    frames = 0
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            frame.to_ndarray(format="rgb24")
            frames += 1
    return frames


def bench_video(url: str, repeats: int) -> list[list[str]]:
    import cloudshards

    raw = [s["mp4"] for s in cloudshards.WebDataset(url, shardshuffle=False)]

    def ours() -> int:
        dataset = cloudshards.WebDataset(url, shardshuffle=False).decode(cloudshards.torch_video)
        return sum(int(sample["mp4"][0].shape[0]) for sample in dataset)

    def ceiling() -> int:
        return sum(pyav_frames(data) for data in raw)

    runs: list[tuple[str, Callable[[], int]]] = [
        ("cloudshards .decode(torch_video) (PyAV)", ours),
        ("PyAV decode loop alone, same bytes", ceiling),
    ]
    rows = []
    for label, run in runs:
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            frames = run()
            rates.append(frames / (time.perf_counter() - start))
        print(f"  {label}: {frames} frames, median {median(rates):,.0f} frames/s")
        rows.append([label, fmt_rate(median(rates))])
    rows.append(["webdataset torch_video (torchvision.io.read_video)", _webdataset_video(raw[0])])
    rows.append(["torchcodec VideoDecoder", _torchcodec_status()])
    return rows


def _webdataset_video(data: bytes) -> str:
    import webdataset

    try:
        webdataset.torch_video(".mp4", data)
    except Exception as exc:
        return f"n/a ({type(exc).__name__}: {str(exc)[:60]})"
    return "runs (not timed)"


def _torchcodec_status() -> str:
    try:
        import torchcodec  # noqa: F401
    except Exception as exc:
        return f"n/a (import failed: {type(exc).__name__}: {str(exc)[:60]})"
    return "importable (not timed)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--specs", default="rgb,torchrgb8,pil", help="imagespecs to compare")
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--clip-frames", type=int, default=48)
    parser.add_argument("--clip-size", default="320x240")
    parser.add_argument("--no-video", action="store_true")
    args = parser.parse_args()
    use_checkout()
    warnings.simplefilter("ignore")  # webdataset's own deprecation chatter
    import webdataset

    import cloudshards

    shards, per_shard, clips = (2, 100, 4) if args.quick else (4, 250, 12)
    repeats = args.repeats or (3 if args.quick else 5)
    libs = {"webdataset": webdataset, "cloudshards": cloudshards}
    print("\n".join(versions({
        "webdataset": f"{webdataset.__version__} {Path(webdataset.__file__).parent}",
        "cloudshards": f"{cloudshards.__version__} {Path(cloudshards.__file__).parent}",
    })))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        directory = Path(tmp)
        urls = write_image_shards(directory, shards, per_shard, args.size)
        size_mb = sum(p.stat().st_size for p in directory.glob("img-*.tar")) / 1e6
        print(f"images: {shards} shards x {per_shard} JPEGs {args.size}x{args.size}, "
              f"{size_mb:.1f} MB; {repeats} repeats")  # fmt: skip
        warm_page_cache(directory.glob("img-*.tar"))
        rows, same = bench_images(libs, urls, args.specs.split(","), repeats)
        print()
        print(format_table(["images/s (median)", *libs, "cloudshards/webdataset"], rows))
        if not args.no_video:
            width, height = (int(v) for v in args.clip_size.split("x"))
            url = write_video_shard(directory, clips, args.clip_frames, width, height)
            print(f"\nvideo: {clips} H.264 clips x {args.clip_frames} frames {args.clip_size}")
            print(format_table(["video frames/s (median)", "value"], bench_video(url, repeats)))
    return 0 if same else 2


if __name__ == "__main__":
    sys.exit(main())
