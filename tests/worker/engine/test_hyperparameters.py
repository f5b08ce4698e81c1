"""The hyperparameter accessor of the training-code contract: a module's `HYPERPARAMETERS`
dict holds its defaults, and the task's values override them before any of its functions
runs (a plain module, the bundled MNIST example, an archive's loader); a module without it
loads as before."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from backend.projects.code import (
    declared_hyperparameters,
    loader_module,
    name_problem,
    read_hyperparameters,
)
from contracts.task_spec import TaskSpec
from worker.engine.contract import ContractError, load_training_code
from worker.engine.spec import RunSpec

DECLARED = """
import torch
HYPERPARAMETERS = {"lr": 0.1, "width": 3, "act": "relu"}
def build_model(): return torch.nn.Linear(2, HYPERPARAMETERS["width"])
def build_datasets(): return [], []
def build_optimizer(params): return torch.optim.SGD(params, lr=HYPERPARAMETERS["lr"])
def loss_fn(output, target): return torch.nn.functional.mse_loss(output, target)
"""
PLAIN = (
    DECLARED.replace('HYPERPARAMETERS = {"lr": 0.1, "width": 3, "act": "relu"}', "")
    .replace('HYPERPARAMETERS["width"]', "3")
    .replace('HYPERPARAMETERS["lr"]', "0.1")
)


def _lr(code) -> float:  # type: ignore[no-untyped-def]
    return float(code.build_optimizer(code.build_model().parameters()).param_groups[0]["lr"])


def test_defaults_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(DECLARED)
    defaults = load_training_code(str(path))
    assert _lr(defaults) == 0.1 and defaults.build_model().out_features == 3
    tuned = load_training_code(str(path), {"lr": 0.5, "width": 7})
    assert _lr(tuned) == 0.5 and tuned.build_model().out_features == 7
    assert tuned.module.HYPERPARAMETERS == {"lr": 0.5, "width": 7, "act": "relu"}
    assert _lr(load_training_code(str(path))) == 0.1  # a new load starts from the defaults
    with pytest.raises(ContractError, match=r"depth are not declared .*declared: act, lr, width"):
        load_training_code(str(path), {"depth": 2})


def test_a_module_without_hyperparameters_is_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "plain.py"
    path.write_text(PLAIN)
    assert _lr(load_training_code(str(path))) == 0.1
    assert _lr(load_training_code(str(path), {})) == 0.1
    with pytest.raises(ContractError, match="declares no HYPERPARAMETERS"):
        load_training_code(str(path), {"lr": 1.0})


def test_the_mnist_example_reads_lr_and_hidden_width() -> None:
    code = load_training_code("example:mnist_cnn", {"lr": 3e-3, "hidden": 16})
    model = code.build_model()
    assert [m.out_features for m in model if isinstance(m, torch.nn.Linear)] == [16, 10]
    assert _lr(code) == pytest.approx(3e-3)
    assert _lr(load_training_code("example:mnist_cnn")) == pytest.approx(1e-3)
    source = Path("examples/mnist_cnn.py").read_bytes()
    assert declared_hyperparameters(source) == {"lr": 1e-3, "hidden": 64}


def test_an_archives_loader_passes_the_overrides_to_its_entrypoint(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("train.py", DECLARED)
    path = tmp_path / "code.py"
    path.write_bytes(loader_module(buffer.getvalue(), entrypoint="train.py", filename="job.zip"))
    code = load_training_code(str(path), {"lr": 0.25})
    assert _lr(code) == 0.25


def test_the_spec_carries_them_from_the_task_to_the_rank() -> None:
    spec = TaskSpec.model_validate(
        {"epochs": 1, "global_batch_size": 4, "hyperparameters": {"lr": 0.5, "act": "gelu"}}
    )
    engine = spec.engine_options()
    assert engine["hyperparameters"] == {"lr": 0.5, "act": "gelu"}
    assert "hyperparameters" not in TaskSpec.model_validate({"epochs": 1}).engine_options()
    run = RunSpec.model_validate(
        {
            "task_id": 1,
            "code": "example:mnist_cnn",
            "epochs": 1,
            "global_batch_size": 4,
            "groups": [{"name": "a", "device_type": "cpu", "workers": 1}],
            "checkpoint_dir": "/tmp/x",
            **engine,
        }
    )
    assert run.hyperparameters == {"lr": 0.5, "act": "gelu"}


@pytest.mark.parametrize(
    ("source", "found"),
    [
        (b"HYPERPARAMETERS = {'a': 1, 'b': [1, 2]}\n", {"a": 1, "b": [1, 2]}),
        (b"HYPERPARAMETERS: dict = {'a': 1}\n", {"a": 1}),
        (b"HYPERPARAMETERS = dict(a=1)\n", None),  # not a literal: not known here
        (b"x = 1\n", None),
        (b"def broken(:\n", None),
    ],
)
def test_declared_hyperparameters_are_read_without_running_the_module(
    source: bytes, found: dict | None
) -> None:
    assert declared_hyperparameters(source) == found


@pytest.mark.parametrize(
    ("source", "bound"),
    [
        (b"x = 1\n", False),
        (b"def f():\n    return HYPERPARAMETERS['lr']\n", False),  # read, never bound
        (b"HYPERPARAMETERS = dict(a=1)\n", True),
        (b"from config import HYPERPARAMETERS\n", True),
        (b"from config import *\n", True),
        (b"import settings as HYPERPARAMETERS\n", True),
        (b"if True:\n    HYPERPARAMETERS = {}\n", True),
        (b"def f():\n    global HYPERPARAMETERS\n", True),
        (b"globals()['HYPERPARAMETERS'] = {}\n", True),
        (b"def broken(:\n", True),  # not known: counted as bound
    ],
)
def test_a_module_binding_no_hyperparameters_is_told_apart(source: bytes, bound: bool) -> None:
    read = read_hyperparameters(source)
    assert read.bound is bound
    assert (name_problem(read, "lr") is not None) is not bound
