"""Periodic model averaging (local SGD): groups train on their own, the PS averages every H steps.

Inside a group every step is synchronous and exact: the in-group allreduce
sums per-sample gradients and counts, every member divides by the group's
count and steps its own copy of the user's optimizer (identical on every
member). Every ``sync_period`` = H steps, and at each epoch end, the group
leaders send ``n_g * theta_g`` and ``n_g`` (the group's samples since the last
sync) to the parameter server, which sets the global model to the
sample-weighted mean ``sum(n_g theta_g) / sum(n_g)`` and broadcasts it back.
Optimizer state (e.g. momentum) stays local to each group.

Local SGD after Stich, "Local SGD Converges Fast and Communicates Little"
(ICLR 2019) and Lin et al., "Don't Use Large Mini-Batches, Use Local SGD"
(ICLR 2020).

Trade-off: one parameter-server round per H steps instead of per step, so
communication and waiting for the slowest group are amortised over H steps;
but the groups' models drift apart between syncs, so convergence per step
can be slower than synchronous training (more so with large H, large
learning rates or data that differs between groups), and results are not
step-for-step equal to a single process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.engine.exchange import (
    allreduce_sum,
    broadcast_down,
    gather_at_ps,
    leader_reduce,
    load_vector_,
)
from worker.engine.run import Run, control_point
from worker.engine.strategy_sync import PROGRESS_REPORTS_PER_EPOCH, apply_update, report_progress


def is_sync_point(run: Run) -> bool:
    """True after every H-th step of the epoch and after its last step."""
    return run.split.epoch_done or run.split.step % run.spec.sync_period == 0


def _param_vector(run: Run) -> Tensor:
    with torch.no_grad():
        return torch.nn.utils.parameters_to_vector(run.params).detach()


def average_models(run: Run, group_samples: float, group_loss: float) -> None:
    """Worker side of a sync: send the weighted group model, load the global mean."""
    weighted = _param_vector(run) * group_samples
    tail = torch.tensor([group_loss, group_samples], dtype=weighted.dtype, device=weighted.device)
    leader_reduce(run.topo, torch.cat([weighted, tail]))
    load_vector_(broadcast_down(run.topo, _param_vector(run)), run.params)


def worker_epoch(run: Run) -> None:
    """Compute rank: local exact steps inside the group, model averaging at sync points."""
    assert run.optimizer is not None
    group_samples, group_loss = 0.0, 0.0
    while not run.split.epoch_done:
        vector = allreduce_sum(run.compute(), run.topo.group)
        loss_sum, count = apply_update(vector, run.params, run.optimizer)
        group_samples, group_loss = group_samples + count, group_loss + loss_sum
        run.split.advance()
        run.step += 1
        if is_sync_point(run):
            average_models(run, group_samples, group_loss)
            group_samples, group_loss = 0.0, 0.0
            control_point(run)


def server_epoch(run: Run) -> None:
    """Parameter server: follow the step schedule and average the group models at sync points."""
    params = run.params
    numel = sum(p.numel() for p in params)
    every = max(1, run.split.steps_per_epoch // PROGRESS_REPORTS_PER_EPOCH)
    while not run.split.epoch_done:
        run.record_batch()
        run.split.advance()
        run.step += 1
        if not is_sync_point(run):
            continue
        total = gather_at_ps(run.topo, numel + 2, params[0].dtype)
        if total[-1] > 0:
            load_vector_(total[:-2] / total[-1], params)
        broadcast_down(run.topo, _param_vector(run))
        run.loss_sum += float(total[-2])
        run.samples += int(round(float(total[-1])))
        report_progress(run, every)
        control_point(run)
