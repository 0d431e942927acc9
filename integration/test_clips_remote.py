"""Video and audio clips decoded from shards on S3 (moto), with DataLoader workers: the same
clips as from the local copy, and a cache that changes nothing."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from media import encode_audio, encode_video, frame_number

import cloudshards as wds

if TYPE_CHECKING:
    from servers import S3Server

BUCKET = "cloudshards-clips"


def write_shards(root: Path) -> list[str]:
    """Two shards of uneven videos (1-5 s, some with sound) and a sound track each."""
    names = []
    for shard, count in enumerate([3, 5]):
        name = f"clips-{shard}.tar"
        with wds.TarWriter(str(root / name)) as sink:
            for index in range(count):
                seconds = 1 + (index * 7 + shard) % 5
                video = encode_video(
                    "libx264", "mp4", frames=24 * seconds, audio_seconds=seconds * (index % 2)
                )
                sound = encode_audio("flac", "flac", seconds=seconds, rate=16000)
                sink.write({"__key__": f"{shard}-{index}", "mp4": video, "flac": sound})
        names.append(name)
    return names


def clips(url: str, workers: int, **kwargs: Any) -> dict[str, tuple[list[int], list[float]]]:
    dataset = (
        wds.WebDataset(url, shardshuffle=False, seed=11, **kwargs)
        .decode(
            video=wds.VideoClip(8, stride=2, size=(24, 32)),
            audio=wds.AudioClip(0.5, sample_rate=8000, mono=True),
        )
        .to_tuple("__key__", "mp4", "flac")
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    got = {}
    for key, video, audio in loader:
        assert video["frames"].shape == (8, 3, 24, 32)
        assert audio["waveform"].shape == (1, 4000)
        got[key] = (video["timestamps"].tolist(), [round(audio["start"], 6)])
    return got


def test_clips_from_s3_with_workers_equal_the_local_ones(
    s3_server: S3Server, tmp_path: Path
) -> None:
    names = write_shards(tmp_path)
    fs = s3_server.filesystem()
    fs.makedirs(BUCKET, exist_ok=True)
    fs.put([str(tmp_path / n) for n in names], [f"{BUCKET}/{n}" for n in names])
    local = clips(str(tmp_path / "clips-{0..1}.tar"), workers=0)
    assert len(local) == 8
    options = {"s3": s3_server.storage_options()}
    remote = clips(f"s3://{BUCKET}/clips-{{0..1}}.tar", 2, storage_options=options)
    assert remote == local
    cached = clips(
        f"s3://{BUCKET}/clips-{{0..1}}.tar",
        2,
        storage_options=options,
        cache_dir=str(tmp_path / "cache"),
    )
    assert cached == local


def test_clip_frames_from_s3_are_the_frames_at_their_timestamps(
    s3_server: S3Server, tmp_path: Path
) -> None:
    video = encode_video("libvpx-vp9", "webm", frames=72, fps=24)
    with wds.TarWriter(str(tmp_path / "one.tar")) as sink:
        sink.write({"__key__": "v", "webm": video})
    fs = s3_server.filesystem()
    fs.makedirs(BUCKET, exist_ok=True)
    fs.put(str(tmp_path / "one.tar"), f"{BUCKET}/one.tar")
    dataset = wds.WebDataset(
        f"s3://{BUCKET}/one.tar",
        shardshuffle=False,
        storage_options={"s3": s3_server.storage_options()},
    ).decode(video=wds.VideoClip(6, fps=6))
    (sample,) = list(dataset)
    clip = sample["webm"]
    numbers = [frame_number(frame) for frame in clip["frames"]]
    # Frame n shows from n/24 s: every timestamp names its frame, 4 frames apart at 6 fps.
    assert numbers == [round(t * 24) for t in clip["timestamps"].tolist()]
    assert [b - a for a, b in itertools.pairwise(numbers)] == [4] * 5
