"""Synchronous sync: the parameter server updates the global model after every step.

Every worker computes the gradient sum of its share of the step's global
batch; the sums go up the hierarchy (in-group allreduce, leaders' reduce),
the parameter server divides by the global sample count, steps the optimizer
and broadcasts the parameters back. One step is exactly one single-process
step on the same global batch (synchronous data parallelism, Goyal et al.
2017; parameter server after Li et al., OSDI 2014).

Trade-off: exact and deterministic for a given split, but every step waits
for the slowest worker and pays one round trip to the parameter server, so it
needs balanced shares (``weighted`` split) and compute that dominates the
round trip.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.engine import report
from worker.engine.exchange import (
    broadcast_down,
    gather_at_ps,
    load_vector_,
    push_up,
    vector_to_grads,
)
from worker.engine.run import Run, control_point

PROGRESS_REPORTS_PER_EPOCH = 10


def apply_update(
    total: Tensor, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> tuple[float, int]:
    """One optimizer step from the summed vector ``[grad_sum (P), loss_sum, count]``.

    The gradient is ``grad_sum / count``: the mean over every sample of the
    step, however unevenly they were spread. Returns ``(loss_sum, count)``. A
    step without samples changes nothing.
    """
    loss_sum, count = float(total[-2]), int(round(float(total[-1])))
    if count > 0:
        vector_to_grads(total[:-2] / count, params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, count


def report_progress(run: Run, every: int) -> None:
    """Progress event when ``every`` more steps have passed, and at the epoch's end."""
    spe = run.split.steps_per_epoch
    if run.split.epoch_done or run.step // every > run.last_progress // every:
        report.progress(epoch=run.epoch, step=run.step, steps_per_epoch=spe, epochs=run.spec.epochs)
        run.last_progress = run.step


def worker_epoch(run: Run) -> None:
    """Compute rank: the remaining steps of the epoch, one parameter-server round each."""
    while not run.split.epoch_done:
        vector = run.compute()
        push_up(run.topo, vector)
        load_vector_(broadcast_down(run.topo, vector[:-2]), run.params)
        run.split.advance()
        run.step += 1
        control_point(run)


def server_epoch(run: Run) -> None:
    """Parameter server: receive, update and broadcast for every remaining step of the epoch."""
    assert run.optimizer is not None
    params = run.params
    numel = sum(p.numel() for p in params)
    every = max(1, run.split.steps_per_epoch // PROGRESS_REPORTS_PER_EPOCH)
    while not run.split.epoch_done:
        total = gather_at_ps(run.topo, numel + 2, params[0].dtype)
        loss_sum, count = apply_update(total, params, run.optimizer)
        with torch.no_grad():
            broadcast_down(run.topo, torch.nn.utils.parameters_to_vector(params).detach())
        run.record_batch()
        run.split.advance()
        run.step += 1
        run.loss_sum, run.samples = run.loss_sum + loss_sum, run.samples + count
        report_progress(run, every)
        control_point(run)
