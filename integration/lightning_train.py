"""A PyTorch Lightning DDP run (2 CPU processes, gloo) over shards of uneven sizes, written the
way webdataset users write it: ``WebDataset(urls, shardshuffle=True, nodesplitter=split_by_node)``
in a plain DataLoader with workers. With webdataset 1.0.2 the rank with fewer batches finishes
and the other waits in an all-reduce forever; cloudshards balances the epoch.

    python integration/lightning_train.py SHARD_SPEC EPOCHS WORKERS OUT_DIR

Each rank prints ``RANK r steps n`` at the end and writes the keys it trained on in each epoch
to ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytorch_lightning as pl
import torch

import cloudshards as wds


class Model(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        self.steps = 0
        self.out = out
        self.keys: dict[int, list[str]] = defaultdict(list)  # per epoch

    def training_step(
        self, batch: tuple[list[str], torch.Tensor, torch.Tensor], _: int
    ) -> torch.Tensor:
        keys, x, y = batch
        self.steps += 1
        self.keys[self.current_epoch].extend(keys)
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        with open(f"{self.out}/rank{self.global_rank}.json", "w") as f:
            json.dump(self.keys, f)
        print(f"RANK {self.global_rank} steps {self.steps}", flush=True)


def main() -> None:
    spec, epochs, workers, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dataset = (
        wds.WebDataset(spec, shardshuffle=True, nodesplitter=wds.split_by_node)
        .decode()
        .to_tuple("__key__", "npy", "cls")
    )
    # Persistent workers keep their dataset copy, whose epoch counter then moves on every
    # epoch (non-persistent ones start again from epoch 0 unless the program calls set_epoch).
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, num_workers=workers, persistent_workers=workers > 0
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(out), loader)
    # Leave the process group before the interpreter exits: gloo's threads still running at
    # exit abort the process ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
