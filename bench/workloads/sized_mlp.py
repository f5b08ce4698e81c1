"""An MLP of a chosen size for the engine-against-DDP benchmark (training-code module).

``POLYTRAIN_BENCH_HIDDEN`` (default 100) sets the hidden width H of a 256 -> H -> H -> 10
MLP with ReLU: about 256 H + H^2 + 10 H parameters (H = 100: 37k; 880: 1.0M; 3030: 10M;
4870: 25M). Data: ``POLYTRAIN_BENCH_ITEMS`` (default 4,096) training and 256 validation
vectors of 256 float32 features from a fixed seed, labelled by a fixed random linear
teacher (10 classes). SGD, learning rate 0.01. Never imports polytrain.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

DATA_SEED, N_VAL, FEATURES, CLASSES = 4242, 256, 256, 10


def hidden() -> int:
    """The hidden width H from ``POLYTRAIN_BENCH_HIDDEN``."""
    return int(os.environ.get("POLYTRAIN_BENCH_HIDDEN", "100"))


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation): features [N, 256] float32, labels [N] int64."""
    n_train = int(os.environ.get("POLYTRAIN_BENCH_ITEMS", "4096"))
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(n_train + N_VAL, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def build_model() -> nn.Module:
    """256 -> H -> H -> 10 with ReLU."""
    h = hidden()
    return nn.Sequential(
        nn.Linear(FEATURES, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, CLASSES)
    )


def build_optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
    """SGD, learning rate 0.01."""
    return torch.optim.SGD(params, lr=0.01)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over the batch."""
    return nn.functional.cross_entropy(output, target)
