"""A compute-bound image classifier for the heterogeneity benchmarks (training-code module).

Data: 4,096 training (``POLYTRAIN_BENCH_ITEMS`` in the rank's environment
sets another count) and 512 validation grey images 16x16, random pixels
from a fixed seed, labelled by a fixed random linear "teacher" (10 classes),
so the task is learnable and needs no download. Model: three 3x3 convolutions
(16, 32, 32 channels) and one linear layer: about 34k parameters (138 kB of
float32) for about 1.8 M multiply-adds per sample forward, so a step's
compute dwarfs its communication. Never imports polytrain.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

DATA_SEED, N_VAL, SIZE, CLASSES = 777, 512, 16, 10


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation): images [N, 1, 16, 16] float32, labels [N] int64."""
    n_train = int(os.environ.get("POLYTRAIN_BENCH_ITEMS", "4096"))
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(n_train + N_VAL, 1, SIZE, SIZE, generator=generator)
    teacher = torch.randn(SIZE * SIZE, CLASSES, generator=generator)
    y = (x.flatten(1) @ teacher).argmax(1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def build_model() -> nn.Module:
    """conv 1->16, conv 16->32, max-pool, conv 32->32, linear 2048 -> 10."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, CLASSES),
    )


def build_optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum, learning rate 0.05."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over the batch."""
    return nn.functional.cross_entropy(output, target)
