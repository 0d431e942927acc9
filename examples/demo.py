"""cloudshards demo: train a small CNN on images streamed from an S3 bucket.

Everything runs on this machine, on CPU, in well under a minute:

1. make a small synthetic image dataset (10 classes, 32x32 PNG) as WebDataset tar shards;
2. start a local S3 server (moto) and upload the shards to a bucket;
3. train a tiny CNN for 2 epochs, streaming ``s3://BUCKET/train-{000000..000007}.tar`` with
   ``cloudshards.WebDataset`` through a PyTorch DataLoader with 2 workers.

Run it with::

    pip install "cloudshards[s3,image]" "moto[server]"
    python examples/demo.py                 # or: tox -e demo
    python examples/demo.py --no-cache      # stream every epoch from S3

The training code is what you would write against a real bucket: only ``storage_options``
(here pointing at the local server) would change, or go away if your environment already
holds AWS credentials.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import s3fs
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader

import cloudshards as wds  # a drop-in for `import webdataset as wds`

BUCKET = "cloudshards-demo"
SHARDS = 8
SAMPLES_PER_SHARD = 250
CLASSES = 10
IMAGE_SIZE = 32
BATCH_SIZE = 64
WORKERS = 2

# moto accepts any credentials; these are its documented dummy values, not secrets.
DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"

# One colour per class (RGB). Each image shows a bar in its class's colour, horizontal for
# even classes and vertical for odd ones, at a random place on a noisy background: a pattern
# a tiny CNN learns within a couple of epochs, but only by looking at the pixels.
PALETTE = [
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (250, 190, 190),
    (255, 255, 255),
]


def log(message: str) -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------------------------
# Step 1: a synthetic image dataset, written as WebDataset tar shards
# --------------------------------------------------------------------------------------------


def make_image(label: int, rng: np.random.Generator) -> bytes:
    """A 32x32 RGB PNG: dark noise plus a bar in the class's colour."""
    pixels = rng.integers(0, 90, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    start = int(rng.integers(0, IMAGE_SIZE - 8))
    bar = slice(start, start + 8)
    if label % 2 == 0:
        pixels[bar, :, :] = PALETTE[label]  # horizontal bar
    else:
        pixels[:, bar, :] = PALETTE[label]  # vertical bar
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def make_shard(shard: int, rng: np.random.Generator) -> bytes:
    """One WebDataset shard: a plain tar in which files sharing a key form a sample.

    Sample ``000003_0042`` is the pair ``000003_0042.png`` (the image) and
    ``000003_0042.cls`` (the label as decimal text); the extension names the field.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(SAMPLES_PER_SHARD):
            label = int(rng.integers(0, CLASSES))
            key = f"{shard:06d}_{i:04d}"
            add_member(tar, f"{key}.png", make_image(label, rng))
            add_member(tar, f"{key}.cls", str(label).encode())
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------
# Step 2: a local S3 server (moto) in a subprocess, and the upload
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def local_s3_server(log_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``moto_server`` on 127.0.0.1 and stop it on exit, error or Ctrl-C."""
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as server_log:
        process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_listening(endpoint: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    host, port = endpoint.removeprefix("http://").split(":")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the S3 server exited early; see {log_path}")
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 0.2):
            return
        time.sleep(0.1)
    raise SystemExit(f"the S3 server did not start within 30 s; see {log_path}")


# --------------------------------------------------------------------------------------------
# Step 3: a tiny CNN, trained from the bucket
# --------------------------------------------------------------------------------------------


def tiny_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16 x 16 x 16
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 32 x 8 x 8
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, CLASSES),
    )


def cache_arguments(cache_dir: Path | None) -> dict[str, Any]:
    """``cache_dir=`` for WebDataset: every process on this machine shares the directory."""
    if cache_dir is None:
        log("cache: off (--no-cache): every epoch streams from S3")
        return {}
    # Start cold so the demo shows both a first epoch from S3 and a second from the cache.
    shutil.rmtree(cache_dir, ignore_errors=True)
    log(f"cache: on, cache_dir={str(cache_dir)!r} (each shard crosses the network once)")
    return {"cache_dir": str(cache_dir)}


