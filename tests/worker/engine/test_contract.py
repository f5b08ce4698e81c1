"""Loading a training-code module and the default validation metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.engine.contract import ContractError, default_metrics, load_training_code

COMPLETE = """
import torch
def build_model(): return torch.nn.Linear(2, 1)
def build_datasets(): return [], []
def build_optimizer(params): return torch.optim.SGD(params, lr=0.1)
def loss_fn(output, target): return torch.nn.functional.mse_loss(output, target)
"""


def write_module(tmp_path: Path, source: str, name: str = "user_code.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_complete_module_loads_without_metrics(tmp_path: Path) -> None:
    code = load_training_code(write_module(tmp_path, COMPLETE))
    assert isinstance(code.build_model(), torch.nn.Linear)
    assert code.metrics is None


def test_bundled_examples_satisfy_the_contract() -> None:
    for name in ("mnist_cnn", "tiny_regression"):
        code = load_training_code(f"example:{name}")
        assert callable(code.loss_fn)


@pytest.mark.parametrize("missing", ["build_model", "build_datasets", "build_optimizer", "loss_fn"])
def test_missing_function_is_named(tmp_path: Path, missing: str) -> None:
    source = COMPLETE.replace(f"def {missing}(", f"def _not_{missing}(")
    with pytest.raises(ContractError, match=missing):
        load_training_code(write_module(tmp_path, source))


def test_non_callable_counts_as_missing(tmp_path: Path) -> None:
    source = COMPLETE.replace(
        "def loss_fn(output, target):", "loss_fn = 3\ndef _x(output, target):"
    )
    with pytest.raises(ContractError, match="loss_fn"):
        load_training_code(write_module(tmp_path, source))


@pytest.mark.parametrize(
    "code", ["example:nope", "example:../x", "relative/path.py", "/no/such.py"]
)
def test_bad_code_reference_is_a_contract_error(code: str) -> None:
    with pytest.raises(ContractError):
        load_training_code(code)


def test_accuracy_for_class_scores_with_index_targets() -> None:
    output = torch.tensor([[2.0, 0.1, 0.0], [0.0, 1.0, 0.2], [0.3, 0.2, 0.1], [0.0, 0.0, 5.0]])
    target = torch.tensor([0, 1, 2, 2])
    assert default_metrics(output, target) == {"accuracy": pytest.approx(0.75)}


@pytest.mark.parametrize("shape", [(4,), (4, 1)])
def test_accuracy_for_one_logit_with_binary_targets(shape: tuple[int, ...]) -> None:
    output = torch.tensor([1.5, -0.5, 0.2, -2.0]).reshape(shape)
    target = torch.tensor([1.0, 0.0, 0.0, 0.0]).reshape(shape)
    assert default_metrics(output, target) == {"accuracy": pytest.approx(0.75)}


def test_no_accuracy_for_regression() -> None:
    output = torch.randn(5, 1)
    assert default_metrics(output, torch.randn(5, 1)) == {}
    assert default_metrics(torch.randn(5, 3), torch.randn(5, 3)) == {}
