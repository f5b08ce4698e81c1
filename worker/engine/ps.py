"""The parameter-server loop (rank 0): global model, the user's optimizer, checkpoints, reports.

Each step it receives the sum over all workers of per-sample gradients plus
``[loss_sum, count]``, divides by the global sample count to get the exact
global mean gradient, steps the optimizer and broadcasts the new parameters
(parameter server after Li et al., OSDI 2014; synchronous, every step).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from torch import Tensor

from worker.engine import report
from worker.engine.contract import TrainingCode
from worker.engine.distributed import Topology
from worker.engine.exchange import (
    agree_dataset_sizes,
    broadcast_down,
    gather_at_ps,
    params_of,
    sum_over_world,
    sync_start,
    vector_to_grads,
)
from worker.engine.sharding import steps_per_epoch
from worker.engine.spec import RunSpec

PROGRESS_REPORTS_PER_EPOCH = 10


def save_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, epoch: int, step: int
) -> None:
    """Write ``{"model", "optimizer", "epoch", "step"}`` to ``path`` atomically (temp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
    }
    torch.save(state, partial)
    os.replace(partial, path)
    report.checkpoint(str(path), step=step, epoch=epoch)


def load_checkpoint(
    path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, int]:
    """Restore model and optimizer from a checkpoint; returns ``(next_epoch, step)``.

    Raises FileNotFoundError, or RuntimeError/KeyError if it does not fit the model.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    report.log(f"resumed from {path}: epoch {state['epoch']} done, step {state['step']}")
    return int(state["epoch"]) + 1, int(state["step"])


def apply_update(
    total: Tensor, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> tuple[float, int]:
    """One optimizer step from the summed vector ``[grad_sum (P), loss_sum, count]``.

    Returns ``(loss_sum, count)`` of the step. A step without samples changes nothing.
    """
    loss_sum, count = float(total[-2]), int(round(float(total[-1])))
    if count > 0:
        vector_to_grads(total[:-2] / count, params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, count


def serve_epoch(
    spec: RunSpec,
    topo: Topology,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    step: int,
    spe: int,
) -> tuple[int, float, int]:
    """Serve the ``spe`` steps of one epoch; returns ``(step, loss_sum, samples)``."""
    params = params_of(model)
    numel = sum(p.numel() for p in params)
    dtype = params[0].dtype
    every = max(1, spe // PROGRESS_REPORTS_PER_EPOCH)
    loss_sum, samples = 0.0, 0
    for i in range(spe):
        step_loss, step_count = apply_update(
            gather_at_ps(topo, numel + 2, dtype), params, optimizer
        )
        with torch.no_grad():
            broadcast_down(topo, torch.nn.utils.parameters_to_vector(params).detach())
        step += 1
        loss_sum, samples = loss_sum + step_loss, samples + step_count
        if (i + 1) % every == 0 or i + 1 == spe:
            report.progress(epoch=epoch, step=step, steps_per_epoch=spe, epochs=spec.epochs)
    return step, loss_sum, samples


def report_epoch(
    epoch: int,
    step: int,
    train: tuple[float, int],
    seconds: float,
    val: dict[str, tuple[float, float]],
) -> None:
    """Report ``train_loss``, ``samples_per_s`` and every ``val_*`` mean of one epoch."""
    loss_sum, samples = train
    values = {
        "train_loss": loss_sum / samples if samples else math.nan,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
    }
    values.update({name: s / n if n else math.nan for name, (s, n) in val.items()})
    for name, value in values.items():
        report.metric(name, value, step=step, epoch=epoch, rank=0)
    summary = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
    report.log(f"epoch {epoch}: {summary}")


def run_parameter_server(
    spec: RunSpec, code: TrainingCode, topo: Topology, model: torch.nn.Module
) -> Tensor:
    """Run rank 0 until the last epoch: returns the final parameters [P].

    Writes ``epoch-{e}.pt`` after every epoch and ``final.pt`` at the end in
    ``spec.checkpoint_dir``, then reports ``done``. Raises whatever the user's
    optimizer raises, RuntimeError if the workers' datasets differ.
    """
    model.to("cpu")
    optimizer = code.build_optimizer(model.parameters())
    first_epoch, step = 0, 0
    if spec.resume_from:
        first_epoch, step = load_checkpoint(spec.resume_from, model, optimizer)
    n_train, _ = agree_dataset_sizes(topo, None)
    sync_start(topo, params_of(model), first_epoch, step)
    spe = steps_per_epoch(n_train, spec.global_batch_size)
    checkpoint_dir = Path(spec.checkpoint_dir)
    for epoch in range(first_epoch, spec.epochs):
        started = time.perf_counter()
        step, loss_sum, samples = serve_epoch(
            spec, topo, model, optimizer, epoch=epoch, step=step, spe=spe
        )
        seconds = time.perf_counter() - started
        report_epoch(epoch, step, (loss_sum, samples), seconds, sum_over_world({}))
        save_checkpoint(
            checkpoint_dir / f"epoch-{epoch}.pt", model, optimizer, epoch=epoch, step=step
        )
    save_checkpoint(checkpoint_dir / "final.pt", model, optimizer, epoch=spec.epochs - 1, step=step)
    report.done()
    return torch.nn.utils.parameters_to_vector(params_of(model)).detach()
