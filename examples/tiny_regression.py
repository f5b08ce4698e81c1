"""A tiny regression task on synthetic data, for fast tests of the training engine.

Data: 200 points x ~ N(0, 1)^8 and y = x . w + 0.5 + noise, with w ~ N(0, 0.5^2)^8
and noise std 0.1, made from a fixed seed inside the module; 160 for training,
40 for validation. Model: a two-layer MLP (8 -> 16 -> 1, tanh). SGD with
momentum. Never imports polytrain.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

DATA_SEED = 1234
N_ITEMS, N_TRAIN, N_FEATURES = 200, 160, 8


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation): inputs [N, 8] float32, targets [N, 1] float32."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(N_ITEMS, N_FEATURES, generator=generator)
    w = 0.5 * torch.randn(N_FEATURES, 1, generator=generator)
    y = x @ w + 0.5 + 0.1 * torch.randn(N_ITEMS, 1, generator=generator)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


def build_model() -> nn.Module:
    """MLP 8 -> 16 -> 1 with tanh."""
    return nn.Sequential(nn.Linear(N_FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def build_optimizer(params) -> torch.optim.Optimizer:
    """SGD, learning rate 0.02, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over the batch; output and target [N, 1]."""
    return nn.functional.mse_loss(output, target)
