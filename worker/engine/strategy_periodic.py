"""Periodic model averaging (local SGD): groups train on their own, the PS averages every H steps.

Inside a group every step is synchronous and exact: the in-group allreduce
sums per-sample gradients and counts, every member divides by the group's
count and steps its own copy of the user's optimizer (identical on every
member). Every ``sync_period`` = H steps, and at each epoch end, the group
leaders send ``n_g * theta_g`` and ``n_g`` (the group's samples since the last
sync) to the parameter server, which sets the global model to the
sample-weighted mean ``sum(n_g theta_g) / sum(n_g)`` and broadcasts it back.
Optimizer state (e.g. momentum) stays local to each group. Buffers follow
the same two levels (:mod:`worker.engine.state`): every step the in-group
allreduce carries each member's buffer change and every member applies the
sample-weighted mean; at a sync point the group's change since the last sync
is weighted by ``n_g`` and the parameter server adds the weighted mean.

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
from typing_extensions import override

from worker.engine import shard_server
from worker.engine.exchange import (
    broadcast_down,
    gather_at_ps,
    leader_reduce,
    load_vector_,
)
from worker.engine.run import (
    Run,
    control_point,
    stepping,
    stepping_leaders,
    take_round,
)
from worker.engine.strategy import Strategy
from worker.engine.strategy_sync import (
    PROGRESS_REPORTS_PER_EPOCH,
    group_step,
    report_progress,
    step_point,
)


def is_sync_point(run: Run) -> bool:
    """True after every H-th step of the epoch and after its last step."""
    return run.split.epoch_done or run.split.step % run.spec.sync_period == 0


def average_models(
    run: Run, group_samples: float, group_loss: float, sync_base: list[Tensor]
) -> None:
    """Worker side of a sync: send the weighted group model and the group's buffer change
    since ``sync_base`` (the buffers of the last sync), load the global model and buffers.

    With the parameter server's owners (:mod:`worker.engine.shard_server`: ``ps_shards`` > 1,
    or a sharded group in the task) each member sends its part, each slice of it to the
    slice's owner: a whole group's member its chunk, after which the members gather the new
    model's chunks; a sharded (``fsdp``) group's member its own rows, taking back its rows of
    the new model (no process of the group gathers the whole)."""
    state, topo = run.state, run.topo
    params, held = run.params[0], state.n_held
    # [n_g theta_g (its held part), buffer changes, loss, n_g], formed in place.
    vector = torch.empty(held + state.n_buffers + 2, dtype=params.dtype, device=params.device)
    weighted = state.held_params(group_samples, out=vector)
    vector[held:-2] = state.buffer_change(sync_base, group_samples, weighted)
    vector[-2:] = torch.tensor([group_loss, group_samples], dtype=vector.dtype)
    if topo.shards is None:
        leader_reduce(topo, vector)
        state.load_(broadcast_down(topo, state.vector()))
        return
    take_round(run, vector.cpu())


class Periodic(Strategy[Run]):
    """``periodic``: exact steps inside each group, model averaging every ``sync_period`` steps."""

    name = "periodic"
    group_optimizers = True
    guarded = True

    @override
    def worker_epoch(self, run: Run) -> None:
        """Compute rank: local exact steps inside the group, model averaging at sync points.

        A worker of a group the guard parked (:mod:`worker.engine.guard`) follows the step
        schedule without computing and without the averaging, and meets the others at
        every control point; a group taken back there receives the global model.
        """
        assert run.optimizer is not None
        group_samples, group_loss = 0.0, 0.0
        sync_base = run.state.snapshot()
        while not run.split.epoch_done:
            if stepping(run):
                loss_sum, count = group_step(run)
                group_samples, group_loss = group_samples + count, group_loss + loss_sum
            run.split.advance()
            run.step += 1
            if is_sync_point(run):
                if stepping(run):
                    with run.clock.waiting():
                        average_models(run, group_samples, group_loss, sync_base)
                group_samples, group_loss = 0.0, 0.0
                control_point(run)
                # After the control point: a group taken back there has a new model.
                sync_base = run.state.snapshot()

    @override
    def server_epoch(self, run: Run) -> None:
        """Parameter server: follow the step schedule and average the group models at sync points.

        Parameters become ``sum(n_g theta_g) / sum(n_g)``; buffers move by the
        sample-weighted mean of the groups' changes since the last sync. The groups' loss
        and sample sums that come with them make the per-step series (at sync points,
        :func:`worker.engine.strategy_sync.step_point`).
        """
        state, topo = run.state, run.topo
        n_params = state.n_params
        numel = n_params + state.n_buffers
        every = max(1, run.split.steps_per_epoch // PROGRESS_REPORTS_PER_EPOCH)
        if topo.shards is not None and run.ps_shards is None:  # the attempt's first epoch
            run.ps_shards = shard_server.ServerShards(topo, run.spec, state, None)
        while not run.split.epoch_done:
            run.record_batch()
            run.split.advance()
            run.step += 1
            if not is_sync_point(run):
                continue
            leaders = stepping_leaders(run)
            if run.ps_shards is not None:
                loss_sum, samples = run.ps_shards.mean_round(leaders)
            else:
                total = gather_at_ps(topo, numel + 2, run.params[0].dtype, leaders)
                loss_sum, samples = float(total[-2]), float(total[-1])
                if samples > 0:
                    load_vector_(total[:n_params] / total[-1], run.params)
                    state.add_mean_change(None, total[n_params:-2], samples)
                broadcast_down(topo, state.vector(), leaders)
            run.loss_sum += loss_sum
            run.samples += int(round(samples))
            report_progress(run, every)
            step_point(run, loss_sum, int(round(samples)))
            control_point(run)
