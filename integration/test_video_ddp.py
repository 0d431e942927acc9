"""Video clips under DDP: torchrun, 2 ranks x 2 DataLoader workers, gloo, a real training step.

``video_ddp_train.py`` (launched with torchrun ``--standalone --nproc_per_node=2``) decodes
``wds.VideoClip(8, stride=2, size=(32, 32))`` clips from 4 shards of deliberately uneven sizes
(3, 7, 2, 6 videos: 18) whose videos differ in length (0.5 s to 8 s, some shorter than a clip),
frame rate, frame size, codec (libx264, mpeg4) and audio track, batches them by 2 in the
workers, and trains a Conv3d in DistributedDataParallel for 2 epochs with
``wds.StatefulLoader``. Each rank records, per step, every clip's sample key, label,
timestamps and a hash of its frames. What users rely on, checked here:

- every rank takes the same number of steps each epoch (a rank with fewer batches would leave
  the other in DDP's all-reduce: the launch timeout turns that hang into a failure), every
  batch full: 18 videos over 4 consumers is 4 each, 2 batches per worker;
- within an epoch no video is delivered twice across the ranks, at most 3 left out;
- each clip is 8 frames 2 apart of its own video, starting where a clip fits (a video
  shorter than the clip repeats its last frame);
- a video's clip depends on (seed, epoch, sample) only: the ranks deliver exactly the clips a
  single process reading the same epoch decodes, and the next epoch draws other ones;
- a run stopped mid-epoch whose ``loader.state_dict()`` (gathered from both ranks) is saved
  in one file by rank 0, and restored from that file on both ranks, delivers from then on the
  very clips (keys, timestamps, frames) of the uninterrupted run and ends with its model.

Marked ``slow``: three torchrun launches (~6-10 s each on 2 cores; ~20 s in all).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from torchrun_util import TorchrunResult, torchrun
from video_ddp_train import BATCH_SIZE, NUM_FRAMES, SIZE, STRIDE, WORKERS, frames_digest

import cloudshards as wds

SCRIPT = Path(__file__).with_name("video_ddp_train.py")
SHARD_SIZES = (3, 7, 2, 6)
NUM_VIDEOS = sum(SHARD_SIZES)
# Lengths in seconds, cycled over the videos: 0.5 s and 0.8 s are shorter than a clip's span.
LENGTHS_S = (0.5, 8.0, 2.5, 1.0, 6.0, 3.5, 0.8, 5.0, 1.5)
SPAN = (NUM_FRAMES - 1) * STRIDE + 1  # frames a clip covers
SEED = 4321
EPOCHS = 2
RANKS = 2
CONSUMERS = RANKS * WORKERS
PER_CONSUMER = NUM_VIDEOS // CONSUMERS  # balance="drop": 4 each, 2 videos left out per epoch
STEPS_PER_EPOCH = WORKERS * PER_CONSUMER // BATCH_SIZE  # per rank
STOP_AFTER = STEPS_PER_EPOCH // 2 + 1  # mid-epoch 0, the two workers at different batches
RUN_TIMEOUT_S = 150.0
TEST_TIMEOUT_S = 600  # the first test launches the reference run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]


# ------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class Video:
    key: str
    label: int
    frames: int
    fps: int
    codec: str
    width: int
    height: int
    audio: bool


def video_for(shard: int, position: int, number: int) -> Video:
    """The (deterministic) shape of video ``number``, the ``position``-th of its shard."""
    fps = (10, 12, 15)[number % 3]
    width, height = ((96, 64), (64, 48))[number // 2 % 2]
    return Video(
        key=f"v{shard}-{position:02d}",
        label=number % 4,
        frames=max(1, round(LENGTHS_S[number % len(LENGTHS_S)] * fps)),
        fps=fps,
        codec=("libx264", "mpeg4")[number % 2],
        width=width,
        height=height,
        audio=number % 3 == 1,
    )


def encode(video: Video, number: int) -> bytes:
    """An mp4 whose frames all differ (a gradient, a band moving down, a changing hue)."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream(video.codec, rate=video.fps)
        stream.width, stream.height, stream.pix_fmt = video.width, video.height, "yuv420p"
        sound = container.add_stream("aac", rate=8000) if video.audio else None
        ramp = np.linspace(0, 255, video.width, dtype=np.uint8)
        for index in range(video.frames):
            image = np.zeros((video.height, video.width, 3), np.uint8)
            image[..., 0] = (number * 37 + index * 11) % 256
            image[..., 1] = ramp[None, :]
            band = index % video.height
            image[band : band + 4, :, 2] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
        if sound is not None:
            samples = round(video.frames / video.fps * 8000)
            tone = (np.sin(np.arange(samples) / 5.0) * 0.3).astype(np.float32)
            chunk = av.AudioFrame.from_ndarray(tone.reshape(1, -1), format="fltp", layout="mono")
            chunk.sample_rate = 8000
            for packet in [*sound.encode(chunk), *sound.encode(None)]:
                container.mux(packet)
    return out.getvalue()


