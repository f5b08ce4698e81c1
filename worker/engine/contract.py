"""Loading and checking a user's training-code module (contract in docs/architecture.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor

REQUIRED = ("build_model", "build_datasets", "build_optimizer", "loss_fn")
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


class ContractError(ValueError):
    """The training code cannot be found or does not define what the contract requires."""


STEP_METRICS = "STEP_METRICS"
"""The module-level opt-in to per-step ``metrics``: ``STEP_METRICS = True`` in the user's
module has every compute worker also call its ``metrics`` (or, without one, the default
accuracy, :func:`default_metrics`) on its own part of the training batch at each per-step
point (every ``step_metrics_every`` steps), reported as ``step/train_<name>`` with the
worker's rank (:mod:`worker.engine.report`). Absent or False: ``metrics`` runs on
validation batches only, as before."""


@dataclass(frozen=True)
class TrainingCode:
    """The user's functions; ``metrics`` is None when the module does not define it;
    ``step_metrics``: the module's :data:`STEP_METRICS` opt-in."""

    module: ModuleType
    build_model: Callable[[], torch.nn.Module]
    build_datasets: Callable[[], tuple[Any, Any]]
    build_optimizer: Callable[[Any], torch.optim.Optimizer]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    metrics: Callable[[Tensor, Tensor], dict[str, float]] | None
    step_metrics: bool = False


def resolve_code_path(code: str) -> Path:
    """Path of the module named by ``code``: ``example:<name>`` or an absolute ``.py`` path.

    Raises ContractError if the reference is malformed or the file does not exist.
    """
    if code.startswith("example:"):
        name = code.removeprefix("example:")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ContractError(f"bad example name {name!r}")
        path = EXAMPLES_DIR / f"{name}.py"
    else:
        path = Path(code)
        if not path.is_absolute() or path.suffix != ".py":
            raise ContractError(f"code must be 'example:<name>' or an absolute .py path: {code!r}")
    if not path.is_file():
        raise ContractError(f"training code not found: {path}")
    return path


def load_training_code(code: str, hyperparameters: dict[str, Any] | None = None) -> TrainingCode:
    """Import the user's module from its file and check it defines the contract's functions.

    ``hyperparameters`` (the task's, name -> value) override the module's declared defaults
    in place (:func:`apply_hyperparameters`) before any of its functions is called.

    Exceptions raised by the module's own top-level code propagate unchanged.
    Raises ContractError naming every missing or non-callable function, a
    ``STEP_METRICS`` that is not a bool, or an override the module does not declare.
    """
    path = resolve_code_path(code)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"polytrain_user_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ContractError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up here
    spec.loader.exec_module(module)
    missing = [f for f in REQUIRED if not callable(getattr(module, f, None))]
    if missing:
        raise ContractError(f"{path} does not define callable {', '.join(missing)}")
    metrics = getattr(module, "metrics", None)
    if metrics is not None and not callable(metrics):
        raise ContractError(f"{path}: 'metrics' is defined but not callable")
    step_metrics = getattr(module, STEP_METRICS, False)
    if not isinstance(step_metrics, bool):
        raise ContractError(f"{path}: {STEP_METRICS} must be True or False")
    apply_hyperparameters(module, hyperparameters or {})
    return TrainingCode(
        module=module,
        build_model=module.build_model,
        build_datasets=module.build_datasets,
        build_optimizer=module.build_optimizer,
        loss_fn=module.loss_fn,
        metrics=metrics,
        step_metrics=step_metrics,
    )


def apply_hyperparameters(module: ModuleType, overrides: dict[str, Any]) -> dict[str, Any]:
    """Put the task's hyperparameters into the module's ``HYPERPARAMETERS`` dict, in place.

    The accessor of the contract (docs/architecture.md, "Hyperparameters") is that dict: a
    module declares its defaults as ``HYPERPARAMETERS = {"lr": 1e-3, ...}`` and its
    functions read ``HYPERPARAMETERS["lr"]`` when they are called. The dict is updated in
    place, so every name bound to it (an archive's entry module and the loader that
    re-exports it) sees the overrides; run as a plain script, the module sees its defaults.
    A module without ``HYPERPARAMETERS`` is left alone when there is nothing to override.

    Returns the values in effect. Raises ContractError for an override of a name the
    module does not declare, or a ``HYPERPARAMETERS`` that is not a dict.
    """
    declared = getattr(module, "HYPERPARAMETERS", None)
    if declared is None:
        if overrides:
            raise ContractError(
                f"the task sets hyperparameters {', '.join(sorted(overrides))} but the "
                "training code declares no HYPERPARAMETERS dict"
            )
        return {}
    if not isinstance(declared, dict):
        raise ContractError(
            f"HYPERPARAMETERS must be a dict of defaults, not {type(declared).__name__}"
        )
    unknown = sorted(set(overrides) - set(declared))
    if unknown:
        raise ContractError(
            f"hyperparameters {', '.join(unknown)} are not declared in HYPERPARAMETERS "
            f"(declared: {', '.join(sorted(map(str, declared))) or 'none'})"
        )
    declared.update(overrides)
    return dict(declared)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators.

    Every rank does so with the task's seed before it calls the user's ``build_model``
    (:func:`worker.engine.launch.run`) and ``build_datasets``
    (:func:`worker.engine.data.prepare_data`), so all build the same model and datasets.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def default_metrics(output: Tensor, target: Tensor) -> dict[str, float]:
    """Accuracy where the output is a classification, else ``{}``.

    Class scores ``[N, C]`` (C >= 2) with integer class indices ``[N]``: argmax
    accuracy. One logit ``[N]`` or ``[N, 1]`` with 0/1 targets of the same
    length: accuracy of ``logit > 0``. Returns ``{"accuracy": fraction in [0, 1]}``.
    """
    n = output.shape[0] if output.ndim else 0
    if n == 0 or target.ndim == 0 or target.shape[0] != n:
        return {}
    if output.ndim == 2 and output.shape[1] >= 2:
        if target.ndim != 1 or target.is_floating_point() or target.is_complex():
            return {}
        return {"accuracy": (output.argmax(dim=1) == target).double().mean().item()}
    if output.numel() == n and target.numel() == n:
        flat_target = target.reshape(n)
        if not bool(((flat_target == 0) | (flat_target == 1)).all()):
            return {}
        predicted = (output.reshape(n) > 0).to(flat_target.dtype)
        return {"accuracy": (predicted == flat_target).double().mean().item()}
    return {}
