"""Buffers (BatchNorm running statistics, counters) are trained, combined and kept.

A model with ``BatchNorm1d`` on shifted, scaled inputs (so the right running
statistics are far from the initial 0 and 1) trains over two groups (2 + 1
workers, real gloo processes). The checkpoint must hold the buffers the
documented rule gives (docs/heterogeneity.md, "Buffers"), checked against
single-process references on the parameter server's recorded global batches:
one that applies the rule (to 1e-5, parameters and buffers) and plain
training on the whole global batch (within the documented tolerance).
Every rank ends with the same buffers, validation uses them (eval mode), and
periodic and quorum sync carry them too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import default_collate

from contracts.sharded_state import consolidate
from tests.worker.engine.reference import dumped_batches, finite, reference_model, run_with_dump
from worker.engine.contract import TrainingCode, load_training_code, seed_everything
from worker.engine.sharding import even_shares
from worker.engine.spec import RunSpec

BATCHNORM_MODULE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from examples.tiny_regression import build_datasets as plain_datasets, build_optimizer, loss_fn

SCALE = torch.linspace(0.5, 4.0, 8)
SHIFT = torch.arange(8.0) - 3.0

def build_datasets():
    train, val = plain_datasets()
    (xt, yt), (xv, yv) = train.tensors, val.tensors
    return TensorDataset(xt * SCALE + SHIFT, yt), TensorDataset(xv * SCALE + SHIFT, yv)

def build_model():
    return nn.Sequential(
        nn.BatchNorm1d(8), nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1)
    )
"""

# docs/heterogeneity.md, "Buffers": against plain single-process training on the same global
# batches, a running mean of a BatchNorm on the inputs agrees up to float rounding; a running
# variance misses the spread between the workers' batch means (here within 10 %).
ATOL, VAR_RTOL = 1e-5, 0.10
BUFFERS = ("0.running_mean", "0.running_var", "2.running_mean", "2.running_var")


def bn_spec(make_spec: Callable[..., RunSpec], tmp_path: Path, **overrides: object) -> RunSpec:
    tmp_path.mkdir(parents=True, exist_ok=True)
    module = tmp_path / "batchnorm_model.py"
    module.write_text(BATCHNORM_MODULE)
    fields = {
        "code": str(module),
        "global_batch_size": 32,
        "epochs": 3,
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        **overrides,
    }
    return make_spec(**fields)


def checkpoint_model(spec: RunSpec, name: str = "final.pt") -> torch.nn.Module:
    """The user's model with the state of checkpoint ``name``, as a user would load it."""
    code = load_training_code(spec.code)
    model = code.build_model()
    path = Path(spec.checkpoint_dir) / name
    model.load_state_dict(downloaded(path)["model"])
    return model


def downloaded(path: Path) -> dict:
    """Checkpoint ``path`` as a user downloads it: one file, made whole as the portal makes it
    (``contracts.sharded_state.consolidate``: the optimizer states and the model's slices
    read from their folders beside it)."""
    whole = path.with_name(path.name + ".whole")
    consolidate(path, whole)
    return torch.load(whole, weights_only=True)


@torch.no_grad()
def _step_buffers(model: torch.nn.Module, base: dict[str, torch.Tensor], change: dict) -> None:
    for name, buffer in model.named_buffers():
        mean = change[name]
        buffer.copy_(base[name] + (mean if buffer.is_floating_point() else mean.round()))


