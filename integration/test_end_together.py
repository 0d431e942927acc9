"""Balanced epochs under DDP whose pipelines drop samples after the reader: every rank still
takes the same steps, because cloudshards' loaders end each epoch together.

The shards are the uneven ones of ``test_distributed`` with three samples of shard 1 damaged
(their ``npy`` does not decode). ``examples/train_epochs.py --skip-bad`` decodes with
``warn_and_continue``, so the worker that reads shard 1 yields three samples fewer than
balancing handed it: a batch fewer for its rank, which without the check would leave the
other rank's last step waiting at DDP's all-reduce (or, over several epochs, all-reducing
with the short rank's next epoch).
"""

from __future__ import annotations

import io
import re
import tarfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_distributed import (
    BATCH_SIZE,
    COUNT_FREE_SHARDS,
    EPOCHS,
    EPOCHS_SCRIPT,
    SHARD_SIZES,
    TEST_TIMEOUT_S,
    Run,
    Runner,
    _count_free_shards,
    check_lockstep,
    common_args,
    sample_key,
    write_shards,
)
from torchrun_util import torchrun

if TYPE_CHECKING:
    from servers import NginxServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]

#: Shard 1's damaged samples: 3 of the 27 samples its worker is handed, so 5 batches of 5
#: where the others have 6.
DAMAGED = tuple(sample_key(1, index) for index in (5, 6, 7))
SOLO_SCRIPT = Path(__file__).with_name("solo_loader.py")
EDGES_SCRIPT = Path(__file__).with_name("end_together_edges.py")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """The shards, three samples of shard 1 damaged; their spec and every key."""
    root = tmp_path_factory.mktemp("end-together") / "shards"
    keys = write_shards(root)
    _damage(root / "train-000001.tar", DAMAGED)
    spec = f"{root}/train-{{000000..{len(SHARD_SIZES) - 1:06d}}}.tar"
    return spec, keys


def _damage(path: Path, keys: tuple[str, ...]) -> None:
    """Rewrite ``path`` with the ``npy`` member of each of ``keys`` replaced by garbage."""
    with tarfile.open(path) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if info.name.endswith(".npy") and info.name.split(".")[0] in keys:
                data = b"not an npy array"
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    root = tmp_path_factory.mktemp("end-together-runs")
    return Runner(root, env={"CLOUDSHARDS_COUNTS_DIR": str(root / "counts")})


def _check_epochs(run: Run, keys: list[str]) -> None:
    check_lockstep(run)
    for epoch in range(EPOCHS):
        seen = run.epoch_keys(epoch)
        assert not [k for k, n in Counter(seen).items() if n > 1], f"epoch {epoch}: a repeat"
        assert not set(seen) & set(DAMAGED)
        # At most a batch per rank left out by ending together, beyond balance="drop"'s few.
        assert len(seen) >= len(keys) - len(DAMAGED) - run.world_size * (BATCH_SIZE + 2)


@pytest.mark.parametrize("loader", ["WebLoader", "StatefulLoader"])
def test_samples_dropped_after_the_reader_never_leave_a_rank_short(
    runner: Runner, damaged: tuple[str, list[str]], tmp_path: Path, loader: str
) -> None:
    spec, keys = damaged
    extra = ["--skip-bad"] + ([f"--state={tmp_path}"] if loader == "StatefulLoader" else [])
    run = runner.run(EPOCHS_SCRIPT, [*common_args(spec), *extra], cached=False)
    output = run.result.stdout + "".join(node.stderr for node in run.result.nodes)
    assert "s1-005.npy" in output  # the damage was met (and skipped) in this run
    _check_epochs(run, keys)


def test_a_checkpoint_after_an_epoch_ended_together_resumes_at_the_next_epoch(
    runner: Runner, damaged: tuple[str, list[str]]
) -> None:
    """The rank that still had a batch when the other ran out says, in its loader's state, that
    its epoch ended: a run stopped after epoch 0 and resumed trains epoch 1 exactly as an
    uninterrupted run does (not the one batch left of epoch 0 on one rank)."""
    spec, keys = damaged
    args = [*common_args(spec), "--skip-bad"]
    reference = runner.run(
        EPOCHS_SCRIPT, [*args, f"--state={runner.new_dir('ref-state')}"], cached=False
    )
    _check_epochs(reference, keys)
    state, log_dir = runner.new_dir("state"), runner.new_dir("resumed")
    first = [a if not a.startswith("--epochs") else "--epochs=1" for a in args]
    runner.run(EPOCHS_SCRIPT, [*first, f"--state={state}"], log_dir=log_dir, cached=False)
    resumed = runner.run(EPOCHS_SCRIPT, [*args, f"--resume={state}"], log_dir=log_dir, cached=False)
    for rank in range(resumed.world_size):
        assert resumed.steps[rank] == reference.steps[rank], f"rank {rank}"


