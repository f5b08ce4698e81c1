"""Quorum sync: the parameter server updates once Z of the M groups have reported.

Each group runs its own loop: exact in-group allreduce of per-sample
gradient sums, then its leader sends the group's sum to the parameter server
(point to point) and waits for fresh parameters. The parameter server
receives reports in arrival order and starts an update once ``quorum`` (Z)
of the groups still training this epoch have reported. Each report is a sum
of per-sample gradients of step ``t`` of its group and is divided by the
global count ``B_t`` of that step, so every sample weighs ``1 / B_t`` whichever
update it lands in, and an epoch's updates add up to the synchronous ones
apart from staleness (a partial update makes a proportionally smaller
step). Only the groups
that reported get new parameters; the others keep computing on the version
they have. A late gradient computed on version ``v`` and applied at version
``u`` has staleness ``u - v``; the parameter server also waits for any group
whose next report would otherwise exceed ``max_staleness`` (S), so staleness
never exceeds S (stale-synchronous bound after Ho et al., "More Effective
Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013).
Z = M or S = 0 is synchronous training.

Source: the Z-of-M trigger (start gradient aggregation once Z of M trigger
nodes are done) of the heterogeneous-computing patent family.

Trade-off: a slow or jittery group no longer holds every update back, so
updates per second rise; but updates average fewer samples and may use
gradients up to S versions old, which adds noise and can slow convergence
per update; the result depends on arrival order, so runs are not
reproducible bit for bit. Checkpoints are taken at epoch ends only.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from worker.engine import report
from worker.engine.distributed import Arrivals
from worker.engine.exchange import vector_to_grads
from worker.engine.numerics import all_finite
from worker.engine.run import Run, nonfinite_step, sum_in_group
from worker.engine.strategy import Strategy
from worker.engine.strategy_sync import PROGRESS_REPORTS_PER_EPOCH, step_point

QUORUM_TAG = 1 << 29
"""The gloo tag of the reports and parameters between the leaders and the parameter server
(on their links): the server receives reports from whichever leader sends first, which must
not take a status or a control message in their place."""


def receive_params(run: Run) -> Tensor:
    """Worker: the leader receives parameters and buffers ``[P + B]`` from rank 0, then
    broadcasts them in its group."""
    topo = run.topo
    assert topo.group is not None and topo.leader_rank is not None
    received = run.state.vector().cpu()
    if topo.am_i_leader:
        dist.recv(received, src=0, group=topo.link(0), tag=QUORUM_TAG)
    on_device = received.to(topo.device)
    if len(topo.group_ranks) > 1:
        dist.broadcast(on_device, src=topo.leader_rank, group=topo.group)
    return on_device


def group_report(run: Run) -> Tensor:
    """This step's group report ``[grad_sum, buffer_change_sum, loss_sum, count]``.

    Every member checks the group's sum; a non-finite one fails the group or,
    with ``skip_step``, becomes an all-zero report (no samples, no change),
    which the parameter server's update leaves out.
    """
    vector = run.compute(run.group_reducer())
    if not all_finite(vector):
        nonfinite_step(run, partial(sum_in_group, run=run))
        vector.zero_()
    return vector


def expect_report(arrivals: Arrivals, run: Run, group: int, numel: int) -> None:
    """Parameter server: start receiving group ``group``'s next report [numel + 2] among
    ``arrivals`` (``numel`` = P + B; :func:`collect` takes it)."""
    arrivals.expect(run.spec.leader_ranks()[group], torch.zeros(numel + 2))


def collect(
    run: Run,
    arrivals: Arrivals,
    remaining: dict[int, int],
    seen: dict[int, int],
    version: int,
) -> dict[int, Tensor]:
    """Receive group reports until Z of the active groups are in and no one would be too
    stale, in the order they arrive (each active group's report expected among ``arrivals``).

    Returns ``{group index: [grad_sum (P), buffer_change_sum (B), loss_sum, count]}``.
    """
    leader_group = {r: g for g, r in enumerate(run.spec.leader_ranks())}
    active = [g for g, left in remaining.items() if left > 0]
    need = min(run.spec.quorum_size, len(active))
    arrived: dict[int, Tensor] = {}

    def must_wait() -> bool:
        overdue = any(
            version - seen[g] >= run.spec.max_staleness for g in active if g not in arrived
        )
        return len(arrived) < need or overdue

    while must_wait():
        src, buffer = arrivals.take()
        arrived[leader_group[src]] = buffer
    return arrived


def apply_reports(
    run: Run, arrived: dict[int, Tensor], remaining: dict[int, int]
) -> tuple[float, int]:
    """One optimizer step from the reports ``{group: [grad_sum (P), buffer_change_sum (B),
    loss_sum, count]}``.

    Group g's report belongs to in-epoch step ``t = T - remaining[g]`` and is
    divided by that step's global count; the buffers move by the reports'
    sample-weighted mean change. Reports without samples (skipped steps) are
    left out; with none left there is no step. Returns the reports' ``(loss_sum, count)``.
    """
    assert run.optimizer is not None
    spe, n_params = run.split.steps_per_epoch, run.state.n_params
    reports = {g: r for g, r in arrived.items() if float(r[-1]) > 0}
    if not reports:
        return 0.0, 0
    grads = torch.zeros(n_params, dtype=next(iter(reports.values())).dtype)
    for g, vector in reports.items():
        grads += vector[:n_params] / sum(run.split.counts(spe - remaining[g]))
    vector_to_grads(grads, run.params)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    count = sum(float(r[-1]) for r in reports.values())
    changes = torch.stack([r[n_params:-2] for r in reports.values()]).sum(dim=0)
    run.state.add_mean_change(None, changes, count)
    loss_sum = sum(float(r[-2]) for r in reports.values())
    return loss_sum, int(round(count))


class Quorum(Strategy[Run]):
    """``quorum``: an update once Z of the M groups reported, staleness at most S."""

    name = "quorum"

    @override
    def worker_epoch(self, run: Run) -> None:
        """Compute rank: this group's steps of the epoch, at its own pace."""
        while not run.split.epoch_done:
            vector = group_report(run)
            with run.clock.waiting():
                if run.topo.am_i_leader:
                    dist.send(vector.cpu(), dst=0, group=run.topo.link(0), tag=QUORUM_TAG)
                fresh = receive_params(run)
            run.state.load_(fresh)
            run.split.advance()
            run.step += 1

    @override
    def server_epoch(self, run: Run) -> None:
        """Parameter server: quorum updates until every group has done all steps of the epoch."""
        assert run.optimizer is not None
        numel = run.state.n_params + run.state.n_buffers
        groups = range(len(run.spec.groups))
        remaining = {g: run.split.steps_per_epoch - run.split.step for g in groups}
        seen = {g: 0 for g in groups}
        version, updates, max_stale = 0, 0, 0
        every = max(1, run.split.steps_per_epoch // PROGRESS_REPORTS_PER_EPOCH)
        # Each group's next report is expected from the start, and again once it has taken
        # the parameters its last one earned, while it has steps left.
        arrivals = Arrivals(run.topo, QUORUM_TAG)
        for g in groups:
            if remaining[g] > 0:
                expect_report(arrivals, run, g, numel)
        while any(remaining.values()):
            arrived = collect(run, arrivals, remaining, seen, version)
            loss_sum, count = apply_reports(run, arrived, remaining)
            max_stale = max(max_stale, *(version - seen[g] for g in arrived))
            version, updates = version + 1, updates + 1
            fresh = run.state.vector()
            for g in arrived:
                leader = run.spec.leader_ranks()[g]
                dist.send(fresh, dst=leader, group=run.topo.link(leader), tag=QUORUM_TAG)
                seen[g], remaining[g] = version, remaining[g] - 1
                if remaining[g] > 0:
                    expect_report(arrivals, run, g, numel)
            run.loss_sum, run.samples = run.loss_sum + loss_sum, run.samples + count
            done = run.split.steps_per_epoch - max(remaining.values())
            step_point(run, loss_sum, count, run.step + done)  # by the slowest group's steps
            if updates % every == 0 and done < run.split.steps_per_epoch:  # end: session.train
                report.progress(
                    epoch=run.epoch,
                    step=run.step + done,
                    steps_per_epoch=run.split.steps_per_epoch,
                    epochs=run.spec.epochs,
                )
        while not run.split.epoch_done:
            run.record_batch()
            run.split.advance()
            run.step += 1
        run.stats.update(updates=updates, max_staleness=max_stale)
