"""A deep MLP of a chosen size with Adam, for the sharding benchmarks (training-code module).

``POLYTRAIN_BENCH_HIDDEN`` (default 360) sets the hidden width H of a 256 -> H, then
:data:`LAYERS` (7) H -> H, then H -> 10 MLP with ReLU: 257 H + 7 (H^2 + H) + 10 (H + 1)
parameters (:func:`parameters`; H = 360: 1.0M; 1176: 10M; 1870: 25M; 3760: 100M).
Deep rather than wide, so that sharding has units to gather one at a time: each hidden
layer holds a seventh of the parameters, a unit of its own under the engine's choice by
size (worker/engine/fsdp.py ``size_units``).
Data: ``POLYTRAIN_BENCH_ITEMS`` (default 512) training and 64 validation vectors of 256
float32 features from a fixed seed, labelled by a fixed random linear teacher (10
classes). Adam, learning rate 1e-3. Never imports polytrain.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

DATA_SEED, N_VAL, FEATURES, CLASSES, LAYERS = 4242, 64, 256, 10, 7
WIDTHS = {"1M": 360, "10M": 1176, "25M": 1870, "100M": 3760}
"""The benchmarks' sizes: a label (parameters, rounded) -> the hidden width H."""


def hidden() -> int:
    """The hidden width H from ``POLYTRAIN_BENCH_HIDDEN``."""
    return int(os.environ.get("POLYTRAIN_BENCH_HIDDEN", "360"))


def parameters(h: int) -> int:
    """Parameters of the model at hidden width ``h``."""
    return (FEATURES + 1) * h + LAYERS * (h * h + h) + (h + 1) * CLASSES


def width(size: str) -> int:
    """The hidden width of ``size``: a label of :data:`WIDTHS`, or a width itself (tests)."""
    return WIDTHS[size] if size in WIDTHS else int(size)


def label(size: str) -> str:
    """The name of ``size`` in a benchmark's line: its label, or its parameters in millions."""
    return size if size in WIDTHS else f"{parameters(width(size)) / 1e6:.2g}M"


def build_datasets() -> tuple[Dataset, Dataset]:
    """(train, validation): features [N, 256] float32, labels [N] int64."""
    n_train = int(os.environ.get("POLYTRAIN_BENCH_ITEMS", "512"))
    generator = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(n_train + N_VAL, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def build_model() -> nn.Module:
    """256 -> H, 7 x (H -> H), H -> 10, ReLU between."""
    h = hidden()
    layers: list[nn.Module] = [nn.Linear(FEATURES, h), nn.ReLU()]
    for _ in range(LAYERS):
        layers += [nn.Linear(h, h), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(h, CLASSES))


def build_optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
    """Adam, learning rate 1e-3."""
    return torch.optim.Adam(params, lr=1e-3)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over the batch."""
    return nn.functional.cross_entropy(output, target)