@dataclass(frozen=True)
class Videos:
    spec: str
    videos: dict[str, Video]
    root: Path


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Videos:
    """The 4 shards, written with ``wds.TarWriter`` (``mp4`` bytes, ``cls`` int)."""
    root = tmp_path_factory.mktemp("video-ddp")
    table: dict[str, Video] = {}
    number = 0
    for shard, size in enumerate(SHARD_SIZES):
        with wds.TarWriter(str(root / f"video-{shard:06d}.tar")) as sink:
            for position in range(size):
                video = video_for(shard, position, number)
                sink.write({"__key__": video.key, "mp4": encode(video, number), "cls": video.label})
                table[video.key] = video
                number += 1
    spec = f"{root}/video-{{000000..{len(SHARD_SIZES) - 1:06d}}}.tar"
    assert len(table) == NUM_VIDEOS
    assert any(v.frames < SPAN for v in table.values()), "no video shorter than a clip"
    return Videos(spec=spec, videos=table, root=root)


# ------------------------------------------------------------------------------ runs


@dataclass(frozen=True)
class Run:
    """One launch and each rank's recorded steps (``{"epoch", "step", "clips"}`` dicts)."""

    result: TorchrunResult
    steps: dict[int, list[dict[str, Any]]]

    def clips(self, epoch: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """(rank, clip) of every clip delivered in ``epoch``."""
        for rank, steps in self.steps.items():
            for step in steps:
                if step["epoch"] == epoch:
                    yield from ((rank, clip) for clip in step["clips"])


def launch(videos: Videos, record: Path, *extra: str) -> Run:
    """Run the training script on 2 ranks; fail (with every rank's output) unless all ended."""
    env = {
        "CLOUDSHARDS_COUNTS_DIR": str(videos.root / "counts"),  # not ~/.cache
        "CLOUDSHARDS_NODE_DIR": str(videos.root / "node"),
    }
    args = [videos.spec, f"--epochs={EPOCHS}", f"--seed={SEED}", f"--record={record}", *extra]
    result = torchrun(SCRIPT, args, nproc_per_node=RANKS, env=env, timeout_s=RUN_TIMEOUT_S)
    result.check(RANKS)
    steps = {}
    for rank in range(RANKS):
        path = record / f"rank{rank}.jsonl"
        assert path.exists(), f"rank {rank} recorded no step ({path})"
        steps[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return Run(result=result, steps=steps)


@pytest.fixture(scope="module")
def reference(videos: Videos, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted run: 2 epochs."""
    return launch(videos, tmp_path_factory.mktemp("video-ddp-reference"))


def single_process_clips(videos: Videos, epoch: int) -> dict[str, dict[str, Any]]:
    """key -> clip (timestamps, frames hash) of every video, read in this process (no ranks,
    no workers) with the training pipeline's seed and decoder."""
    dataset = (
        wds.WebDataset(videos.spec, shardshuffle=True, seed=SEED)
        .decode(video=wds.VideoClip(NUM_FRAMES, stride=STRIDE, size=SIZE))
        .to_tuple("__key__", "mp4")
    )
    dataset.set_epoch(epoch)
    clips = {
        key: {"timestamps": clip["timestamps"].tolist(), "frames": frames_digest(clip["frames"])}
        for key, clip in dataset
    }
    assert sorted(clips) == sorted(videos.videos)
    return clips


def frame_indices(video: Video, timestamps: list[float]) -> list[int]:
    indices = [t * video.fps for t in timestamps]
    assert all(abs(i - round(i)) < 1e-6 for i in indices), f"{video.key}: {timestamps}"
    return [round(i) for i in indices]


# ------------------------------------------------------------------------------ tests


def test_every_rank_takes_the_same_steps(reference: Run) -> None:
    """Both ranks: 2 epochs of 4 full batches, steps numbered alike; the job ended (no hang)."""
    for rank, steps in reference.steps.items():
        assert [s["step"] for s in steps] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1)), (
            f"rank {rank} steps {[(s['epoch'], s['step']) for s in steps]}"
        )
        per_epoch = Counter(s["epoch"] for s in steps)
        assert per_epoch == dict.fromkeys(range(EPOCHS), STEPS_PER_EPOCH), f"rank {rank}"
        assert {len(s["clips"]) for s in steps} == {BATCH_SIZE}, f"rank {rank}: a partial batch"
        summary = reference.result.summaries[rank]
        assert (summary.epochs, summary.steps) == (EPOCHS, len(steps))
        assert summary.samples == len(steps) * BATCH_SIZE


def test_no_video_twice_in_an_epoch(reference: Run, videos: Videos) -> None:
    """Within an epoch the ranks' clips are of distinct videos, with their own labels, and
    all but ``18 % 4`` of the videos are there."""
    for epoch in range(EPOCHS):
        delivered = [clip for _, clip in reference.clips(epoch)]
        counts = Counter(clip["key"] for clip in delivered)
        repeated = sorted(key for key, n in counts.items() if n > 1)
        assert not repeated, f"epoch {epoch}: delivered twice: {repeated}"
        assert set(counts) <= set(videos.videos), set(counts) - set(videos.videos)
        assert len(counts) == CONSUMERS * PER_CONSUMER, f"epoch {epoch}: {sorted(counts)}"
        for clip in delivered:
            assert clip["label"] == videos.videos[clip["key"]].label, clip["key"]
        for rank in range(RANKS):
            on_rank = [clip for r, clip in reference.clips(epoch) if r == rank]
            assert len(on_rank) == WORKERS * PER_CONSUMER, f"epoch {epoch}, rank {rank}"


def test_clips_are_strided_windows_of_their_video(reference: Run, videos: Videos) -> None:
    """Every clip: 8 frames 2 apart from a start where the clip fits, the last frame repeated
    when the video is shorter than the clip (videos with an audio track too: the video stream
    is the one decoded)."""
    short = with_audio = 0
    for epoch in range(EPOCHS):
        for _, clip in reference.clips(epoch):
            video = videos.videos[clip["key"]]
            indices = frame_indices(video, clip["timestamps"])
            first = indices[0]
            assert 0 <= first <= max(video.frames - SPAN, 0), (video, indices)
            want = [min(first + i * STRIDE, video.frames - 1) for i in range(NUM_FRAMES)]
            assert indices == want, (video, clip["timestamps"])
            short += video.frames < SPAN
            with_audio += video.audio
    assert short, "no clip of a video shorter than a clip was delivered"
    assert with_audio, "no clip of a video with an audio track was delivered"


def test_clips_do_not_depend_on_the_reader(reference: Run, videos: Videos) -> None:
    """The clips the ranks' workers delivered are exactly those one process decodes for the
    same epoch (start seeded by seed, epoch, sample and field: not rank or worker), and
    epoch 1 draws other starts than epoch 0."""
    alone = {epoch: single_process_clips(videos, epoch) for epoch in range(EPOCHS)}
    for epoch in range(EPOCHS):
        for rank, clip in reference.clips(epoch):
            want = alone[epoch][clip["key"]]
            got = {"timestamps": clip["timestamps"], "frames": clip["frames"]}
            assert got == want, f"epoch {epoch}, rank {rank}, {clip['key']}"
    roomy = [key for key, video in videos.videos.items() if video.frames - SPAN >= 10]
    moved = [key for key in roomy if alone[0][key] != alone[1][key]]
    assert len(moved) >= len(roomy) // 2, f"epoch 1 drew the same clips as epoch 0: {roomy}"


def test_resume_from_one_checkpoint(reference: Run, videos: Videos, tmp_path: Path) -> None:
    """Stop after 3 steps of epoch 0; rank 0 saves the gathered ``loader.state_dict()`` with
    the model; both ranks restore from that one file: the first run delivered the reference's
    first 3 steps, the resumed one exactly the reference's clips from there on (keys,
    timestamps, frames), and it ends with the reference's model (its final loss)."""
    checkpoint = tmp_path / "checkpoint.pt"
    stopped = launch(
        videos, tmp_path / "stopped", f"--steps-limit={STOP_AFTER}", f"--save={checkpoint}"
    )
    assert checkpoint.exists(), "rank 0 saved no checkpoint"
    resumed = launch(videos, tmp_path / "resumed", f"--resume={checkpoint}")
    for rank in range(RANKS):
        want = reference.steps[rank]
        assert stopped.result.summaries[rank].steps == STOP_AFTER
        assert stopped.steps[rank] == want[:STOP_AFTER], f"rank {rank}: before the stop"
        got = resumed.steps[rank]
        assert [s["step"] for s in got] == [s["step"] for s in want[STOP_AFTER:]], (
            f"rank {rank}: resumed at step {got[0]['step'] if got else None}"
        )
        for step_got, step_want in zip(got, want[STOP_AFTER:], strict=True):
            assert step_got == step_want, f"rank {rank}, step {step_want['step']}"
        assert resumed.result.summaries[rank] == reference.result.summaries[rank]
