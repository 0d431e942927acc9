"""A 2-rank PyTorch Lightning run (CPU, gloo) in which a ``select`` drops every sample of
rank 0's share of the epoch, through a ``WebLoader``: both ranks must end the epoch together
(with no step), not hang. Lightning calls ``iter()`` on the loader once to check it before
training; that call must not spend the ranks' meeting.

    python integration/lightning_whole_share.py SHARD_SPEC

Each rank prints ``RANK r steps n`` at the end.
"""

from __future__ import annotations

import sys

import pytorch_lightning as pl
import torch

import cloudshards as wds


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.steps = 0

    def training_step(self, batch: tuple[list[str], list[float]], _: int) -> torch.Tensor:
        self.steps += 1
        return self.layer(torch.tensor(batch[1]).reshape(-1, 1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        print(f"RANK {self.global_rank} steps {self.steps}", flush=True)


def main() -> None:
    dataset = (
        wds.WebDataset(sys.argv[1], shardshuffle=False)
        .select(lambda sample: not sample["__key__"].startswith(("a0_", "a1_")))
        .map(lambda sample: (sample["__key__"], 1.0))
        .batched(4)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), loader)


if __name__ == "__main__":
    main()
