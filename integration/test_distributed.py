"""The three training modes across processes: the example scripts under torchrun, DDP on gloo.

Each test launches ``examples/train_epochs.py``, ``train_resampled.py`` or ``train_indexed.py``
with torchrun, as 2 ranks x 2 DataLoader workers (``--standalone``) or as 2 "nodes" x 2 ranks
(two torchrun processes, static rendezvous on 127.0.0.1), over 7 shards of deliberately uneven
sizes. Every rank writes the keys of each batch it trained on (``--log-keys``) and a final
summary line; the tests read those back:

- every rank takes the same number of steps (a DistributedDataParallel model on every rank: a
  rank with fewer batches would leave the others in an all-reduce, which the launch timeout
  turns into a failure with every node's output);
- classic epochs (``balance="drop"``): within an epoch no sample twice, every rank and worker
  the same count, and at most ``ranks x workers - 1`` samples missing; ``"pad"``: every sample,
  at most ``ranks x workers - 1`` repeated; indexed: each rank gets exactly the sample numbers
  ``DistributedChunkedSampler`` promises it, together the whole dataset;
- epoch 2's order differs from epoch 1's, and a rerun with the same seed is identical;
- a run stopped after k steps and resumed from its ``StatefulDataLoader`` state trains on
  exactly the samples of an uninterrupted run, in the same order; resumed on another world
  (1 rank x 2 workers, 3 x 1, 2 nodes x 2 ranks x 2 workers: an elastic restore), on every
  sample of the interrupted epoch exactly once, every new rank the same steps;
- over S3 (moto) with the node cache: the same samples as from local disk, each shard fetched
  from the store once.

Runs are cached per module (a rerun with the same arguments is launched once) and every test
is marked ``slow`` (a torchrun launch costs ~6-12 s here; 2 nodes, more).
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re
import tarfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from cloudsim_fixtures import cloudsim_process_factory  # noqa: F401 - the fixture
from torchrun_util import NODE_RANK, TorchrunResult, is_running, torchrun

import cloudshards as wds

if TYPE_CHECKING:
    from servers import NginxServer, S3Server

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EPOCHS_SCRIPT = EXAMPLES / "train_epochs.py"
RESAMPLED_SCRIPT = EXAMPLES / "train_resampled.py"
INDEXED_SCRIPT = EXAMPLES / "train_indexed.py"

# 111 samples: 111 % 4 = 3 and 111 % 8 = 7, so "drop" drops and "pad" pads the most there is
# (C - 1) with 2 x 2 and 4 x 2 consumers; shard 1 holds 13x as many samples as shard 0.
SHARD_SIZES = (3, 40, 11, 7, 29, 5, 16)
NUM_SAMPLES = sum(SHARD_SIZES)
FEATURES = 8
CLASSES = 4
SEED = 1234
EPOCHS = 2
BATCH_SIZE = 5  # 111 // (2 x 2) = 27 per worker: 5 full batches and a partial one
WORKERS = 2
RESAMPLED_SAMPLES_PER_EPOCH = 240  # 240 // (4 x 2 x 5) = 6 batches per worker with 2 nodes
RUN_TIMEOUT_S = 240.0  # 2 nodes = 4 ranks + 8 workers on 2 busy cores
TEST_TIMEOUT_S = 900  # covers the module's runs that the first test using them launches
BUCKET = "cloudshards-distributed"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]


# ------------------------------------------------------------------------------ data


def sample_key(shard: int, index: int) -> str:
    return f"s{shard}-{index:03d}"


def write_shards(root: Path) -> list[str]:
    """Write the uneven shards (``npy`` features, ``cls`` label) and return all keys in order."""
    root.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    rng = np.random.default_rng(SEED)
    for shard, size in enumerate(SHARD_SIZES):
        with tarfile.open(root / f"train-{shard:06d}.tar", "w", format=tarfile.PAX_FORMAT) as tar:
            for index in range(size):
                key = sample_key(shard, index)
                features = io.BytesIO()
                np.save(features, rng.standard_normal(FEATURES).astype(np.float32))
                label = str((shard + index) % CLASSES).encode()
                for ext, data in (("npy", features.getvalue()), ("cls", label)):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    info.mtime = 1_700_000_000
                    tar.addfile(info, io.BytesIO(data))
                keys.append(key)
    return keys


@dataclass(frozen=True)
class Data:
    """The shards on local disk.

    Attributes:
        root: Their directory (no index in it: balanced epochs count the samples themselves).
        spec: Brace spec of the 7 shards.
        index_url: An index of them, one directory up (for the indexed mode).
        keys: Every sample key, in shard order (the indexed mode's sample numbering).
    """

    root: Path
    spec: str
    index_url: str
    keys: list[str]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("distributed-data")
    keys = write_shards(root / "shards")
    spec = f"{root}/shards/train-{{000000..{len(SHARD_SIZES) - 1:06d}}}.tar"
    # Above the shards' directory, not in it: the indexed mode finds it (an index may list
    # shards under its own directory), balanced epochs do not (they look beside the shards).
    index_url = str(root / "train.index.json")
    wds.write_index(wds.build_index(spec), index_url)
    assert len(keys) == NUM_SAMPLES
    return Data(root=root / "shards", spec=spec, index_url=index_url, keys=keys)


# ------------------------------------------------------------------------------ runs


@dataclass(frozen=True)
class Step:
    epoch: int
    step: int
    keys: tuple[str, ...]


@dataclass
class Run:
    """One launch: its result and each rank's steps, read from ``--log-keys``."""

    result: TorchrunResult
    world_size: int
    steps: dict[int, list[Step]]

    def epochs(self) -> list[int]:
        return sorted({s.epoch for steps in self.steps.values() for s in steps})

    def keys(self, rank: int, epoch: int) -> list[str]:
        """The keys rank ``rank`` trained on in ``epoch``, in order."""
        return [k for s in self.steps[rank] if s.epoch == epoch for k in s.keys]

    def epoch_keys(self, epoch: int) -> list[str]:
        """Every rank's keys of ``epoch``, rank 0 first."""
        return [k for rank in range(self.world_size) for k in self.keys(rank, epoch)]

    def steps_in(self, rank: int, epoch: int) -> int:
        return sum(1 for s in self.steps[rank] if s.epoch == epoch)


def read_log(directory: Path, world_size: int) -> dict[int, list[Step]]:
    steps: dict[int, list[Step]] = {}
    for rank in range(world_size):
        path = directory / f"rank{rank}.jsonl"
        assert path.exists(), f"rank {rank} wrote no key log at {path}"
        lines = path.read_text().splitlines()
        steps[rank] = [
            Step(int(d["epoch"]), int(d["step"]), tuple(d["keys"])) for d in map(json.loads, lines)
        ]
    return steps


class Runner:
    """Launches the example scripts; identical launches run once per module."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self._cache: dict[tuple[Any, ...], Run] = {}
        self._count = 0

    def new_dir(self, name: str) -> Path:
        self._count += 1
        path = self.root / f"{self._count:02d}-{name}"
        path.mkdir(parents=True)
        return path

    def run(
        self,
        script: Path,
        args: Sequence[str],
        *,
        nodes: int = 1,
        ranks_per_node: int = 2,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        cached: bool = True,
    ) -> Run:
        """Run ``script`` with ``args --log-keys DIR`` and check it ended well on every rank."""
        key = (script.name, tuple(args), nodes, ranks_per_node)
        if cached and log_dir is None and env is None and key in self._cache:
            return self._cache[key]
        log_dir = log_dir or self.new_dir(script.stem)
        result = torchrun(
            script,
            [*args, "--log-keys", str(log_dir)],
            nproc_per_node=ranks_per_node,
            nnodes=nodes,
            env={**self.env, **(env or {})},
            timeout_s=RUN_TIMEOUT_S,
        )
        world_size = nodes * ranks_per_node
        result.check(world_size)
        run = Run(result=result, world_size=world_size, steps=read_log(log_dir, world_size))
        if cached:
            self._cache[key] = run
        return run


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    root = tmp_path_factory.mktemp("distributed-runs")
    # Balanced epochs remember sample counts per node; keep them out of ~/.cache.
    return Runner(root, env={"CLOUDSHARDS_COUNTS_DIR": str(root / "counts")})


def common_args(data_arg: str, *, seed: int = SEED) -> list[str]:
    return [
        data_arg,
        f"--epochs={EPOCHS}",
        f"--batch-size={BATCH_SIZE}",
        f"--workers={WORKERS}",
        f"--seed={seed}",
        f"--features={FEATURES}",
        f"--classes={CLASSES}",
    ]


def epochs_args(data: Data, *extra: str) -> list[str]:
    return [*common_args(data.spec), *extra]


def resampled_args(data: Data) -> list[str]:
    return [*common_args(data.spec), f"--samples-per-epoch={RESAMPLED_SAMPLES_PER_EPOCH}"]


def indexed_args(data: Data) -> list[str]:
    return common_args(data.index_url)


LAYOUTS = {"2x2": 1, "2nodes": 2}  # number of nodes (torchrun processes), 2 ranks each


# ------------------------------------------------------------------------------ checks


def check_lockstep(run: Run) -> None:
    """Every rank took the same steps, each epoch, and said so in its summary."""
    first = run.steps[0]
    for rank in range(run.world_size):
        steps = run.steps[rank]
        assert [s.step for s in steps] == list(range(1, len(steps) + 1)), f"rank {rank} steps"
        assert [s.epoch for s in steps] == [s.epoch for s in first], (
            f"rank {rank} took {Counter(s.epoch for s in steps)} steps per epoch, "
            f"rank 0 {Counter(s.epoch for s in first)}"
        )
        summary = run.result.summaries[rank]
        assert summary.steps == len(steps), f"rank {rank}: summary {summary} vs log"
        assert summary.samples == sum(len(s.keys) for s in steps)
    assert run.epochs() == list(range(EPOCHS))


def check_drop_epoch(run: Run, epoch: int, keys: list[str]) -> None:
    """``balance="drop"``: no duplicate, equal counts per rank, at most C - 1 samples missing."""
    consumers = run.world_size * WORKERS
    seen = run.epoch_keys(epoch)
    repeated = [k for k, n in Counter(seen).items() if n > 1]
    assert not repeated, f"epoch {epoch}: samples delivered twice: {repeated}"
    assert set(seen) <= set(keys), f"unknown keys: {set(seen) - set(keys)}"
    missing = set(keys) - set(seen)
    assert len(missing) <= consumers - 1, (
        f"epoch {epoch}: {len(missing)} samples missing, more than {consumers} consumers - 1: "
        f"{sorted(missing)}"
    )
    # Every rank x worker takes N // C samples (so the C - 1 bound above is met exactly).
    per_rank = {rank: len(run.keys(rank, epoch)) for rank in range(run.world_size)}
    want = WORKERS * (len(keys) // consumers)
    assert set(per_rank.values()) == {want}, f"epoch {epoch}: samples per rank {per_rank}"


def check_pad_epoch(run: Run, epoch: int, keys: list[str]) -> None:
    """``balance="pad"``: every sample, equal counts per rank, at most C - 1 repeated."""
    consumers = run.world_size * WORKERS
    seen = run.epoch_keys(epoch)
    assert set(seen) == set(keys), f"epoch {epoch}: missing {sorted(set(keys) - set(seen))}"
    assert len(seen) == consumers * math.ceil(len(keys) / consumers), (
        f"epoch {epoch}: {len(seen)} samples for {consumers} consumers"
    )
    assert len(seen) - len(keys) <= consumers - 1
    per_rank = {rank: len(run.keys(rank, epoch)) for rank in range(run.world_size)}
    want = WORKERS * math.ceil(len(keys) / consumers)
    assert set(per_rank.values()) == {want}, f"epoch {epoch}: samples per rank {per_rank}"


def check_new_order_each_epoch(run: Run) -> None:
    for rank in range(run.world_size):
        first, second = run.keys(rank, 0), run.keys(rank, 1)
        assert first != second, f"rank {rank}: epoch 1 repeats epoch 0's order: {first}"


def check_same_run(run: Run, again: Run) -> None:
    for rank in range(run.world_size):
        assert again.steps[rank] == run.steps[rank], f"rank {rank}: the rerun trained differently"


# ------------------------------------------------------------------------------ classic epochs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_epochs_balanced_drop(runner: Runner, data: Data, layout: str) -> None:
    """Default balance ("auto" = "drop" with several ranks) over uneven shards: lockstep, each
    epoch complete but for at most C - 1 samples, never a duplicate, a new order per epoch."""
    run = runner.run(EPOCHS_SCRIPT, epochs_args(data), nodes=LAYOUTS[layout])
    check_lockstep(run)
    for epoch in range(EPOCHS):
        check_drop_epoch(run, epoch, data.keys)
    check_new_order_each_epoch(run)


def test_epochs_balanced_pad(runner: Runner, data: Data) -> None:
    """``balance="pad"``: every sample each epoch, the few extra ones repeated, lockstep."""
    run = runner.run(EPOCHS_SCRIPT, epochs_args(data, "--balance=pad"))
    check_lockstep(run)
    for epoch in range(EPOCHS):
        check_pad_epoch(run, epoch, data.keys)
    check_new_order_each_epoch(run)


def reference_run(runner: Runner, data: Data) -> Run:
    """The uninterrupted run with ``StatefulDataLoader`` (``--state`` saves at the end)."""
    return runner.run(EPOCHS_SCRIPT, epochs_args(data, f"--state={runner.root / 'reference'}"))


def test_epochs_rerun_is_identical(runner: Runner, data: Data) -> None:
    """Same seed, same training: the shard order is a pure function of (seed, epoch). The rerun
    goes through ``StatefulDataLoader`` instead of ``WebLoader``, so this also shows that
    checkpointing does not change the stream."""
    run = runner.run(EPOCHS_SCRIPT, epochs_args(data))
    again = reference_run(runner, data)
    check_same_run(run, again)


@pytest.mark.parametrize("buffer", [0, 1000], ids=["no-shuffle-buffer", "shuffle-1000"])
def test_epochs_resume_from_state(runner: Runner, data: Data, buffer: int) -> None:
    """Stop mid-epoch 0 saving ``StatefulDataLoader``'s state, resume from it and stop again
    mid-epoch 1, resume from that: the three runs together trained on exactly the
    uninterrupted run's batches (with a sample shuffle buffer too: its samples are read again
    by position on restore), and ended with the same model (each rank's final loss)."""
    shuffle = [f"--shuffle-buffer={buffer}"] if buffer else []
    if buffer:
        saved = f"--state={runner.root / 'reference-shuffled'}"
        reference = runner.run(EPOCHS_SCRIPT, epochs_args(data, saved, *shuffle))
    else:
        reference = reference_run(runner, data)
    check_lockstep(reference)
    per_epoch = reference.steps_in(0, 0)
    stops = (per_epoch // 2, per_epoch + per_epoch // 2 + 1)  # mid-epoch 0, mid-epoch 1
    log_dir = runner.new_dir("resumed")
    args = epochs_args(data, *shuffle)
    previous: Path | None = None
    for stop in (*stops, None):
        state = runner.new_dir("state")
        extra = [f"--state={state}"]
        extra += [f"--resume={previous}"] if previous is not None else []
        extra += [f"--steps-limit={stop}"] if stop is not None else []
        part = runner.run(EPOCHS_SCRIPT, [*args, *extra], log_dir=log_dir, cached=False)
        previous = state
    assert {s.steps for s in part.result.summaries.values()} == {len(reference.steps[0])}
    for rank in range(reference.world_size):
        got, want = part.steps[rank], reference.steps[rank]
        assert got == want, (
            f"rank {rank}: stopped after {stops[0]} and {stops[1]} steps and resumed, "
            "trained on\n" + "\n".join(map(str, got)) + "\ninstead of\n" + "\n".join(map(str, want))
        )
        # Same steps, samples and final loss: the model and optimizer resumed too.
        assert part.result.summaries[rank] == reference.result.summaries[rank]


# Restores on other worlds: (nodes, ranks per node, workers per rank). "2nodes-1x2" is the
# same world as the checkpoint's (2 ranks x 2 workers), started as 2 static-rendezvous nodes.
ELASTIC_WORLDS = {
    "1x2": (1, 1, 2),
    "3x1": (1, 3, 1),
    "2nodes-2x2": (2, 2, 2),
    "2nodes-1x2": (2, 1, 2),
}


@pytest.mark.parametrize("stop_epoch", [0, 1])
@pytest.mark.parametrize("world", sorted(ELASTIC_WORLDS))
def test_epochs_elastic_resume(runner: Runner, data: Data, world: str, stop_epoch: int) -> None:
    """Stop 2 ranks x 2 workers (``.shuffle(1000)``) mid-epoch 0 (or 1), restore the gathered
    checkpoint on another world (or the same one, as 2 nodes: then exactly the uninterrupted
    run's steps): the epoch's samples are trained on exactly once over the two
    runs, every new rank takes the same steps (DDP on every rank: no hang), and the epochs
    after it are the new world's own balanced ones."""
    nodes, ranks_per_node, workers = ELASTIC_WORLDS[world]
    shuffle = "--shuffle-buffer=1000"
    reference = runner.run(
        EPOCHS_SCRIPT, epochs_args(data, f"--state={runner.root / 'reference-shuffled'}", shuffle)
    )
    per_epoch = reference.steps_in(0, 0)
    stop = stop_epoch * per_epoch + per_epoch // 2
    state = runner.new_dir("elastic-state")
    first = runner.run(
        EPOCHS_SCRIPT,
        epochs_args(data, shuffle, f"--state={state}", f"--steps-limit={stop}"),
        log_dir=runner.new_dir("elastic-first"),
        cached=False,
    )
    check_lockstep_epochs(first, range(stop_epoch))
    args = epochs_args(data, shuffle, f"--resume={state}", f"--workers={workers}")
    second = runner.run(EPOCHS_SCRIPT, args, nodes=nodes, ranks_per_node=ranks_per_node)
    check_lockstep_epochs(second, range(stop_epoch, EPOCHS))
    for epoch in range(stop_epoch):
        assert first.epoch_keys(epoch) == reference.epoch_keys(epoch)
    trained = Counter(first.epoch_keys(stop_epoch) + second.epoch_keys(stop_epoch))
    assert not [k for k, n in trained.items() if n > 1], "a sample trained twice in the epoch"
    assert set(trained) == set(reference.epoch_keys(stop_epoch)), (
        f"missing {sorted(set(reference.epoch_keys(stop_epoch)) - set(trained))}"
    )
    if (second.world_size, workers) == (2, WORKERS):  # the same world: the same sequence
        for rank in range(2):
            assert first.steps[rank] + second.steps[rank] == reference.steps[rank]
    consumers = second.world_size * workers
    # The new world's own epochs: balanced ("drop") with several ranks, whole on one.
    whole = NUM_SAMPLES if second.world_size == 1 else consumers * (NUM_SAMPLES // consumers)
    for epoch in range(stop_epoch + 1, EPOCHS):
        seen = second.epoch_keys(epoch)
        assert len(seen) == len(set(seen)) == whole


def check_lockstep_epochs(run: Run, epochs: range) -> None:
    """Every rank trained the same number of steps in each of ``epochs``."""
    for epoch in epochs:
        steps = {rank: run.steps_in(rank, epoch) for rank in range(run.world_size)}
        assert len(set(steps.values())) == 1, f"epoch {epoch}: steps per rank {steps}"


# Three datasets mixed 0.5 / 0.3 / 0.2 by per-epoch counts (of 200): 25 / 15 / 10 samples per
# rank x worker with 2 x 2; dataset 1 has 40 samples (10 per worker: read again to give 15).
MIX_SIZES = ((30, 25, 45), (20, 20), (17, 23, 10))
MIX_COUNTS = (100, 60, 40)


@pytest.fixture(scope="module")
def mix_specs(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("mix-data")
    specs = []
    for number, sizes in enumerate(MIX_SIZES):
        directory = root / f"d{number}"
        directory.mkdir()
        rng = np.random.default_rng(number)
        for shard, size in enumerate(sizes):
            with tarfile.open(directory / f"train-{shard:06d}.tar", "w") as tar:
                for index in range(size):
                    features = io.BytesIO()
                    np.save(features, rng.standard_normal(FEATURES).astype(np.float32))
                    label = str(index % CLASSES).encode()
                    for ext, payload in (("npy", features.getvalue()), ("cls", label)):
                        info = tarfile.TarInfo(f"d{number}-{sample_key(shard, index)}.{ext}")
                        info.size = len(payload)
                        tar.addfile(info, io.BytesIO(payload))
        specs.append(f"{directory}/train-{{000000..{len(sizes) - 1:06d}}}.tar")
    return ",".join(specs)


def test_mix_by_counts_keeps_its_proportions_and_resumes_exactly(
    runner: Runner, mix_specs: str
) -> None:
    """``WeightedMix(..., counts=[100, 60, 40])`` of three datasets, 2 ranks x 2 workers,
    shuffle buffers in each: every epoch, every rank trains on exactly 50 / 30 / 20 of them,
    in lockstep, reshuffled per epoch; stopped mid-epoch 0 and mid-epoch 1 and resumed, the
    run trains on exactly the uninterrupted run's batches."""
    mix = ["--mix-counts=" + ",".join(map(str, MIX_COUNTS)), "--shuffle-buffer=20"]
    args = [*common_args(mix_specs), *mix]
    reference = runner.run(EPOCHS_SCRIPT, [*args, f"--state={runner.new_dir('mix-reference')}"])
    check_lockstep(reference)
    for rank in range(reference.world_size):
        for epoch in range(EPOCHS):
            sources = Counter(key.split("-")[0] for key in reference.keys(rank, epoch))
            assert sources == {"d0": 50, "d1": 30, "d2": 20}, f"rank {rank}, epoch {epoch}"
    check_new_order_each_epoch(reference)
    per_epoch = reference.steps_in(0, 0)
    log_dir = runner.new_dir("mix-resumed")
    previous: Path | None = None
    for stop in (per_epoch // 2, per_epoch + per_epoch // 2 + 1, None):
        state = runner.new_dir("mix-state")
        extra = [f"--state={state}"]
        extra += [f"--resume={previous}"] if previous is not None else []
        extra += [f"--steps-limit={stop}"] if stop is not None else []
        part = runner.run(EPOCHS_SCRIPT, [*args, *extra], log_dir=log_dir, cached=False)
        previous = state
    for rank in range(reference.world_size):
        assert part.steps[rank] == reference.steps[rank], f"rank {rank}"


def test_mix_by_counts_restores_on_another_world(runner: Runner, mix_specs: str) -> None:
    """The same mix stopped on 2 ranks x 2 workers mid-epoch 0 and restored on 3 x 1: the
    epoch holds each dataset's count (less at most 2 left out to keep the ranks' batches
    equal), no sample of a dataset twice unless it is upsampled (d1), the ranks in lockstep."""
    mix = ["--mix-counts=" + ",".join(map(str, MIX_COUNTS)), "--shuffle-buffer=20"]
    args = [*common_args(mix_specs), *mix]
    state = runner.new_dir("mix-elastic-state")
    first = runner.run(
        EPOCHS_SCRIPT,
        [*args, f"--state={state}", "--steps-limit=7"],
        log_dir=runner.new_dir("mix-elastic-first"),
        cached=False,
    )
    second = runner.run(
        EPOCHS_SCRIPT, [*args, f"--resume={state}", "--workers=1"], ranks_per_node=3
    )
    check_lockstep_epochs(second, range(EPOCHS))
    trained = first.epoch_keys(0) + second.epoch_keys(0)
    for name, count in zip(("d0", "d1", "d2"), MIX_COUNTS, strict=True):
        keys = [key for key in trained if key.startswith(name + "-")]
        assert count - 2 <= len(keys) <= count, (name, len(keys))
        if name != "d1":
            assert len(keys) == len(set(keys)), f"{name}: a sample twice in the epoch"


# Remote shards and no sample counts anywhere: 32 shards x 15 samples, uniform.
COUNT_FREE_SHARDS, COUNT_FREE_SAMPLES = 32, 15


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_epochs_without_counts_read_no_counting_pass(
    runner: Runner, http_server: NginxServer, cloudsim_process: Any, layout: str
) -> None:
    """Balanced epochs over HTTP with no index, no metadata and no counts on the node: no rank
    reads the dataset to count it; the ranks end epoch 0 together (count-free), noting each
    shard's count as they read it, and epoch 1 is balanced by those counts. The store serves
    the dataset about once per epoch (a counting pass would add it once per node)."""
    root, sizes = _count_free_shards(http_server, f"count-free-{layout}")
    sim = cloudsim_process(http_server.base_url)
    spec = f"{sim.url}/{root.name}/train-{{000000..{COUNT_FREE_SHARDS - 1:06d}}}.tar"
    counts = runner.new_dir("count-free-counts")
    run = runner.run(
        EPOCHS_SCRIPT,
        common_args(spec),
        nodes=LAYOUTS[layout],
        env={"CLOUDSHARDS_COUNTS_DIR": str(counts)},
        cached=False,
    )
    check_lockstep(run)
    output = "".join(node.stdout + node.stderr for node in run.result.nodes)
    assert "counting the samples" not in output
    total = COUNT_FREE_SHARDS * COUNT_FREE_SAMPLES
    for epoch in range(EPOCHS):
        seen = run.epoch_keys(epoch)
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample twice"
    consumers = run.world_size * WORKERS
    # Epoch 1 is balanced by the counts noted in epoch 0: T // C per rank x worker.
    assert len(run.epoch_keys(1)) == consumers * (total // consumers)
    # Epoch 0 (count-free, uniform shards split evenly) delivers everything.
    assert len(run.epoch_keys(0)) == total
    served = sim.stats().bytes_sent
    assert served <= 1.1 * EPOCHS * sum(sizes), (served, sum(sizes))
    if layout != "2x2":
        return

    # Stopped mid-epoch 0 (count-free) and resumed from StatefulLoader's state: the same
    # steps as an uninterrupted run, in epoch 0 and in epoch 1 (balanced by the counts noted).
    def launch(*extra: str, counts: Path, log_dir: Path | None = None) -> Run:
        env = {"CLOUDSHARDS_COUNTS_DIR": str(counts)}
        args = [*common_args(spec), *extra]
        return runner.run(EPOCHS_SCRIPT, args, env=env, cached=False, log_dir=log_dir)

    reference = launch(f"--state={runner.new_dir('cf-ref')}", counts=runner.new_dir("cf-c1"))
    counts = runner.new_dir("cf-c2")
    log_dir = runner.new_dir("cf-resumed")
    state = runner.new_dir("cf-state")
    stop = reference.steps_in(0, 0) // 2
    launch(f"--state={state}", f"--steps-limit={stop}", counts=counts, log_dir=log_dir)
    resumed = launch(f"--resume={state}", counts=counts, log_dir=log_dir)
    for rank in range(resumed.world_size):
        assert resumed.steps[rank] == reference.steps[rank], f"rank {rank}"

    # Resumed where the counts noted before the stop are not (another node, an empty counts
    # directory): they travel with the checkpoint, and epoch 1 is balanced by every count
    # as in the uninterrupted run (it once ran without counts again, other samples).
    log_dir, state = runner.new_dir("cf-moved"), runner.new_dir("cf-moved-state")
    here = runner.new_dir("cf-c3")
    launch(f"--state={state}", f"--steps-limit={stop}", counts=here, log_dir=log_dir)
    elsewhere = runner.new_dir("cf-c4")
    resumed = launch(f"--resume={state}", counts=elsewhere, log_dir=log_dir)
    for rank in range(resumed.world_size):
        assert resumed.steps[rank] == reference.steps[rank], f"rank {rank}"

    # Saved after epoch 0 ended (an end-of-epoch checkpoint), resumed elsewhere: epoch 1 is
    # balanced by the counts the state carries, as in the uninterrupted run (it once ran
    # count-free again: other samples on each rank, and on another world some lost).
    log_dir, state = runner.new_dir("cf-ended"), runner.new_dir("cf-ended-state")
    launch(f"--state={state}", "--epochs=1", counts=runner.new_dir("cf-c5"), log_dir=log_dir)
    resumed = launch(f"--resume={state}", counts=runner.new_dir("cf-c6"), log_dir=log_dir)
    for rank in range(resumed.world_size):
        assert resumed.steps[rank] == reference.steps[rank], f"rank {rank}"


def test_the_first_step_reads_one_shard_per_worker(
    runner: Runner, http_server: NginxServer, cloudsim_process: Any
) -> None:
    """2 nodes x 2 ranks x 2 workers, balanced, no counts anywhere, remote shards: a run that
    stops after its first step has read from the store at most one shard per DataLoader worker
    (shards ahead turned off, so that what is read is what the first batches need), where a
    counting pass would read the whole dataset on each node before the first sample."""
    root, sizes = _count_free_shards(http_server, "count-free-first-step")
    sim = cloudsim_process(http_server.base_url)
    spec = f"{sim.url}/{root.name}/train-{{000000..{COUNT_FREE_SHARDS - 1:06d}}}.tar"
    env = {"CLOUDSHARDS_COUNTS_DIR": str(runner.new_dir("first-step")), "CLOUDSHARDS_PREFETCH": "0"}
    run = runner.run(
        EPOCHS_SCRIPT, [*common_args(spec), "--steps-limit=1"], nodes=2, env=env, cached=False
    )
    assert all(run.steps_in(rank, 0) == 1 for rank in range(run.world_size))
    output = "".join(node.stdout + node.stderr for node in run.result.nodes)
    assert "counting the samples" not in output
    consumers = run.world_size * WORKERS
    served = sim.stats().bytes_sent
    # The metadata probes (an index, sizes.json...) find nothing here: 404s, with small bodies.
    assert served <= consumers * max(sizes) + 64 * 1024, (served, sizes)
    assert served < sum(sizes) / 2  # well short of one counting pass (one per node: 2x)


def test_a_plain_dataloader_counts_once_per_job(
    runner: Runner, http_server: NginxServer, cloudsim_process: Any
) -> None:
    """2 nodes x 2 ranks x 2 workers with a plain ``torch.utils.data.DataLoader`` (no count-free
    epoch without cloudshards' loaders), balanced, no counts on either node (a counts directory
    each, as separate machines have): each node counts half the shards and takes the other
    half's counts from the rendezvous store, so the job reads the dataset once to count it,
    not once per node. Both epochs balanced, in lockstep, every sample at most once."""
    root, sizes = _count_free_shards(http_server, "count-once-per-job")
    sim = cloudsim_process(http_server.base_url)
    spec = f"{sim.url}/{root.name}/train-{{000000..{COUNT_FREE_SHARDS - 1:06d}}}.tar"
    counts = runner.new_dir("count-once")
    env = {"CLOUDSHARDS_COUNTS_DIR": f"{counts}/node-{NODE_RANK}"}
    run = runner.run(
        EPOCHS_SCRIPT, [*common_args(spec), "--torch-loader"], nodes=2, env=env, cached=False
    )
    check_lockstep(run)
    output = "".join(node.stdout + node.stderr for node in run.result.nodes)
    assert output.count("to balance ranks, this node's 1/2 of them") == 2, output
    assert "did not share their sample counts" not in output
    total = COUNT_FREE_SHARDS * COUNT_FREE_SAMPLES
    consumers = run.world_size * WORKERS
    for epoch in range(EPOCHS):
        seen = run.epoch_keys(epoch)
        assert len(seen) == len(set(seen)) == consumers * (total // consumers)
    for node in range(2):  # each node saved every shard's count
        (saved,) = [p for p in (counts / f"node-{node}").iterdir() if len(p.name) == 32]
        assert sorted(json.loads(saved.read_text()).values()) == [COUNT_FREE_SAMPLES] * 32
    # One counting pass for the job (a node's would be one per node: 4x in all) and the epochs.
    served = sim.stats().bytes_sent
    assert served <= 1.1 * (1 + EPOCHS) * sum(sizes), (served, sum(sizes))


def _count_free_shards(http_server: NginxServer, name: str) -> tuple[Path, list[int]]:
    """COUNT_FREE_SHARDS uniform shards under the server's root; their sizes in bytes."""
    root = http_server.root / name
    root.mkdir(parents=True)
    sizes = [0] * COUNT_FREE_SHARDS
    rng = np.random.default_rng(7)
    for shard in range(COUNT_FREE_SHARDS):
        with tarfile.open(root / f"train-{shard:06d}.tar", "w") as tar:
            for index in range(COUNT_FREE_SAMPLES):
                for ext, payload in _sample(rng, shard, index):
                    info = tarfile.TarInfo(f"{sample_key(shard, index)}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        sizes[shard] = (root / f"train-{shard:06d}.tar").stat().st_size
    return root, sizes


def _sample(rng: Any, shard: int, index: int) -> list[tuple[str, bytes]]:
    features = io.BytesIO()
    np.save(features, rng.standard_normal(FEATURES).astype(np.float32))
    return [("npy", features.getvalue()), ("cls", str((shard + index) % CLASSES).encode())]


# ------------------------------------------------------------------------------ resampled


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resampled_with_epoch(runner: Runner, data: Data, layout: str) -> None:
    """``resampled=True`` + ``with_epoch``: exactly workers x n batches per rank per epoch,
    valid keys, different draws on every rank and in every epoch."""
    run = runner.run(RESAMPLED_SCRIPT, resampled_args(data), nodes=LAYOUTS[layout])
    check_lockstep(run)
    consumers = run.world_size * WORKERS
    per_worker = RESAMPLED_SAMPLES_PER_EPOCH // (consumers * BATCH_SIZE)
    for rank in range(run.world_size):
        for epoch in range(EPOCHS):
            assert run.steps_in(rank, epoch) == WORKERS * per_worker
            assert len(run.keys(rank, epoch)) == WORKERS * per_worker * BATCH_SIZE
            assert set(run.keys(rank, epoch)) <= set(data.keys)
    assert len({tuple(run.keys(rank, 0)) for rank in range(run.world_size)}) == run.world_size
    check_new_order_each_epoch(run)


def test_resampled_rerun_is_identical(runner: Runner, data: Data) -> None:
    run = runner.run(RESAMPLED_SCRIPT, resampled_args(data))
    again = runner.run(RESAMPLED_SCRIPT, resampled_args(data), cached=False)
    check_same_run(run, again)


# ------------------------------------------------------------------------------ indexed


class _Sizes:
    """Stands in for the dataset when asking the sampler what it promises."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def shard_ranges(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(itertools.accumulate(SHARD_SIZES, initial=0)))


def promised(world_size: int, rank: int, epoch: int, keys: list[str]) -> list[str]:
    sampler = wds.DistributedChunkedSampler(_Sizes(), num_replicas=world_size, rank=rank, seed=SEED)
    sampler.set_epoch(epoch)
    return [keys[i] for i in sampler]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_indexed_chunked_sampler(runner: Runner, data: Data, layout: str) -> None:
    """``IndexedDataset`` + ``DistributedChunkedSampler``: each rank trains on exactly the
    samples the sampler assigns it (ceil(N / ranks), no repeat within a rank), the ranks
    together on the whole dataset, padded by at most ranks - 1; a new order per epoch."""
    run = runner.run(INDEXED_SCRIPT, indexed_args(data), nodes=LAYOUTS[layout])
    check_lockstep(run)
    world = run.world_size
    for epoch in range(EPOCHS):
        for rank in range(world):
            got = run.keys(rank, epoch)
            assert got == promised(world, rank, epoch, data.keys), f"rank {rank} epoch {epoch}"
            assert len(got) == math.ceil(NUM_SAMPLES / world)
            assert len(set(got)) == len(got), f"rank {rank} epoch {epoch}: a repeated sample"
        seen = run.epoch_keys(epoch)
        assert set(seen) == set(data.keys)
        assert len(seen) - NUM_SAMPLES == world * math.ceil(NUM_SAMPLES / world) - NUM_SAMPLES
    check_new_order_each_epoch(run)


def test_indexed_rerun_is_identical(runner: Runner, data: Data) -> None:
    run = runner.run(INDEXED_SCRIPT, indexed_args(data))
    again = runner.run(INDEXED_SCRIPT, indexed_args(data), cached=False)
    check_same_run(run, again)


# ------------------------------------------------------------------------------ S3


def _moto_gets(log: Path, offset: int) -> Counter[str]:
    """GETs per object path that moto logged after ``offset`` (werkzeug request lines)."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = re.findall(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})', text)
    # Balanced epochs look for an index, then for dataset tools' metadata (sizes.json, timm's
    # _info.json/info.json, img2dataset's *_stats.json) next to the shards: 404s expected.
    probes = (".index.json", "/sizes.json", "/_info.json", "/info.json", "_stats.json")
    errors = [line for line in lines if int(line[2]) >= 400 and not line[1].endswith(probes)]
    assert not errors, f"moto answered errors: {errors}"
    return Counter(path.split("?", 1)[0] for method, path, _ in lines if method == "GET")


def _shard_gets(log: Path, offset: int) -> dict[str, int]:
    # Other GETs are bucket listings (s3fs looking for the index that is not there).
    return {path: n for path, n in _moto_gets(log, offset).items() if path.endswith(".tar")}


@pytest.fixture(scope="module")
def s3_shards(s3_server: S3Server, data: Data) -> str:
    fs = s3_server.filesystem()
    fs.mkdir(BUCKET)
    names = sorted(p.name for p in data.root.glob("train-*.tar"))
    fs.put([str(data.root / n) for n in names], [f"{BUCKET}/{n}" for n in names])
    return f"s3://{BUCKET}/train-{{000000..{len(SHARD_SIZES) - 1:06d}}}.tar"


def test_epochs_over_s3_with_node_cache(
    runner: Runner, data: Data, s3_server: S3Server, s3_shards: str, tmp_path: Path
) -> None:
    """The epochs mode reading ``s3://`` (moto) through a node cache: the same steps as from
    local disk with the same seed, and every shard crossed the network once for the whole
    run (counting pass, 2 epochs, 2 ranks x 2 workers)."""
    local = runner.run(EPOCHS_SCRIPT, epochs_args(data))
    log = s3_server.process.log_path
    # The yardstick: the GETs that download every shard into a cache once, in this process
    # (how many GETs one shard takes is the reader's business: parts, ranges).
    offset = log.stat().st_size
    plain = wds.WebDataset(
        s3_shards,
        shardshuffle=False,
        storage_options={"s3": s3_server.storage_options()},
        cache_dir=str(tmp_path / "yardstick-cache"),
    )
    assert sorted(s["__key__"] for s in plain) == sorted(data.keys)
    one_read = _shard_gets(log, offset)
    shard_paths = {f"/{BUCKET}/train-{i:06d}.tar" for i in range(len(SHARD_SIZES))}
    assert set(one_read) == shard_paths, one_read

    offset = log.stat().st_size
    cache_dir = tmp_path / "cache"
    remote = runner.run(
        EPOCHS_SCRIPT,
        [*common_args(s3_shards), f"--cache-dir={cache_dir}"],
        # Counted first (not count-free): the same balanced steps as the local run.
        env={
            **s3_server.env(),
            "CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts"),
            "CLOUDSHARDS_COUNT_FREE": "0",
        },
        cached=False,
    )
    check_lockstep(remote)
    for rank in range(remote.world_size):
        local_keys = [s.keys for s in local.steps[rank]]
        assert [s.keys for s in remote.steps[rank]] == local_keys, f"rank {rank}"
    # A shard downloaded twice would show at least twice its one-download GETs. (Not equal:
    # the counting pass downloads through the cache with a single GET where the reader may
    # take two ranged GETs of a larger shard.)
    gets = _shard_gets(log, offset)
    assert set(gets) == shard_paths
    assert all(gets[path] <= one_read[path] for path in shard_paths), (
        f"GETs per shard with a node cache, for a counting pass and 2 epochs on 2 ranks x 2 "
        f"workers: {gets}; downloading each shard once makes {one_read}"
    )
    info = wds.cache_info(cache_dir)
    dataset_bytes = sum(p.stat().st_size for p in data.root.glob("train-*.tar"))
    assert (info["entries"], info["bytes"], info["partial"]) == (
        len(SHARD_SIZES),
        dataset_bytes,
        0,
    ), info


# ------------------------------------------------------------------------------ the launcher

HANG_SCRIPT = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
if os.environ["RANK"] == "0":
    time.sleep(3600)  # a rank stuck forever, like one waiting in an all-reduce
"""


def test_launcher_kills_a_hung_run(tmp_path: Path) -> None:
    """A run that hangs ends at the timeout as a failure naming it, with every rank killed,
    after each printed where it waited."""
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    result = torchrun(script, [str(tmp_path)], nproc_per_node=2, timeout_s=10)
    assert result.timed_out
    assert not result.ok
    stderr = result.nodes[0].stderr
    assert re.search(r'File ".*hang\.py", line 6 in <module>', stderr), stderr[-3000:]
    with pytest.raises(AssertionError, match="TIMED OUT"):
        result.check(2)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    assert not [pid for pid in pids if is_running(pid)], "ranks left running after the kill"
