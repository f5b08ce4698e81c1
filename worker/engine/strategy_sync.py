"""Synchronous sync: the parameter server updates the global model after every step.

Every worker computes the gradient sum of its share of the step's global
batch (and its buffers' change, :mod:`worker.engine.state`); the sums go up
the hierarchy (in-group allreduce, leaders' reduce), the parameter server
divides the sum by the global sample count and checks it is finite in the
same pass (:func:`worker.engine.numerics.mean_gradient_`), steps the
optimizer and broadcasts the parameters and buffers back, with one flag
element saying whether the step was applied.
One step is exactly one single-process step on the same global batch
(synchronous data parallelism, Goyal et al. 2017; parameter server after
Li et al., OSDI 2014).

Trade-off: exact and deterministic for a given split, but every step waits
for the slowest worker and pays one round trip to the parameter server, so it
needs balanced shares (``weighted`` split) and compute that dominates the
round trip.
"""

from __future__ import annotations

from torch import Tensor
from typing_extensions import override

from worker.engine import report
from worker.engine.distributed import Topology
from worker.engine.exchange import broadcast_down, gather_at_ps, push_up, vector_to_grads
from worker.engine.numerics import mean_gradient_
from worker.engine.run import Run, control_point, nonfinite_step
from worker.engine.strategy import Strategy

PROGRESS_REPORTS_PER_EPOCH = 10
# The flag element after the parameters and buffers the parameter server broadcasts.
OK, FAULT = 0.0, 1.0


def checked_update(total: Tensor, run: Run) -> tuple[bool, float, int]:
    """Check the summed vector ``[grad_sum (P), buffer_change_sum (B), loss_sum, count]``
    and, when it is finite, step from it: ``(finite, loss_sum, count)``.

    The check is the division's own pass (:func:`worker.engine.numerics.mean_gradient_`);
    a non-finite vector changes neither parameters nor buffers and gives ``(False, 0.0, 0)``.
    """
    if not mean_gradient_(total, run.state.n_params):
        return False, 0.0, 0
    return (True, *apply_update(total, run))


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
    loss_sum, count = float(total[-2]), int(round(float(total[-1])))
    if count > 0:
        n_params = run.state.n_params
        vector_to_grads(total[:n_params], run.params)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.state.add_mean_change(run.buffer_base, total[n_params:-2], count)
    return loss_sum, count


def report_progress(run: Run, every: int) -> None:
    """Progress event when ``every`` more steps have passed, and at the epoch's end."""
    spe = run.split.steps_per_epoch
    if run.split.epoch_done or run.step // every > run.last_progress // every:
        report.progress(epoch=run.epoch, step=run.step, steps_per_epoch=spe, epochs=run.spec.epochs)
        run.last_progress = run.step


class Synchronous(Strategy):
    """``sync``: one parameter-server round per step (this module's docstring)."""

    name = "sync"

    @override
    def counts_skips(self, topo: Topology) -> bool:
        """The parameter server counts skipped steps: it checks the one global sum."""
        return topo.is_ps

    @override
    def worker_epoch(self, run: Run) -> None:
        """Compute rank: the remaining steps of the epoch, one parameter-server round each."""
        while not run.split.epoch_done:
            vector = run.compute()
            push_up(run.topo, vector)
            received = broadcast_down(run.topo, vector[:-1])  # [params, buffers, flag]
            if received[-1] != OK:
                nonfinite_step(run, None)
            run.state.load_(received)
            run.split.advance()
            run.step += 1
            control_point(run)

    @override
    def server_epoch(self, run: Run) -> None:
        """Parameter server: receive, check, update and broadcast for every remaining step.

        A non-finite sum (any worker's loss, gradient or buffers) is not applied:
        the flag element of the broadcast tells every worker, and every rank then
        fails or skips together (:func:`worker.engine.run.nonfinite_step`).
        """
        numel = run.state.n_params + run.state.n_buffers
        every = max(1, run.split.steps_per_epoch // PROGRESS_REPORTS_PER_EPOCH)
        while not run.split.epoch_done:
            total = gather_at_ps(run.topo, numel + 2, run.params[0].dtype)
            finite, loss_sum, count = checked_update(total, run)
            broadcast_down(run.topo, run.state.vector(OK if finite else FAULT))
            if not finite:
                nonfinite_step(run, None)
            run.record_batch()
            run.split.advance()
            run.step += 1
            run.loss_sum, run.samples = run.loss_sum + loss_sum, run.samples + count
            report_progress(run, every)
            control_point(run)
