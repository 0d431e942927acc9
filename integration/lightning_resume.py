"""A PyTorch Lightning DDP run (2 CPU processes, gloo) that checkpoints mid-epoch and resumes:
``WebDataset(...).shuffle(50)`` in ``cloudshards.StatefulLoader`` (torchdata's
``StatefulDataLoader`` whose state holds every rank's), whose state Lightning saves in its
checkpoint (written by rank 0) and restores on every rank with ``trainer.fit(ckpt_path=...)``.

    python integration/lightning_resume.py SHARD_SPEC WORKERS OUT_DIR full
    python integration/lightning_resume.py SHARD_SPEC WORKERS OUT_DIR stop STEPS
    python integration/lightning_resume.py SHARD_SPEC WORKERS OUT_DIR resume CHECKPOINT

``full`` trains 2 epochs; ``stop`` trains STEPS steps and saves a checkpoint there
(``OUT_DIR/ckpt/``); ``resume`` continues from CHECKPOINT to the end of epoch 2. Each rank
writes the keys of every step it trained on to ``OUT_DIR/{mode}-rank{r}.json`` (and each
step's epoch to ``{mode}-rank{r}-epochs.json``) and prints ``RANK r steps n`` at the end.
``DEVICES`` in the environment sets the number of ranks (default 2; a resume on another
number is an elastic restore).
"""

from __future__ import annotations

import json
import os
import sys

import pytorch_lightning as pl
import torch

import cloudshards as wds


class Model(pl.LightningModule):
    def __init__(self, out: str, mode: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        self.out, self.mode = out, mode
        self.trained: list[list[str]] = []
        self.epochs: list[int] = []

    def training_step(
        self, batch: tuple[list[str], torch.Tensor, torch.Tensor], _: int
    ) -> torch.Tensor:
        keys, x, y = batch
        self.trained.append(list(keys))
        self.epochs.append(self.current_epoch)
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        with open(f"{self.out}/{self.mode}-rank{self.global_rank}.json", "w") as f:
            json.dump(self.trained, f)
        with open(f"{self.out}/{self.mode}-rank{self.global_rank}-epochs.json", "w") as f:
            json.dump(self.epochs, f)
        print(f"RANK {self.global_rank} steps {len(self.trained)}", flush=True)


class EpochSetter(pl.Callback):
    """``set_epoch`` each epoch, as training loops do (the shard order follows the epoch)."""

    def __init__(self, dataset: wds.WebDataset) -> None:
        self.dataset = dataset

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.dataset.set_epoch(trainer.current_epoch)


def main() -> None:
    spec, workers, out, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dataset = (
        wds.WebDataset(spec, shardshuffle=True, seed=5)
        .shuffle(50)
        .decode()
        .to_tuple("__key__", "npy", "cls")
    )
    # Lightning's fit loop fetches one batch ahead of the step it trains: said explicitly, or
    # (PREFETCHED=auto) left for the loader to read off Lightning's data fetcher.
    ahead = None if os.environ.get("PREFETCHED") == "auto" else 1
    loader = wds.StatefulLoader(dataset, batch_size=4, num_workers=workers, prefetched=ahead)
    callbacks: list[pl.Callback] = [EpochSetter(dataset)]
    options: dict[str, object] = {"max_epochs": 2}
    if mode == "stop":
        steps = int(sys.argv[5])
        options["max_steps"] = steps
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=f"{out}/ckpt", every_n_train_steps=steps, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("DEVICES", "2")),
        strategy="ddp",
        logger=False,
        enable_checkpointing=mode == "stop",
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **options,  # type: ignore[arg-type]
    )
    trainer.fit(Model(out, mode), loader, ckpt_path=sys.argv[5] if mode == "resume" else None)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
