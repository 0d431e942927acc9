"""webdataset 1.0.2's ``webdataset.pytorch``: the torch classes webdataset builds on."""

from __future__ import annotations

from torch import Tensor as TorchTensor
from torch.utils.data import DataLoader, IterableDataset

__all__ = ["DataLoader", "IterableDataset", "TorchTensor"]