def test_a_loader_only_rank_0_iterates_waits_once_then_runs_alone(
    damaged: tuple[str, list[str]], tmp_path: Path
) -> None:
    """Not every rank iterates a balanced loader (an evaluation on rank 0): rank 0 waits for
    the others once (``CLOUDSHARDS_RANKS_WAIT_S``), says so, and then reads its share every
    epoch without waiting or checking again; nothing hangs."""
    spec, keys = damaged
    env = {"CLOUDSHARDS_RANKS_WAIT_S": "3", "CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts")}
    result = torchrun(SOLO_SCRIPT, [spec, "solo"], nproc_per_node=2, env=env, timeout_s=120)
    assert result.ok, result.describe()
    output = result.stdout + "".join(node.stderr for node in result.nodes)
    assert output.count("not every rank iterates this loader") == 1, output
    share = len(keys) // 2  # balance="drop" over 2 ranks x 1 worker
    dropped = sum(1 for key in keys[:share] if key in ("s1-005", "s1-006", "s1-007"))
    for epoch in range(2):
        assert f"rank 0: epoch {epoch}, {share - dropped} samples" in output, output
    assert "rank 1 done" in output


def test_a_rank_late_to_a_later_epoch_keeps_the_check(
    http_server: NginxServer, tmp_path: Path
) -> None:
    """Remote shards without counts (epoch 0 count-free); rank 0 comes later than
    CLOUDSHARDS_RANKS_WAIT_S to epoch 1's meeting (a long validation): that epoch balances
    by counts and the ranks still end every epoch together (the late meeting once switched
    the check off for good: unequal batches, then a hang)."""
    root, _ = _count_free_shards(http_server, "end-together-late")
    spec = f"{http_server.base_url}/{root.name}/train-{{000000..{COUNT_FREE_SHARDS - 1:06d}}}.tar"
    env = {
        "CLOUDSHARDS_RANKS_WAIT_S": "3",
        "LATE_S": "6",
        "CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts"),
    }
    result = torchrun(SOLO_SCRIPT, [spec, "late"], nproc_per_node=2, env=env, timeout_s=180)
    assert result.ok, result.describe()
    output = result.stdout + "".join(node.stderr for node in result.nodes)
    assert "came over 3 s late to epoch 1" in output, output
    _check_equal_batches(result.stdout, epochs=3)


def _check_equal_batches(output: str, epochs: int) -> None:
    for epoch in range(epochs):
        counts = {
            rank: re.search(rf"rank {rank}: epoch {epoch}, (\d+) batches", output)
            for rank in range(2)
        }
        assert all(counts.values()), output
        assert len({match.group(1) for match in counts.values() if match}) == 1, output


def test_a_look_at_one_batch_on_one_rank_takes_no_part_in_the_check(
    damaged: tuple[str, list[str]], tmp_path: Path
) -> None:
    """Rank 0 alone looks at a batch (``next(iter(loader))``) before training: the look
    takes no part in the ranks' collective steps, and training still ends each epoch together
    (the look once took the first epoch's meeting and one of its checks: a hang)."""
    spec, _ = damaged
    env = {"CLOUDSHARDS_RANKS_WAIT_S": "5", "CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts")}
    result = torchrun(SOLO_SCRIPT, [spec, "peek"], nproc_per_node=2, env=env, timeout_s=120)
    assert result.ok, result.describe()
    _check_equal_batches(result.stdout, epochs=2)