def rule_reference(spec: RunSpec, batches: list[torch.Tensor]) -> torch.nn.Module:
    """One process applying the documented rule: each global batch is cut into the workers'
    shares (even split, worker order); every part runs forward and backward from the same
    parameters and buffers; gradients and buffer changes are averaged weighted by samples."""
    code: TrainingCode = load_training_code(spec.code)
    seed_everything(spec.seed)
    model = code.build_model()
    seed_everything(spec.seed)
    train_set, _ = code.build_datasets()
    optimizer = code.build_optimizer(model.parameters())
    shares = even_shares(spec.global_batch_size, spec.n_workers)
    for batch in batches:
        base = {n: b.clone() for n, b in model.named_buffers()}
        grads = [torch.zeros_like(p) for p in model.parameters()]
        change = {n: torch.zeros_like(b, dtype=torch.float32) for n, b in base.items()}
        for part in batch.split(shares):
            _step_buffers(model, base, {n: torch.zeros_like(c) for n, c in change.items()})
            inputs, target = default_collate([train_set[int(i)] for i in part])
            model.zero_grad()
            code.loss_fn(model(inputs), target).backward()
            for total, p in zip(grads, model.parameters(), strict=True):
                total += p.grad * len(part) / len(batch)
            for n, b in model.named_buffers():
                change[n] += (b - base[n]).float() * len(part) / len(batch)
        for total, p in zip(grads, model.parameters(), strict=True):
            p.grad = total
        optimizer.step()
        _step_buffers(model, base, change)
    return model


def eval_val_loss(spec: RunSpec, model: torch.nn.Module) -> float:
    code = load_training_code(spec.code)
    inputs, target = code.build_datasets()[1][:]
    model.eval()
    with torch.no_grad():
        return float(code.loss_fn(model(inputs), target))


def test_sync_checkpoint_buffers_follow_the_rule_and_match_one_process(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    spec = bn_spec(make_spec, tmp_path)
    run, finals = run_with_dump(spec, tmp_path / "dump")
    for rank in range(1, spec.world_size):  # parameters and buffers, [P + B]
        assert torch.equal(finals[rank], finals[0]), f"rank {rank} differs from the PS"
    batches = dumped_batches(tmp_path / "dump")
    got = checkpoint_model(spec).state_dict()
    # 15 steps of momentum 0.1 towards the last input's mean 4: 4 (1 - 0.9^15) = 3.2, not 0.
    assert float(got["0.running_mean"][-1]) > 3.0, got["0.running_mean"]
    rule = rule_reference(spec, batches).state_dict()
    for name, want in rule.items():
        torch.testing.assert_close(got[name], want, atol=ATOL, rtol=0, msg=name)
    plain, _ = reference_model(spec, batches)
    one_process = plain.state_dict()
    assert int(got["0.num_batches_tracked"]) == len(batches) == 15
    torch.testing.assert_close(
        got["0.running_mean"], one_process["0.running_mean"], atol=ATOL, rtol=0
    )
    for name in ("0.running_var", "2.running_var"):
        torch.testing.assert_close(got[name], one_process[name], atol=0, rtol=VAR_RTOL, msg=name)
    # Validation runs in eval mode on these buffers: its loss is the checkpoint's.
    val = finite(run.metrics("val_loss"))[-1]
    assert math.isclose(val, eval_val_loss(spec, checkpoint_model(spec)), rel_tol=1e-5)


def test_periodic_quorum_and_diloco_sync_carry_buffers(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    for options in (
        {"sync_strategy": "periodic", "sync_period": 2},
        {"sync_strategy": "quorum", "quorum": 2},
        # buffers are averaged as with periodic (the outer optimizer moves parameters only)
        {"sync_strategy": "diloco", "sync_period": 2, "outer_lr": 1.0, "outer_momentum": 0.0},
    ):
        name = str(options["sync_strategy"])
        spec = bn_spec(make_spec, tmp_path / name, **options)
        _, finals = run_with_dump(spec, tmp_path / name / "dump")
        assert all(torch.equal(finals[r], finals[0]) for r in finals), name
        batches = dumped_batches(tmp_path / name / "dump")
        got = checkpoint_model(spec).state_dict()
        plain, _ = reference_model(spec, batches)
        one_process = plain.state_dict()
        assert int(got["0.num_batches_tracked"]) == len(batches) == 15, name
        # Every group's batches of the step have fixed weights: the input mean is exact.
        torch.testing.assert_close(
            got["0.running_mean"], one_process["0.running_mean"], atol=ATOL, rtol=0, msg=name
        )
        for key in ("0.running_var", "2.running_var"):
            torch.testing.assert_close(got[key], one_process[key], atol=0, rtol=VAR_RTOL, msg=name)
