"""The DDP hang webdataset users report, ended: a 2-rank PyTorch Lightning run (CPU, gloo) over
shards of uneven sizes, with webdataset-style code (``nodesplitter=split_by_node``, a plain
DataLoader), finishes with the same number of steps on both ranks and no sample twice.

The run is a subprocess in a session of its own with a timeout: a hang fails the test and
every process it started is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cloudshards as wds

SIZES = [3, 40, 11, 7, 29, 5, 16]  # 111 samples: no even split across 2 ranks x 2 workers
SCRIPT = Path(__file__).with_name("lightning_train.py")
RESUME_SCRIPT = Path(__file__).with_name("lightning_resume.py")
HANGDUMP = Path(__file__).with_name("hangdump")
TIMEOUT_S = 240


def write_shards(root: Path) -> str:
    for shard, count in enumerate(SIZES):
        with wds.TarWriter(str(root / f"shard-{shard:06d}.tar")) as sink:
            for i in range(count):
                features = np.random.default_rng(i).random(8).astype("float32")
                sink.write({"__key__": f"s{shard}_{i}", "npy": features, "cls": i % 4})
    return str(root / f"shard-{{000000..{len(SIZES) - 1:06d}}}.tar")


def _lightning(
    tmp_path: Path, script: Path, *args: str, devices: int = 2, prefetched: str = "1"
) -> str:
    """Run a Lightning script in a session of its own; its output. A hang (past TIMEOUT_S)
    or a failed run fails the test, and every process the run started is killed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLOUDSHARDS_", "WDS_"))}
    env["CLOUDSHARDS_COUNTS_DIR"] = str(tmp_path / "counts")
    env["DEVICES"] = str(devices)
    env["PREFETCHED"] = prefetched
    # Every process prints its threads' stacks on SIGUSR1 (hangdump/sitecustomize.py).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HANGDUMP), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Every process of the run (ranks and their DataLoader workers) prints its threads'
        # stacks (see hangdump/sitecustomize.py), then all are killed.
        os.killpg(process.pid, signal.SIGUSR1)
        try:
            output, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the DDP run hung:\n{output.decode(errors='replace')[-30000:]}")
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-4000:]
    return text


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_ddp_over_uneven_shards_does_not_hang(tmp_path: Path, workers: int) -> None:
    spec = write_shards(tmp_path)
    out = tmp_path / "keys"
    out.mkdir()
    text = _lightning(tmp_path, SCRIPT, spec, "2", str(workers), str(out))
    steps = {int(r): int(n) for r, n in re.findall(r"RANK (\d) steps (\d+)", text)}
    assert set(steps) == {0, 1}, text[-4000:]
    consumers = 2 * max(workers, 1)
    per_consumer = sum(SIZES) // consumers
    batches = -(-per_consumer // 4) * max(workers, 1)  # per rank and epoch
    assert steps[0] == steps[1] == 2 * batches
    keys = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    everything = {f"s{shard}_{i}" for shard, count in enumerate(SIZES) for i in range(count)}
    orders = []
    for epoch in ("0", "1"):
        both = keys[0][epoch] + keys[1][epoch]
        assert len(both) == len(set(both)) == per_consumer * consumers  # no sample twice
        assert set(both) <= everything
        orders.append(both)
    assert orders[0] != orders[1]  # reshuffled


def _full_run(tmp_path: Path) -> tuple[str, Path, list[Any]]:
    """(the shard spec, the key directory, each rank's steps) of the resume script's
    uninterrupted 2-rank run."""
    spec = write_shards(tmp_path)
    out = tmp_path / "keys"
    out.mkdir()
    _lightning(tmp_path, RESUME_SCRIPT, spec, "2", str(out), "full")
    return spec, out, [json.loads((out / f"full-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 30)
@pytest.mark.parametrize(
    ("stop", "prefetched"), [("mid-epoch-0", "1"), ("mid-epoch-1", "1"), ("mid-epoch-0", "auto")]
)
def test_lightning_checkpoint_mid_epoch_resumes_exactly(
    tmp_path: Path, stop: str, prefetched: str
) -> None:
    """Lightning saves StatefulDataLoader's state in its checkpoint (every worker's dataset
    state, shuffle buffer included) and restores it with ``fit(ckpt_path=...)``: the steps
    before the checkpoint and after the restore are exactly the uninterrupted run's. Also
    without ``prefetched=1``: the loader reads the batch Lightning fetches ahead off its
    data fetcher (it skipped that batch on restore)."""
    spec, out, full = _full_run(tmp_path)
    per_epoch = len(full[0]) // 2
    assert len(full[0]) == len(full[1]) == 2 * per_epoch
    steps = per_epoch // 2 if stop == "mid-epoch-0" else per_epoch + per_epoch // 2
    run = [spec, "2", str(out)]
    _lightning(tmp_path, RESUME_SCRIPT, *run, "stop", str(steps), prefetched=prefetched)
    checkpoints = sorted((out / "ckpt").glob("*.ckpt"))
    assert len(checkpoints) == 1, checkpoints
    resume = ["resume", str(checkpoints[0])]
    _lightning(tmp_path, RESUME_SCRIPT, *run, *resume, prefetched=prefetched)
    for rank in (0, 1):
        before = json.loads((out / f"stop-rank{rank}.json").read_text())
        after = json.loads((out / f"resume-rank{rank}.json").read_text())
        assert len(before) == steps
        assert before + after == full[rank], f"rank {rank}"


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S + 30)
def test_lightning_checkpoint_of_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """An elastic restore through Lightning: the checkpoint of 2 ranks x 2 workers, taken
    mid-epoch 0, restored on 1 rank: every sample of epoch 0 trained on once over both runs,
    then epoch 1 whole on the one rank."""
    spec, out, full = _full_run(tmp_path)
    per_epoch = len(full[0]) // 2
    epoch0 = [k for rank in (0, 1) for batch in full[rank][:per_epoch] for k in batch]
    _lightning(tmp_path, RESUME_SCRIPT, spec, "2", str(out), "stop", str(per_epoch // 2))
    (checkpoint,) = sorted((out / "ckpt").glob("*.ckpt"))
    _lightning(tmp_path, RESUME_SCRIPT, spec, "2", str(out), "resume", str(checkpoint), devices=1)
    before = [
        k for r in (0, 1) for b in json.loads((out / f"stop-rank{r}.json").read_text()) for k in b
    ]
    after = json.loads((out / "resume-rank0.json").read_text())
    epochs = json.loads((out / "resume-rank0-epochs.json").read_text())
    rest = [k for batch, epoch in zip(after, epochs, strict=True) if epoch == 0 for k in batch]
    assert sorted(before + rest) == sorted(epoch0)  # each sample of epoch 0 once
    epoch1 = [k for batch, epoch in zip(after, epochs, strict=True) if epoch == 1 for k in batch]
    assert sorted(epoch1) == sorted(f"s{s}_{i}" for s, n in enumerate(SIZES) for i in range(n))


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_lightning_ranks_end_together_when_a_filter_empties_one_share(tmp_path: Path) -> None:
    """A ``select`` empties rank 0's whole share: Lightning's own ``iter()`` check of the
    WebLoader spent the ranks' meeting, so rank 1 took its first batch unchecked and waited
    in an all-reduce that rank 0 never joined (a hang in epoch 0)."""
    for shard in range(4):
        with wds.TarWriter(str(tmp_path / f"a{shard}.tar")) as sink:
            for i in range(20):
                sink.write({"__key__": f"a{shard}_{i}", "txt": "x"})
    script = Path(__file__).with_name("lightning_whole_share.py")
    text = _lightning(tmp_path, script, str(tmp_path / "a{0..3}.tar"))
    steps = {int(r): int(n) for r, n in re.findall(r"RANK (\d) steps (\d+)", text)}
    assert steps == {0: 0, 1: 0}, text[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
# Without DataLoader workers: with them, each worker's last batch may be short, and Accelerate
# deals batches of unequal size out unevenly (it expects one size), whatever the dataset.
@pytest.mark.parametrize("dispatch", [True, False])
def test_accelerate_trains_on_every_sample_once_per_epoch(tmp_path: Path, dispatch: bool) -> None:
    """Hugging Face Accelerate divides one reader's stream among the ranks itself (its
    default DataLoaderDispatcher reads on rank 0 only): split by rank as well, each epoch
    trained on half the data with 2 ranks, without a word."""
    from torchrun_util import torchrun

    keys = []
    # Unequal shards, 80 samples: 20 batches of 4, which Accelerate deals to 2 ranks evenly
    # (an odd count it evens out by repeating the first samples).
    for shard, size in enumerate([10, 11, 12, 13, 14, 20]):
        with wds.TarWriter(str(tmp_path / f"a{shard}.tar")) as sink:
            for i in range(size):
                keys.append(str(len(keys)))  # the sample's id, its cls
                sink.write({"__key__": f"a{shard}_{i}", "cls": len(keys) - 1})
    script = Path(__file__).with_name("accelerate_epoch.py")
    args = [str(tmp_path / "a{0..5}.tar"), "0", *([] if dispatch else ["--no-dispatch"])]
    env = {"CLOUDSHARDS_COUNTS_DIR": str(tmp_path / "counts")}
    result = torchrun(script, args, nproc_per_node=2, env=env, timeout_s=300).check(2)
    seen: dict[int, list[str]] = {0: [], 1: []}
    for _rank, epoch, line in re.findall(r"KEYS (\d) (\d) ([\d,]*)", result.stdout):
        seen[int(epoch)] += [key for key in line.split(",") if key]
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == sorted(keys), (epoch, len(seen[epoch]), len(keys))


def _fit_single(
    root: Path, spec: str, limit: int | None, length: int | None, ckpt: Any = None
) -> Any:
    """One process, no workers: the keys of each step trained (epoch, keys), checkpointing
    every step into ``root/ck``; resumed from ``ckpt`` when given."""
    import logging

    import pytorch_lightning as pl
    import torch

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)

    class Keys(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[tuple[int, list[str]]] = []

        def training_step(self, batch: list[str], _: int) -> torch.Tensor:
            self.seen.append((self.current_epoch, list(batch)))
            return self.layer(torch.ones(1, 1)).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dataset = wds.WebDataset(spec, shardshuffle=True, seed=1).map(lambda s: s["__key__"])
    if length is not None:
        dataset = dataset.with_length(length)
    loader = wds.StatefulLoader(dataset, batch_size=4, num_workers=0)
    model = Keys()
    every = pl.callbacks.ModelCheckpoint(
        dirpath=root / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=limit,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[every],
    )
    with warnings.catch_warnings():  # Lightning's and torch's own, about the setup
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, ckpt_path=ckpt)
    return model.seen


@pytest.mark.parametrize(("limit", "length"), [(5, None), (None, 11)])
def test_a_resume_is_exact_where_lightning_knows_the_loaders_length(
    tmp_path: Path, limit: int | None, length: int | None
) -> None:
    """With ``limit_train_batches`` or a dataset length, Lightning's fetcher fetches nothing
    ahead (it knows when the epoch ends), so the state at a step is the state after it: the
    restored loader neither trains that step's batch again nor skips one (it did both when
    it took Lightning's ``prefetch_batches`` for what was fetched ahead); at the epoch's end
    the restored loader starts the next pass, as the uninterrupted one did."""
    spec = write_shards(tmp_path)
    full = _fit_single(tmp_path / "full", spec, limit, length)
    per_epoch = len(full) // 2
    # Mid-epoch checkpoints of epoch 0, and the one at its end: Lightning's next epoch is a
    # new pass of the loader (the next epoch of the dataset), never the rest of that one.
    for step in (1, per_epoch // 2, per_epoch - 2, per_epoch):
        resumed = _fit_single(
            tmp_path / f"r{step}",
            spec,
            limit,
            length,
            tmp_path / "full" / "ck" / f"step={step}.ckpt",
        )
        assert resumed == full[step:], step
