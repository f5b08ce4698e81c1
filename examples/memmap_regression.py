"""Regression on a memory-mapped array larger than memory: a training-code module for polytrain.

Data: ``regression.npy`` in the datasets folder named by ``$POLYTRAIN_DATASETS``, a float32
array ``[N, 65]`` (64 features, then the target), written once by
``scripts/make_datasets.py DEST --memmap-mb MB``. Each process maps the file read-only
(``numpy.load(..., mmap_mode="r")``) the first time it reads an item, so only the pages
of the rows its shard needs are ever read: the file may be many times the memory. The
last 2 % of the rows (at most 8,192) are for validation. Items are
``(features [64] float32, target [1] float32)``.

This module follows the contract in docs/architecture.md and never imports polytrain.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

FEATURES = 64


class MappedRows(Dataset):
    """Rows ``start .. stop`` of the mapped array at ``path``; item ``(features, target)``."""

    def __init__(self, path: Path, start: int, stop: int) -> None:
        self.path, self.start, self.stop = path, start, stop
        self.array: np.ndarray | None = None  # mapped in the process that reads

    def __len__(self) -> int:
        return self.stop - self.start

    def __getstate__(self) -> dict:
        return {**self.__dict__, "array": None}

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if self.array is None:
            self.array = np.load(self.path, mmap_mode="r")
        row = np.array(self.array[self.start + index])  # a copy: the page may go after
        return torch.from_numpy(row[:FEATURES]), torch.from_numpy(row[FEATURES:])


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation) rows of ``$POLYTRAIN_DATASETS/regression.npy``."""
    path = Path(os.environ.get("POLYTRAIN_DATASETS", "datasets")) / "regression.npy"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: write it with `scripts/make_datasets.py DEST --memmap-mb MB` "
            "on every host and start its agents with POLYTRAIN_DATASETS_DIR=DEST (local runs: "
            "POLYTRAIN_DATASETS=DEST)"
        )
    rows = int(np.load(path, mmap_mode="r").shape[0])
    n_val = min(8192, max(1, rows // 50))
    return MappedRows(path, 0, rows - n_val), MappedRows(path, rows - n_val, rows)


def build_model() -> nn.Module:
    """MLP 64 -> 256 -> 256 -> 1 with ReLU."""
    return nn.Sequential(
        nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
    )


def build_optimizer(params) -> torch.optim.Optimizer:
    """Adam, learning rate 1e-3."""
    return torch.optim.Adam(params, lr=1e-3)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over the batch; output and target [N, 1]."""
    return nn.functional.mse_loss(output, target)
