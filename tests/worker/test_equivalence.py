"""A distributed run over two resource groups equals one process on the same global batches.

Real gloo processes on CPU: a parameter server and two groups (2 + 1 workers),
an odd global batch (7) so per-worker shares are uneven.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from worker.engine.contract import load_training_code
from worker.engine.launch import seed_everything
from worker.engine.local import LocalRun, launch_local
from worker.engine.sharding import global_batches
from worker.engine.spec import RunSpec
from worker.engine.trainer import collate

TIMEOUT_S = 50.0


def reference_run(spec: RunSpec) -> tuple[torch.Tensor, list[float]]:
    """Single-process training: final parameters [P] and the mean training loss of each epoch."""
    code = load_training_code(spec.code)
    seed_everything(spec.seed)
    model = code.build_model()
    seed_everything(spec.seed)
    train_set, _ = code.build_datasets()
    optimizer = code.build_optimizer(model.parameters())
    epoch_losses = []
    for epoch in range(spec.epochs):
        loss_sum = 0.0
        for batch in global_batches(len(train_set), spec.global_batch_size, spec.seed, epoch):
            inputs, target = collate(train_set, batch)
            loss = code.loss_fn(model(inputs), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(batch)
        epoch_losses.append(loss_sum / len(train_set))
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), epoch_losses


def finite(values: list[float | None]) -> list[float]:
    """The metric values, asserting none was reported as non-finite (null)."""
    assert all(v is not None for v in values), values
    return [v for v in values if v is not None]


def run_with_dump(spec: RunSpec, dump_dir: Path) -> tuple[LocalRun, dict[int, torch.Tensor]]:
    run = launch_local(
        spec, env_extra={"POLYTRAIN_DUMP_PARAMS": str(dump_dir)}, timeout_s=TIMEOUT_S
    )
    assert run.ok, "\n".join(run.text(r) for r in run.output)
    return run, {r: torch.load(dump_dir / f"rank-{r}.pt") for r in range(spec.world_size)}


def test_every_worker_holds_the_single_process_parameters(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = make_spec()
    run, finals = run_with_dump(spec, tmp_path / "params")
    for rank in range(1, spec.world_size):
        assert torch.equal(finals[rank], finals[0]), f"rank {rank} differs from the PS"
    expected, epoch_losses = reference_run(spec)
    torch.testing.assert_close(finals[0], expected, atol=1e-5, rtol=0)
    for got, want in zip(finite(run.metrics("train_loss")), epoch_losses, strict=True):
        assert math.isclose(got, want, rel_tol=1e-5)


def test_reports_checkpoints_and_done(make_spec: Callable[..., RunSpec], tmp_path: Path) -> None:
    spec = make_spec(epochs=1)
    run, finals = run_with_dump(spec, tmp_path / "params")
    kinds = [e["type"] for e in run.events if e["_rank"] == 0]
    assert kinds[-1] == "done" and "progress" in kinds
    paths = [Path(e["path"]) for e in run.events if e["type"] == "checkpoint"]
    assert [p.name for p in paths] == ["epoch-0.pt", "final.pt"]
    state = torch.load(paths[-1], weights_only=True)
    assert state["epoch"] == 0 and state["step"] == math.ceil(160 / 7)
    for name in ("train_loss", "val_loss", "samples_per_s"):
        assert len(run.metrics(name)) == 1, name
    assert all(len(run.metrics("samples_per_s", rank=r)) == 1 for r in (1, 2, 3))
    assert "val_accuracy" not in {e.get("name") for e in run.events}


def test_resume_continues_to_the_same_parameters(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    first = make_spec(epochs=1, groups=[{"name": "solo", "device_type": "cpu", "workers": 2}])
    run_with_dump(first, tmp_path / "first")
    resumed = first.model_copy(
        update={"epochs": 2, "resume_from": str(Path(first.checkpoint_dir) / "epoch-0.pt")}
    )
    run, finals = run_with_dump(resumed, tmp_path / "resumed")
    expected, _ = reference_run(resumed)
    torch.testing.assert_close(finals[0], expected, atol=1e-5, rtol=0)
    assert [e["epoch"] for e in run.events if e["type"] == "checkpoint"] == [1, 1]


USER_METRICS = """
import torch
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn

def metrics(output, target):
    return {"mae": (output - target).abs().mean().item()}
"""


def test_user_metrics_are_reported_as_validation_means(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "with_metrics.py"
    module.write_text(USER_METRICS)
    spec = make_spec(code=str(module), epochs=1, global_batch_size=16)
    run, finals = run_with_dump(spec, tmp_path / "params")
    code = load_training_code(spec.code)
    model = code.build_model()
    torch.nn.utils.vector_to_parameters(finals[0], model.parameters())
    inputs, target = code.build_datasets()[1][:]
    with torch.no_grad():
        output = model(inputs)
    assert math.isclose(
        finite(run.metrics("val_mae"))[0], (output - target).abs().mean().item(), rel_tol=1e-5
    )
    assert math.isclose(
        finite(run.metrics("val_loss"))[0], code.loss_fn(output, target).item(), rel_tol=1e-5
    )
