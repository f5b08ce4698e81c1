"""Synchronous sync: one update of the global model after every step.

Every worker computes the gradient sum of its share of the step's global
batch (and its buffers' change, :mod:`worker.engine.state`); the sums are
added while backward runs (:class:`worker.engine.reducer.GradientReducer`:
in-group allreduce, then the group leaders' allreduce, bucket by bucket, as
DistributedDataParallel overlaps its allreduce with backward), so every
worker holds the same global sum. Each worker divides it by the global sample
count and checks it is finite in the same pass
(:func:`worker.engine.numerics.mean_gradient_`), then steps its own replica of
the user's optimizer: the replicas stay identical, as DDP's do. The parameter
server follows the step schedule (batches, control points) and takes the model and
optimizer from the first worker at checkpoints and epoch ends
(:func:`worker.engine.run.pull_replica`). It is off the step path, unless it is cut into
shards (``ps_shards`` S > 1): then the shard owners' sum replaces the leaders' allreduce,
each owner summing its slice of the step vector over the groups, which each group's
members send, each its own chunk, piece by piece as backward makes them final
(:mod:`worker.engine.shard_server`).
One step is exactly one single-process step on the same global batch
(synchronous data parallelism, Goyal et al. 2017).

A task with a sharded group (``sharding: fsdp``, :mod:`worker.engine.fsdp`) takes the same
step with each sharded worker holding its rows: its group's reduce-scatter sums the
gradients during backward (one sharded group: that is the whole sum), the groups' sums are
added a parameter at a time (:func:`worker.engine.fsdp.group_sum_`), the tail
``[buffer_change_sum, loss_sum, count]`` is summed over the workers, and each worker divides
its rows by the count and steps its shard of the optimizer (:func:`sharded_update`).

Trade-off: exact and deterministic for a given split, but every step waits
for the slowest worker, so it needs balanced shares (``weighted`` split) and
compute that dominates the sum's transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from worker.engine import report, shard_server
from worker.engine.distributed import Topology
from worker.engine.exchange import receive_status, send_status, vector_to_grads
from worker.engine.numerics import NonFiniteError, mean_gradient_
from worker.engine.reducer import GradientReducer
from worker.engine.run import (
    FIRST_WORKER,
    Run,
    control_due,
    control_point,
    nonfinite_step,
    source_worker,
    step_groups,
    stepping,
    stepping_leaders,
    sum_in_group,
    sum_over_stepping,
)
from worker.engine.sharded import local
from worker.engine.sharding import Batches
from worker.engine.strategy import Strategy

PROGRESS_REPORTS_PER_EPOCH = 10


def checked_update(total: Tensor, run: Run) -> tuple[bool, float, int]:
    """Check the summed vector ``[grad_sum (P), buffer_change_sum (B), loss_sum, count]``
    and, when it is finite, step from it: ``(finite, loss_sum, count)``.

    The check is the division's own pass (:func:`worker.engine.numerics.mean_gradient_`);
    a non-finite vector changes neither parameters nor buffers and gives ``(False, 0.0, 0)``.
    """
    if not mean_gradient_(total, run.state.n_params):
        return False, 0.0, 0
    return (True, *apply_update(total, run))


def step_from_sum(run: Run, total: Tensor, *, in_group: bool = False) -> tuple[float, int]:
    """One exact step from ``total``, a sum every stepping worker holds alike (``in_group``:
    every worker of this group, as under periodic and diloco): its ``(loss_sum, count)``,
    zeros when skipped.

    Every rank checks the sum in the pass that divides it by the count
    (:func:`checked_update`), so a non-finite one fails or skips all of them at
    once (:func:`worker.engine.run.nonfinite_step`, which raises
    NonFiniteError with ``on_nonfinite: fail``); a skip puts the buffers back.
    """
    finite, loss_sum, count = checked_update(total, run)
    if finite:
        return loss_sum, count
    nonfinite_step(run, partial(sum_in_group if in_group else sum_over_stepping, run=run))
    assert run.buffer_base is not None
    run.state.restore(run.buffer_base)
    return 0.0, 0


def sharded_update(run: Run, tail: Tensor, *, in_group: bool = False) -> tuple[float, int]:
    """One exact step of a worker in a task with a sharded group, from the summed ``tail``
    ``[buffer_change_sum (B), loss_sum, count]`` and the parameters' gradients (this
    worker's rows of the global sum, :meth:`worker.engine.run.Run.compute`; ``in_group``:
    of its group's sum, a sharded group's own step under ``periodic`` and ``diloco``): its
    ``(loss_sum, count)``, zeros when skipped.

    Whether every gradient row and the tail are finite is agreed over the stepping workers
    (``in_group``: over the group; :func:`worker.engine.run.sum_over_stepping` of a flag: no
    worker holds the whole gradient to check); a non-finite step
    fails or skips on every worker at once (:func:`worker.engine.run.nonfinite_step`) and
    puts the buffers back. Otherwise each worker divides its rows by the count (the mean
    over every sample of the step), steps its shard of the optimizer and moves the buffers
    by the sample-weighted mean change.
    """
    assert run.optimizer is not None and run.buffer_base is not None
    grads = [local(p.grad) for p in run.params if p.grad is not None]
    bad = not bool(torch.isfinite(tail).all()) or any(
        not bool(torch.isfinite(g).all()) for g in grads
    )
    flag = torch.tensor([float(bad)])
    if in_group:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=run.topo.control)
    else:
        sum_over_stepping(flag, run, dist.ReduceOp.MAX)
    if flag.item():
        nonfinite_step(run, partial(sum_in_group if in_group else sum_over_stepping, run=run))
        run.state.restore(run.buffer_base)
        return 0.0, 0
    loss_sum, count_sum = tail[-2:].tolist()
    count = int(round(count_sum))
    if count > 0:
        for grad in grads:
            grad.div_(count_sum)
        run.optimizer.step()
        for p in run.params:
            p.grad = None
        run.state.add_mean_change(run.buffer_base, tail[:-2], count)
    return loss_sum, count


def group_step(
    run: Run, indices: Tensor | None = None, upcoming: Callable[[], Batches] | None = None
) -> tuple[float, int]:
    """One exact step inside the group (``periodic``, ``diloco``), on ``indices`` (default
    the split's for this step; ``upcoming`` as :meth:`worker.engine.run.Run.compute`): its
    ``(loss_sum, count)``, zeros when skipped.

    Every member checks the group's sum (the same on each) in the pass that divides it by the
    count, so a non-finite one fails or skips the whole group at once; a skip puts the
    buffers back. A sharded (``fsdp``) group's member steps from its rows of the group's sum
    (its reduce-scatter during backward) and the tail summed over the group
    (:func:`sharded_update`)."""
    if run.sharded:
        return sharded_update(run, run.compute(indices=indices, upcoming=upcoming), in_group=True)
    computed = run.compute(run.group_reducer(), indices=indices, upcoming=upcoming)
    return step_from_sum(run, computed, in_group=True)


def apply_update(total: Tensor, run: Run) -> tuple[float, int]:
    """One optimizer step from the summed vector ``[mean_grad (P), buffer_change_sum (B),
    loss_sum, count]`` as :func:`worker.engine.numerics.mean_gradient_` leaves it.

    ``mean_grad`` is ``grad_sum / count``: the mean over every sample of the
    step, however unevenly they were spread; the buffers move by the
    sample-weighted mean change from ``run.buffer_base`` (None on the
    parameter server: its current buffers). Returns ``(loss_sum, count)``. A
    step without samples changes nothing.
    """
    assert run.optimizer is not None
    loss_sum, count_sum = total[-2:].tolist()
    count = int(round(count_sum))
    if count > 0:
        n_params = run.state.n_params
        if run.reducer is not None and total is run.reducer.flat:
            run.reducer.set_grads()  # the same views, made once
        else:
            vector_to_grads(total[:n_params], run.params)
        run.optimizer.step()
        for p in run.params:  # the gradients just set, gone (optimizer.zero_grad(set_to_none))
            p.grad = None
        run.state.add_mean_change(run.buffer_base, total[n_params:-2], count)
    return loss_sum, count


def report_progress(run: Run, every: int) -> None:
    """Progress event when ``every`` more steps have passed, before the epoch's last step:
    the epoch's end is reported once its end (validation, checkpoint) is done too
    (:func:`worker.engine.session.train`), so a pace measured across it includes that work."""
    spe = run.split.steps_per_epoch
    if not run.split.epoch_done and run.step // every > run.last_progress // every:
        report.progress(epoch=run.epoch, step=run.step, steps_per_epoch=spe, epochs=run.spec.epochs)
        run.last_progress = run.step


def step_point(run: Run, loss_sum: float, samples: int, step: int | None = None) -> None:
    """The parameter server of a strategy that learns the groups' loss and sample sums
    (periodic's sync points, quorum's updates, diloco's rounds): add them to the per-step
    window, and report it when global step ``step`` (default the run's) crossed a mark
    (:class:`worker.engine.report.StepCurve`); the learning rate is its own optimizer's."""
    curve = run.curve
    curve.add(loss_sum, samples)
    step = run.step if step is None else step
    if curve.due(step):
        curve.point(step=step, epoch=run.epoch, lr=report.first_lr(run.optimizer))


def _step(run: Run) -> tuple[float, int]:
    """One step of a stepping worker: its ``(loss_sum, count)`` (zeros when skipped); with a
    sharded group in the task the sharded step (:func:`sharded_update`), else the global sum
    reduced while backward runs (the reducer built at first use for the step's groups)."""
    cross = step_groups(run)
    if run.spec.any_sharded:
        return sharded_update(run, run.compute())
    if run.reducer is None:
        n_tail = run.state.n_buffers + 2
        n_groups = len(run.spec.groups) - len(run.parked_groups)
        owners = None
        if run.topo.shards is not None:  # the server's shards sum: each member its chunk
            owners = shard_server.OwnerSum(run.topo, run.state.n_params + n_tail)
        run.reducer = GradientReducer(
            run.topo, run.params, n_tail, n_groups, cross=cross, owners=owners
        )
    return step_from_sum(run, run.compute(run.reducer))


class Synchronous(Strategy[Run]):
    """``sync``: one global sum and one replicated optimizer step per step (this module's
    docstring)."""

    name = "sync"
    replicated = True
    guarded = True

    @override
    def counts_skips(self, topo: Topology) -> bool:
        """The first worker counts skipped steps: every worker sees the one global sum."""
        return topo.rank == FIRST_WORKER

    @override
    def reports_progress(self, topo: Topology) -> bool:
        """The first worker: every worker holds the step's global sum, and the parameter
        server is off the step path (or, in shards, holds slice 0 of the sum only)."""
        return topo.rank == FIRST_WORKER

    @override
    def worker_epoch(self, run: Run) -> None:
        """Compute rank: the remaining steps of the epoch, one global sum and step each.

        A non-finite sum (any worker's loss, gradient or buffers) is seen by every
        worker alike: none steps, and they fail or skip together
        (:func:`worker.engine.run.nonfinite_step`, over the workers); a skip puts the
        buffers back. Before each control point and at the epoch's end (with the server in
        shards, before each step too: the server takes part in it) the source worker
        (:func:`worker.engine.run.source_worker`) tells the parameter server all is well; on
        failing, it sends the reason instead, so the server fails with it too.

        Every worker holds the step's global loss sum and count (the summed tail), so the
        source worker reports the per-step series (:class:`worker.engine.report.StepCurve`)
        without a collective of its own.

        A worker of a group the guard parked (:mod:`worker.engine.guard`) follows the step
        schedule without computing and without the step's collectives, which the other
        groups' leaders and workers run in a ring of their own
        (:func:`worker.engine.run.step_groups`), and meets them at every control point.
        """
        assert run.optimizer is not None
        every = max(1, run.split.steps_per_epoch // PROGRESS_REPORTS_PER_EPOCH)
        curve = run.curve
        sharded = run.topo.shards is not None
        while not run.split.epoch_done:
            # The guard moves groups at control points only: the step's groups, the source
            # and the reducer stay the same from here to the next one.
            source = run.topo.rank == source_worker(run)
            if stepping(run):
                if source and sharded:  # rank 0 hears first whether the step comes
                    send_status(run.topo, None)
                try:
                    loss_sum, count = _step(run)
                except NonFiniteError as exc:
                    if source:
                        send_status(run.topo, str(exc))
                    raise
                run.loss_sum, run.samples = run.loss_sum + loss_sum, run.samples + count
                curve.add(loss_sum, count)  # the global sum's: every worker holds it
            run.split.advance()
            run.step += 1
            if run.topo.rank == FIRST_WORKER:
                report_progress(run, every)
            if curve.due(run.step):  # the source worker reports the task's per-step series
                lr = report.first_lr(run.optimizer) if source else None
                curve.point(step=run.step, epoch=run.epoch, lr=lr, send=source)
            if source and (control_due(run) or run.split.epoch_done):
                send_status(run.topo, None)
            control_point(run)

    @override
    def server_epoch(self, run: Run) -> None:
        """Parameter server: follow the step schedule (recorded batches, control points)
        until the first worker says the epoch's last step is done (the model and loss totals
        come at the epoch's end, :func:`worker.engine.session.end_epoch`). With the server in
        shards (``ps_shards``) it also sums slice 0 of every step's vector over the stepping
        groups (:func:`worker.engine.shard_server.sum_round`), having first heard from the
        source worker that the step comes: so a failure on the last step's sum reaches it
        with its reason, not as a lost peer, although it now waits inside the steps.

        Raises NonFiniteError with the workers' reason when they fail on a non-finite sum.
        """
        topo = run.topo
        if topo.shards is not None and run.row_sum is None:  # the attempt's first epoch
            # The step's vector: the gradient [P] with a sharded group (its tail is summed over
            # the workers apart), else [P + B + 2]; the owners learn it and the shapes.
            numel = run.state.n_params
            if not run.spec.any_sharded:
                numel += run.state.n_buffers + 2
            shapes = [tuple(p.shape) for p in run.params]
            shard_server.send_layout(topo, numel, shapes)
            n_shards = len(topo.shards.servers)
            run.row_sum = shard_server.RowSum(run.spec, numel, shapes, n_shards, 0)
        while not run.split.epoch_done:
            run.record_batch()
            if topo.shards is not None:  # slice 0 of the step's sum (shard_server)
                reason = receive_status(topo, source_worker(run))
                if reason is not None:  # the workers failed on the last step's sum
                    raise NonFiniteError(reason)
                leaders = stepping_leaders(run)
                # One stepping group's sum is its own (the reducer's, without the owners),
                # unless the task has a sharded group: then every step's gradient goes
                # through them, each worker's own part (rows_over_owners).
                if len(leaders) > 1 or run.spec.any_sharded:
                    assert run.row_sum is not None
                    shard_server.sum_round(topo, run.row_sum, run.params[0].dtype, leaders)
            run.split.advance()
            run.step += 1
            if control_due(run) or run.split.epoch_done:
                reason = receive_status(run.topo, source_worker(run))
                if reason is not None:
                    raise NonFiniteError(reason)
            control_point(run)