def _small_shards(root: Path, sizes: list[int]) -> None:
    """Shards ``a{s}.tar`` of ``sizes[s]`` one-member samples keyed ``a{s}-{i:03d}``."""
    root.mkdir(parents=True, exist_ok=True)
    for shard, size in enumerate(sizes):
        with tarfile.open(root / f"a{shard}.tar", "w") as tar:
            for index in range(size):
                data = f"a{shard}-{index:03d}".encode()
                info = tarfile.TarInfo(f"a{shard}-{index:03d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _steps(output: str, mode: str, epoch: int, world: int) -> list[int]:
    found = [
        re.search(rf"rank {rank} {mode} epoch {epoch}: (\d+) steps", output)
        for rank in range(world)
    ]
    assert all(found), output
    return [int(match.group(1)) for match in found if match]


def test_a_checkpoint_at_the_last_step_of_an_epoch_ended_together_restores_without_a_hang(
    tmp_path: Path,
) -> None:
    """A select drops shard 0 whole: rank 0 runs out first, the ranks end the epoch together,
    and rank 1's last batches are dropped. A checkpoint saved after that last step (every
    step here) restores to an epoch with nothing left on any rank: every rank takes 0 steps.
    Rank 1 once took a batch unchecked while rank 0 waited in the check: a hang, at every
    restart from that checkpoint."""
    _small_shards(tmp_path / "shards", [20, 20, 20, 20])
    spec = f"{tmp_path / 'shards'}/a{{0..3}}.tar"
    env = {"CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts")}
    saved = torchrun(EDGES_SCRIPT, ["restore", "save", spec, str(tmp_path)], env=env)
    assert saved.ok, saved.describe()
    steps = _steps(saved.stdout, "save", 0, 2)
    assert len(set(steps)) == 1, saved.stdout
    assert steps[0] > 0, saved.stdout
    resumed = torchrun(
        EDGES_SCRIPT, ["restore", "resume", spec, str(tmp_path)], env=env, timeout_s=120
    )
    assert resumed.ok, resumed.describe()
    assert _steps(resumed.stdout, "resume", 0, 2) == [0, 0]


def test_the_group_the_ranks_end_epochs_through_is_gone_before_the_interpreter_exits(
    tmp_path: Path,
) -> None:
    """Ending epochs together talks through a gloo group of cloudshards' own. Alive when the
    interpreter finalizes, its worker thread could abort the finished job ("terminate called
    without an active exception"): the job's own group is destroyed by then, cloudshards'
    must be too. Every rank's gloo threads are counted in its last exit handler."""
    _small_shards(tmp_path / "shards", [20, 20, 20, 20])
    spec = f"{tmp_path / 'shards'}/a{{0..3}}.tar"
    env = {"CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts")}
    result = torchrun(EDGES_SCRIPT, ["restore", "save", spec, str(tmp_path)], env=env)
    assert result.ok, result.describe()
    assert len(set(_steps(result.stdout, "save", 0, 2))) == 1, result.stdout
    for rank in range(2):
        assert f"rank {rank} gloo threads at exit: 0" in result.stdout, result.stdout


@pytest.mark.parametrize("last", [3, 0], ids=["3 samples", "empty"])
def test_a_count_free_epoch_where_a_rank_has_no_batch_ends_together(
    http_server: NginxServer, tmp_path: Path, last: int
) -> None:
    """Remote shards of 20, 20 and 3 (or 0) samples, no counts: epoch 0 runs count-free, one
    whole shard per rank, and the rank with the last shard has no batch of 4. Every rank takes
    the same steps (none: the first to run out ends the epoch); epoch 1 balances by the counts
    epoch 0 noted. The other ranks once took a first step unchecked: a hang; an empty shard
    once failed the job as "No samples found ... fewer shards than workers"."""
    name = f"end-together-short-{last}"
    _small_shards(http_server.root / name, [20, 20, last])
    spec = f"{http_server.base_url}/{name}/a{{0..2}}.tar"
    env = {"CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts")}
    result = torchrun(EDGES_SCRIPT, ["short", spec], nproc_per_node=3, env=env, timeout_s=120)
    assert result.ok, result.describe()
    output = result.stdout + "".join(node.stderr for node in result.nodes)
    assert "epoch 0 runs without sample counts" in output, output
    assert _steps(result.stdout, "short", 0, 3) == [0, 0, 0]
    assert _steps(result.stdout, "short", 1, 3) == [3, 3, 3]  # 43 (40) samples: 14 (13) each
