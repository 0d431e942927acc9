"""16-frame clips from 10 s and 60 s videos: clip decoding vs whole-video decoding, torchcodec
vs PyAV, clips/s and peak RSS, side by side in one run.

    python benchmarks/bench_video.py              # 320x240, 4 shards x (4 of 10 s, 2 of 60 s)
    python benchmarks/bench_video.py --quick      # 160x120, 2 shards x (2 of 10 s, 1 of 60 s)
    python benchmarks/bench_video.py --workers 2  # in DataLoader(num_workers=2, batch_size=None)

Methods, each reading the same shards through the real pipeline,
``WebDataset(urls, shardshuffle=False).decode(...)...to_tuple("mp4", "cls")``:

  1. clip, torchcodec   ``.decode(video=VideoClip(16, backend="torchcodec"))``
  2. clip, PyAV         ``.decode(video=VideoClip(16, backend="pyav"))``
  3. whole, PyAV        ``.decode(torch_video)`` (every frame, THWC), then a ``.map`` keeping
                        16 frames (what users do today)
  4. whole, torchcodec  ``.decode(h)`` with ``h`` returning
                        ``torchcodec.decoders.VideoDecoder(data).get_all_frames().data``, then
                        the same ``.map``

The clips start where ``VideoClip`` draws them (``start="random"``, seeded per sample); the
whole-video rows keep the 16 middle frames (a copy, so the decoded video is freed at once).

Videos: H.264 (libx264, preset veryfast, so with B-frames), yuv420p, 30 fps, a key frame every
60 frames (2 s), a panning, bobbing textured picture with a moving square, so every frame
differs; written with ``cloudshards.TarWriter`` (fields ``mp4`` and ``cls``) to a temporary
directory and read once before timing. Before any timing, the first video is decoded by all four
methods from its first frame: the frames must agree (within 3 of 255), or the script exits with
status 2.

Every (video length, method) runs in a fresh interpreter (this script with ``--child``) that
imports torch, cloudshards and the backend, reads its peak RSS (the start), decodes one sample
untimed (lazy imports, FFmpeg set-up), then makes ``--repeats`` timed passes over the data set
(building the pipeline, starting any workers, reading every sample). clips/s is the median
over the passes, and so is CPU ms/clip (user + system time of the child, all its threads and
its workers, per clip: steadier than wall time on a busy machine, and it shows time spent
waiting for threads as the gap to ms/clip). Peak RSS is the child's peak at the end, and the
delta that minus the start, i.e. what decoding added on top of the imports; with
``--workers N`` the peak is the largest of the main process and its (forked) workers
(``RUSAGE_CHILDREN``). On Linux the child's own peak is ``VmHWM`` from ``/proc/self/status``,
not ``getrusage(RUSAGE_SELF).ru_maxrss``: the kernel carries ``ru_maxrss`` across ``exec``, so
a child started by this (larger) process would report this process's peak; elsewhere it is
``ru_maxrss``. Each pass must deliver every sample once, with 16 uint8 frames of the right size
and the right labels, or the script exits with status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import fmt_rate, median, use_checkout, versions, warm_page_cache

FPS = 30
GOP = 60  # frames between key frames: 2 s at 30 fps
CLIP_FRAMES = 16
#: Largest difference (of 255) allowed between the methods' frames of the same video.
TOLERANCE = 3


@dataclass(frozen=True)
class Method:
    name: str  # the child's argument
    label: str  # the table's row
    backend: str  # "torchcodec" or "pyav"
    clip: bool  # VideoClip (True) or the whole video, then 16 frames (False)


METHODS = (
    Method("clip-torchcodec", "clip: VideoClip(16, backend=torchcodec)", "torchcodec", True),
    Method("clip-pyav", "clip: VideoClip(16, backend=pyav)", "pyav", True),
    Method("whole-pyav", "whole: torch_video (PyAV) + 16 frames", "pyav", False),
    Method("whole-torchcodec", "whole: torchcodec get_all_frames + 16", "torchcodec", False),
)
BY_NAME = {m.name: m for m in METHODS}


# ---------------------------------------------------------------------------------- the data


def make_video(seconds: int, width: int, height: int, seed: int) -> bytes:
    """An H.264 MP4 of ``seconds`` at 30 fps in which every frame differs: a textured picture
    twice the frame's size, panned sideways and bobbed up and down, plus a moving square."""
    import av
    from PIL import Image

    rng = np.random.default_rng(seed)
    big_w, big_h = 2 * width, 2 * height
    coarse = rng.integers(0, 256, (big_h // 16 + 1, big_w // 16 + 1, 3), dtype=np.uint8)
    smooth = Image.fromarray(coarse).resize((big_w, big_h), Image.Resampling.BICUBIC)
    texture = np.asarray(smooth).astype(np.int16) + rng.integers(-20, 21, (big_h, big_w, 3))
    picture = texture.clip(0, 255).astype(np.uint8)
    side = max(height // 8, 4)
    out = io.BytesIO()
    options = {"g": str(GOP), "keyint_min": str(GOP), "sc_threshold": "0", "preset": "veryfast"}
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = GOP
        for t in range(seconds * FPS):
            x = (3 * t) % (big_w - width)
            y = int((big_h - height) / 2 * (1 + np.sin(t / 40))) % (big_h - height)
            frame = picture[y : y + height, x : x + width].copy()
            left = (5 * t) % (width - side)
            frame[height // 3 : height // 3 + side, left : left + side] = (7 * t) % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


@dataclass(frozen=True)
class DataSet:
    seconds: int
    shards: int
    per_shard: int
    width: int
    height: int
    urls: str
    cls_sum: int
    first_video: bytes = field(repr=False)
    mbytes: float

    @property
    def videos(self) -> int:
        return self.shards * self.per_shard


def write_data_set(
    directory: Path, seconds: int, shards: int, per_shard: int, width: int, height: int
) -> DataSet:
    import cloudshards

    first = b""
    cls_sum = 0
    for shard in range(shards):
        with cloudshards.TarWriter(str(directory / f"video{seconds}s-{shard:06d}.tar")) as sink:
            for index in range(per_shard):
                data = make_video(seconds, width, height, seed=seconds * 1000 + shard * 100 + index)
                first = first or data
                cls = (shard * per_shard + index) % 10
                cls_sum += cls
                sink.write({"__key__": f"v{shard:04d}_{index:04d}", "mp4": data, "cls": cls})
    files = sorted(directory.glob(f"video{seconds}s-*.tar"))
    mbytes = warm_page_cache(files) / 2**20
    urls = str(directory / f"video{seconds}s-{{000000..{shards - 1:06d}}}.tar")
    return DataSet(seconds, shards, per_shard, width, height, urls, cls_sum, first, mbytes)


# ------------------------------------------------------------------------- the methods' code


def torchcodec_all_frames(key: str, data: bytes) -> Any:
    """A decode handler: every frame with torchcodec's defaults (uint8 NCHW)."""
    if key.rpartition(".")[2].lower() != "mp4":
        return None
    from torchcodec.decoders import VideoDecoder

    return VideoDecoder(data).get_all_frames().data


def middle_frames(sample: dict[str, Any]) -> dict[str, Any]:
    """Keep the 16 middle frames of a whole decoded video (a copy: the video is freed)."""
    value = sample["mp4"]
    video = value[0] if isinstance(value, tuple) else value  # torch_video: (video, audio, info)
    first = max((video.shape[0] - CLIP_FRAMES) // 2, 0)
    sample["mp4"] = video[first : first + CLIP_FRAMES].clone()
    return sample


def build_dataset(method: Method, urls: str) -> Any:
    import cloudshards

    dataset = cloudshards.WebDataset(urls, shardshuffle=False)
    if method.clip:
        clip = cloudshards.VideoClip(CLIP_FRAMES, backend=method.backend)
        return dataset.decode(video=clip).to_tuple("mp4", "cls")
    handler = cloudshards.torch_video if method.backend == "pyav" else torchcodec_all_frames
    return dataset.decode(handler).map(middle_frames).to_tuple("mp4", "cls")


def clip_frames(method: Method, value: Any) -> Any:
    return value["frames"] if method.clip else value


def first_frames(method: Method, data: bytes) -> Any:
    """The video's first 16 frames by ``method``, as uint8 [16, 3, H, W]."""
    import cloudshards

    if method.clip:
        clip = cloudshards.VideoClip(CLIP_FRAMES, start="first", backend=method.backend)
        return clip(".mp4", data)["frames"]
    if method.backend == "pyav":
        return cloudshards.torch_video(".mp4", data)[0][:CLIP_FRAMES].permute(0, 3, 1, 2)
    return torchcodec_all_frames(".mp4", data)[:CLIP_FRAMES]


# ---------------------------------------------------------------------------- the child side


def max_rss_mib(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident memory in MiB: this process's (``VmHWM`` where Linux has it, as
    ``ru_maxrss`` inherits the peak of the process that started this one) or its children's."""
    if who == resource.RUSAGE_SELF:
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024  # kB
        except OSError:
            pass
    value = resource.getrusage(who).ru_maxrss
    return value / 2**20 if sys.platform == "darwin" else value / 1024  # bytes on macOS


def cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads, and its ended children (the
    DataLoader's workers, which stop at the end of each pass)."""
    t = os.times()  # its clock ticks are coarse (10 ms): process_time() for this process
    return time.process_time() + t.children_user + t.children_system


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Time ``spec["repeats"]`` passes of one method over one data set; measure peak RSS."""
    method = BY_NAME[spec["method"]]
    import torch

    import cloudshards  # noqa: F401

    if method.backend == "torchcodec":
        import torchcodec.decoders  # noqa: F401
    else:
        import av  # noqa: F401
    start_rss = max_rss_mib()
    workers = spec["workers"]
    pixels = 3 * spec["height"] * spec["width"]

    def loader() -> Any:
        dataset = build_dataset(method, spec["urls"])
        if workers == 0:
            return dataset
        return torch.utils.data.DataLoader(dataset, num_workers=workers, batch_size=None)

    next(iter(build_dataset(method, spec["urls"])))  # untimed: lazy imports, FFmpeg set-up
    rates: list[float] = []
    cpu_ms: list[float] = []
    problem = None
    for _ in range(spec["repeats"]):
        clips = cls_sum = bad = 0
        begin, begin_cpu = time.perf_counter(), cpu_seconds()
        for value, cls in loader():
            frames = clip_frames(method, value)
            clips += 1
            cls_sum += int(cls)
            shape_ok = frames.shape[0] == CLIP_FRAMES and frames.numel() == CLIP_FRAMES * pixels
            if not shape_ok or frames.dtype != torch.uint8:
                bad += 1
        seconds = time.perf_counter() - begin
        rates.append(clips / seconds)
        cpu_ms.append(1000 * (cpu_seconds() - begin_cpu) / max(clips, 1))
        if (clips, cls_sum, bad) != (spec["videos"], spec["cls_sum"], 0):
            problem = problem or (
                f"{clips} clips (expected {spec['videos']}), label sum {cls_sum} "
                f"(expected {spec['cls_sum']}), {bad} clips of the wrong shape or type"
            )
    return {
        "rates": rates,
        "cpu_ms": cpu_ms,
        "start_rss": start_rss,
        "peak_rss": max_rss_mib(),
        "workers_rss": max_rss_mib(resource.RUSAGE_CHILDREN) if workers else 0.0,
        "problem": problem,
    }


# --------------------------------------------------------------------------- the parent side


@dataclass
class Result:
    rate: float = float("nan")
    cpu_ms: float = float("nan")
    peak: float = float("nan")
    delta: float = float("nan")
    error: str | None = None


def run_child(method: Method, data: DataSet, args: argparse.Namespace) -> Result:
    spec = {
        "method": method.name,
        "urls": data.urls,
        "videos": data.videos,
        "cls_sum": data.cls_sum,
        "width": data.width,
        "height": data.height,
        "repeats": args.repeats,
        "workers": args.workers,
    }
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {data.seconds:>3} s  {method.label:<40} FAILED (status {done.returncode})")
        print("    " + "\n    ".join(done.stderr.strip().splitlines()[-8:]))
        return Result(error=tail)
    got = json.loads(lines[-1][len("RESULT ") :])
    peak = max(got["peak_rss"], got["workers_rss"])
    start = got["start_rss"]
    result = Result(median(got["rates"]), median(got["cpu_ms"]), peak, peak - start, got["problem"])
    rates = ", ".join(f"{rate:,.1f}" for rate in got["rates"])
    flag = f"  MISMATCH: {got['problem']}" if got["problem"] else ""
    print(
        f"  {data.seconds:>3} s  {method.label:<40} clips/s {rates:<22} "
        f"CPU {result.cpu_ms:7.1f} ms/clip  peak {peak:5.0f} MiB (start {start:.0f}){flag}",
        flush=True,
    )
    return result


def check_frames(data: bytes, methods: list[Method]) -> str | None:
    """Decode the first 16 frames by every method; None when they agree within TOLERANCE."""
    reference = None
    worst = 0
    for method in methods:
        try:
            frames = first_frames(method, data)
        except Exception as exc:
            return f"{method.label}: {type(exc).__name__}: {exc}"
        if reference is None:
            reference = frames
        elif frames.shape != reference.shape:
            return (
                f"{method.label}: frames {tuple(frames.shape)}, expected {tuple(reference.shape)}"
            )
        else:
            worst = max(worst, int((frames.int() - reference.int()).abs().max()))
    print(f"frames     the {len(methods)} methods' first 16 frames differ by at most {worst}/255")
    if worst > TOLERANCE:
        return f"the methods' frames differ by up to {worst} of 255 (allowed: {TOLERANCE})"
    return None


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, the first column left-aligned, the others right-aligned."""
    rule = ["---", *("---:" for _ in header[1:])]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, rule, *rows])


def ratio(a: Result | None, b: Result | None) -> str:
    if a is None or b is None or a.error or b.error or not b.rate > 0:
        return "-"
    return f"{a.rate / b.rate:.2f}x"


def report(
    results: dict[tuple[int, str], Result], data_sets: list[DataSet], methods: list[Method]
) -> None:
    rows = []
    for data in data_sets:
        for method in methods:
            r = results[data.seconds, method.name]
            if r.error and r.rate != r.rate:
                rows.append([f"{data.seconds} s", method.label, "error", "-", "-", "-", "-"])
                continue
            ms = 1000 / r.rate if r.rate > 0 else float("nan")
            rate = f"{r.rate:,.1f}" if r.rate < 100 else fmt_rate(r.rate)
            peak, delta = f"{r.peak:,.0f}", f"+{r.delta:,.0f}"
            cpu = f"{r.cpu_ms:,.1f}"
            rows.append([f"{data.seconds} s", method.label, rate, f"{ms:,.1f}", cpu, peak, delta])
    header = [
        "video",
        "method",
        "clips/s",
        "ms/clip",
        "CPU ms/clip",
        "peak RSS MiB",
        "RSS delta MiB",
    ]
    print(
        "\nmedians over the passes: clips/s (higher is better), wall and CPU ms per clip; "
        "peak RSS of a fresh process per row\n"
    )
    print(markdown(header, rows))

    rows = []
    for data in data_sets:

        def get(name: str, seconds: int = data.seconds) -> Result | None:
            return results.get((seconds, name))

        rows.append(
            [
                f"{data.seconds} s",
                ratio(get("clip-torchcodec"), get("whole-torchcodec")),
                ratio(get("clip-pyav"), get("whole-pyav")),
                ratio(get("clip-torchcodec"), get("whole-pyav")),
                ratio(get("clip-torchcodec"), get("clip-pyav")),
                ratio(get("whole-torchcodec"), get("whole-pyav")),
            ]
        )
    header = [
        "video",
        "clip/whole torchcodec",
        "clip/whole PyAV",
        "clip torchcodec / whole PyAV (today)",
        "torchcodec/PyAV clip",
        "torchcodec/PyAV whole",
    ]
    print("\nratios of median clips/s\n")
    print(markdown(header, rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="160x120, 2 shards x (2, 1) videos (< 60 s)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed passes per row (default 3)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader workers (default 0: the pipeline is iterated in the process itself)",
    )
    p.add_argument("--lengths", default="10,60", help="video lengths in seconds (default 10,60)")
    p.add_argument("--size", help="WIDTHxHEIGHT of the videos (default 320x240; quick 160x120)")
    p.add_argument("--shards", type=int, help="shards per video length (default 4; quick 2)")
    p.add_argument(
        "--videos",
        help="videos per shard: one number, or one per length (default 4,2; quick 2,1)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        width, height = (
            int(v) for v in (args.size or ("160x120" if args.quick else "320x240")).split("x")
        )
        videos = [int(x) for x in (args.videos or ("2,1" if args.quick else "4,2")).split(",")]
    except ValueError:
        p.error("--lengths, --size and --videos take numbers: 10,60 / 320x240 / 4,2")
    if len(videos) == 1:
        videos *= len(args.lengths)
    if len(videos) != len(args.lengths):
        p.error("--videos takes one number, or one per length")
    args.videos = videos
    args.width, args.height = width, height
    args.shards = args.shards or (2 if args.quick else 4)
    if min(args.repeats, args.shards, *videos, *args.lengths) < 1 or args.workers < 0:
        p.error("--repeats, --shards, --videos and --lengths must be positive")
    if width < 32 or height < 32 or width % 2 or height % 2:
        p.error("--size must be even and at least 32x32")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_checkout()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    import av

    import cloudshards

    methods = list(METHODS)
    extra = {
        "cloudshards": f"{cloudshards.__version__}  ({Path(cloudshards.__file__).parent})",
        "av": f"{av.__version__} (FFmpeg {av.library_versions.get('libavcodec', '?')})",
    }
    try:
        import torchcodec.decoders  # loads FFmpeg's libraries, or fails

        extra["torchcodec"] = torchcodec.__version__
    except Exception as exc:  # missing, or FFmpeg's shared libraries are not installed
        extra["torchcodec"] = f"unusable ({type(exc).__name__}: {str(exc)[:80]}): rows skipped"
        methods = [m for m in methods if m.backend != "torchcodec"]
    print("\n".join(versions(extra)))
    print(f"command    {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(f"repeats    {args.repeats} timed passes per row (after one untimed sample)")
    reader = f"DataLoader(num_workers={args.workers})" if args.workers else "the process itself"
    print(f"reader     {reader}")

    results: dict[tuple[int, str], Result] = {}
    data_sets: list[DataSet] = []
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="cloudshards-bench-video-") as tmp:
        for seconds, per_shard in zip(args.lengths, args.videos, strict=True):
            begin = time.perf_counter()
            data = write_data_set(
                Path(tmp), seconds, args.shards, per_shard, args.width, args.height
            )
            data_sets.append(data)
            print(
                f"data       {seconds} s videos: {data.shards} shards x {per_shard} = "
                f"{data.videos} videos, {args.width}x{args.height} H.264 {FPS} fps, key frame "
                f"every {GOP}, {data.mbytes:.1f} MiB (written in "
                f"{time.perf_counter() - begin:.1f} s)"
            )
        problem = check_frames(data_sets[0].first_video, methods)
        if problem:
            problems.append(problem)
        print()
        for data in data_sets:
            for method in methods:
                result = run_child(method, data, args)
                results[data.seconds, method.name] = result
                if result.error:
                    problems.append(f"{data.seconds} s, {method.label}: {result.error}")
    report(results, data_sets, methods)
    if problems:
        print("\nFAILED:")
        for problem in problems:
            print(f"  - {problem}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