def report_cache(cache_dir: Path) -> None:
    """Print the cache's counters, summed over the DataLoader workers that updated them."""
    info = wds.cache_info(cache_dir)
    counters = info["counters"]
    log(
        f"      cache: {info['entries']} entries ({info['bytes'] / 2**20:.1f} MiB), "
        f"{counters.get('misses', 0)} downloads, {counters.get('hits', 0)} hits, "
        f"{counters.get('bytes_network', 0) / 2**20:.1f} MiB from S3, "
        f"{counters.get('bytes_disk', 0) / 2**20:.1f} MiB from disk"
    )


def train(
    url: str, storage_options: dict[str, Any], cache_kwargs: dict[str, Any], epochs: int
) -> tuple[int, float]:
    """Train for ``epochs`` epochs; return (samples seen, seconds spent in the epochs)."""
    # The pipeline reads like webdataset's: shuffle the shard order, shuffle samples in a
    # 500-sample buffer, decode PNG to float tensors (C, H, W) in [0, 1], keep (image, label).
    dataset = (
        wds.WebDataset(url, shardshuffle=100, storage_options=storage_options, **cache_kwargs)
        .shuffle(500)
        .decode("torchrgb")
        .to_tuple("png", "cls")
    )
    # A plain PyTorch DataLoader: each of the 2 workers reads its own 4 of the 8 shards, and
    # the DataLoader collates 64 samples into a batch.
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=WORKERS)

    model = tiny_cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()

    seen_total, seconds_total = 0, 0.0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        seen = correct = 0
        loss_sum = 0.0
        for images, labels in loader:
            logits = model(images)
            loss = loss_fn(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(labels)
            correct += int((logits.argmax(dim=1) == labels).sum())
            loss_sum += loss.item() * len(labels)
        seconds = time.perf_counter() - start
        seen_total += seen
        seconds_total += seconds
        log(
            f"epoch {epoch}/{epochs}: {seen} samples, loss {loss_sum / seen:.3f}, "
            f"accuracy {correct / seen:.1%}, {seconds:.1f} s, {seen / seconds:,.0f} samples/s"
        )
        if "cache_dir" in cache_kwargs:
            report_cache(Path(cache_kwargs["cache_dir"]))
    return seen_total, seconds_total


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a tiny CNN on shards streamed from S3.")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(".demo/cache"),
        help="per-node shard cache (default .demo/cache); used if WebDataset accepts cache_dir",
    )
    parser.add_argument("--no-cache", action="store_true", help="do not use a cache directory")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs (default 2)")
    args = parser.parse_args(argv)

    # A `kill` (SIGTERM) unwinds like Ctrl-C does, so the S3 server is always stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Two cores: one thread for the model, leaving the other core to the DataLoader workers.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    began = time.perf_counter()

    server_log = Path(".demo/moto.log")
    log("[1/4] starting a local S3 server (moto) ...")
    with local_s3_server(server_log) as (endpoint, process):
        # The server starts in the background while we draw the images.
        size = SHARDS * SAMPLES_PER_SHARD
        log(f"[2/4] drawing {size} images of {CLASSES} classes into {SHARDS} tar shards ...")
        rng = np.random.default_rng(0)
        shards = [make_shard(shard, rng) for shard in range(SHARDS)]
        log(f"      {sum(map(len, shards)) / 2**20:.1f} MiB of shards")

        wait_until_listening(endpoint, process, server_log)
        log(f"[3/4] uploading to s3://{BUCKET}/ on {endpoint} ...")
        # These options are what both s3fs and cloudshards need to reach the local server.
        s3_options = {"endpoint_url": endpoint, "key": DUMMY_KEY, "secret": DUMMY_SECRET}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options)
        fs.mkdir(BUCKET)
        for shard, data in enumerate(shards):
            fs.pipe_file(f"{BUCKET}/train-{shard:06d}.tar", data)
        log(f"      {', '.join(sorted(p.rsplit('/', 1)[-1] for p in fs.ls(BUCKET)))}")

        url = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
        log(f"[4/4] training a tiny CNN for {args.epochs} epochs from {url}")
        cache_kwargs = cache_arguments(None if args.no_cache else args.cache_dir)
        seen, seconds = train(url, {"s3": s3_options}, cache_kwargs, args.epochs)

    log(
        f"done: {seen} samples in {seconds:.1f} s of training = {seen / seconds:,.0f} samples/s "
        f"(demo wall time {time.perf_counter() - began:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the S3 server has already been stopped on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)
