"""State of one rank during training, and the control points every rank passes together.

Both roles hold a :class:`Run`: the parameter server (global model and
optimizer, checkpoints) and each compute worker (its local copy, the
preprocessed data, its speed emulator and, when the sync strategy has
``group_optimizers`` (periodic), its group's optimizer). Every rank holds an
identical load balancer and takes each rebalancing decision itself, from the
same measured work. Control points are collectives over the whole world at
steps every rank knows in advance: the load-balancing check every
``rebalance_every`` steps and at epoch ends, and checkpoints every
``checkpoint_every`` steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from worker.engine import report
from worker.engine.agreement import check_parameters, hooked_precision
from worker.engine.balance import Balancer, imbalance
from worker.engine.checkpoint import gather_worker_states, save_checkpoint
from worker.engine.compute import BusyClock, Work, local_gradient, reduced_gradient
from worker.engine.contract import TrainingCode
from worker.engine.data import Source
from worker.engine.distributed import FIRST_WORKER, Topology
from worker.engine.emulation import SpeedEmulator
from worker.engine.exchange import gather_work, receive_at_ps, send_to_ps
from worker.engine.numerics import NonFiniteError, blame, describe, local_faults
from worker.engine.provenance import ShardLedger
from worker.engine.reducer import GradientReducer
from worker.engine.sharding import Batches
from worker.engine.spec import RunSpec
from worker.engine.split import SplitState
from worker.engine.state import ModelState
from worker.engine.strategy import Strategy


@dataclass
class Run:
    """One rank's training state. ``step`` counts optimizer steps since the start of training;
    ``strategy`` (keyword only) is the one ``spec.sync_strategy`` names
    (:func:`worker.engine.session.strategy_for`)."""

    spec: RunSpec
    code: TrainingCode
    topo: Topology
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    split: SplitState
    balancer: Balancer
    train: Source | None = None
    emulator: SpeedEmulator | None = None
    epoch: int = 0
    step: int = 0
    window: Work = field(default_factory=Work)
    epoch_work: Work = field(default_factory=Work)
    last_balance: int = 0
    last_checkpoint: int = 0
    last_progress: int = 0
    loss_sum: float = 0.0
    samples: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    batches: list[Tensor] | None = None
    skipped: int = 0
    local_loss: float = 0.0
    buffer_base: list[Tensor] | None = None
    reducer: GradientReducer | None = None
    pulled_at: int = -1
    clock: BusyClock = field(default_factory=BusyClock)
    ledger: ShardLedger | None = None  # the parameter server's shard provenance
    last_agreement: int = 0
    agreement_s: float = 0.0  # wall seconds in the agreement checks (worker.engine.agreement)
    excluded_groups: set[int] = field(default_factory=set)  # left out on disagreement
    outer: torch.optim.Optimizer | None = None  # diloco: the parameter server's outer optimizer
    outer_state: dict[str, Any] | None = None  # its checkpointed state, loaded at first use
    state: ModelState = field(init=False)
    strategy: Strategy[Run] = field(kw_only=True)

    def __post_init__(self) -> None:
        self.state = ModelState.of(self.model)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The model's parameters in flat-vector order (``params_of(model)``, listed once, when
        the run was built: the model's parameters stay the same objects)."""
        return self.state.params

    def compute(
        self,
        reducer: GradientReducer | None = None,
        *,
        indices: Tensor | None = None,
        upcoming: Callable[[], Batches] | None = None,
    ) -> Tensor:
        """This worker's vector ``[grad_sum (P), buffer_change_sum (B), loss_sum, count]``
        for this step (:func:`worker.engine.compute.local_gradient`), timed and emulated;
        ``indices`` (int ``[b]``, default the split's for this step) are the items it takes and
        ``upcoming`` gives its batches from this one on, should the loader plan again (default
        :meth:`worker.engine.split.SplitState.upcoming`);
        with ``reducer``, the sum of every worker's vector instead, reduced while backward
        runs (:func:`worker.engine.compute.reduced_gradient`; only forward and backward
        are timed, not the wait for the sum).

        The seconds accounted to the window and the epoch are this worker's *busy*
        time for the step: the compute section plus its own work since the last
        section, not the waits for other ranks in between (:class:`BusyClock`:
        the optimizer step, bookkeeping, reading the batch), so that work a
        worker does outside forward and backward, which a synchronous step waits
        for just the same, also counts against its share. (Sleep emulation pads
        the section only: an emulated slow worker does its own work at the
        host's speed.)

        Keeps the buffers from before the forward pass in ``buffer_base`` and
        this worker's loss sum in ``local_loss``. On the streaming path the batch was
        read ahead; when the split changed since (a rebalance, an exchange, a new epoch)
        the worker plans its remaining steps again first.
        """
        train, emulator = self.train, self.emulator
        assert train is not None and emulator is not None
        taken = self.split.take(self.topo.worker_index) if indices is None else indices
        if len(taken) and not train.expects(taken):
            worker = self.topo.worker_index
            train.plan(upcoming() if upcoming else self.split.upcoming(worker))
        base = self.buffer_base = self.state.snapshot()
        code, model, device, state = self.code, self.model, self.topo.device, self.state
        own_s, waited_s = self.clock.take()
        with hooked_precision(self):
            if reducer is None:
                vector, seconds = emulator.run(
                    lambda: local_gradient(code, model, train, taken, device, state, base),
                    len(taken),
                )
                self.local_loss = float(vector[-2])
            else:
                self.local_loss, seconds = emulator.run(
                    lambda: reduced_gradient(
                        code, model, train, taken, device, state, base, reducer
                    ),
                    len(taken),
                )
        seconds += own_s
        self.window.add(seconds, len(taken), waited_s)
        self.epoch_work.add(seconds, len(taken), waited_s)
        self.clock.section_done()
        if reducer is None:
            return vector
        with self.clock.waiting():
            return reducer.finish()

    def group_reducer(self) -> GradientReducer:
        """The reducer of this worker's group-only sum (periodic, quorum), built at first use."""
        if self.reducer is None:
            n_tail = self.state.n_buffers + 2
            self.reducer = GradientReducer(self.topo, self.params, n_tail, n_groups=1)
        return self.reducer

    def record_batch(self) -> None:
        """Parameter server: keep this step's global batch when batches are being dumped."""
        if self.batches is not None:
            self.batches.append(self.split.global_batch())


def nonfinite_step(run: Run, group: dist.ProcessGroup | None) -> None:
    """After a non-finite sum over ``group`` (None: the world): learn who, then fail or skip.

    Every rank that saw the sum calls this (one collective, :func:`worker.engine.numerics.blame`).
    Raises NonFiniteError with ``on_nonfinite: fail``; otherwise counts the skip.
    """
    faults = None
    if not run.topo.is_ps:
        faults = local_faults(run.local_loss, run.params, run.state.buffers)
    found = blame(run.spec, run.topo.worker_index, faults, group)
    reason = describe(found, epoch=run.epoch, step=run.step + 1)
    if run.spec.on_nonfinite == "fail":
        raise NonFiniteError(reason)
    if run.strategy.counts_skips(run.topo):
        run.skipped += 1
        report.log(f"skipped the optimizer step: {reason}")


# The fewest steps a rebalancing window holds (fewer are noise: two steps, one of them slowed).
MIN_WINDOW_STEPS = 4


def _crossed(now: int, before: int, every: int | None) -> bool:
    return bool(every) and now // every > before // every  # type: ignore[operator]


def rebalance(run: Run, window: Work, *, update: bool = True) -> None:
    """Control point: every rank learns all workers' work and takes the same decision.

    One collective: the work table comes from one allreduce in which each
    worker fills its own entries (sums with zeros, so every rank holds the
    same bits), and the balancer is a pure function of that table and of the
    shares and controller state every rank already shares, so no broadcast of
    the decision is needed. The parameter server logs it.
    """
    compute_s, samples = gather_work(run.topo, window.robust_seconds, window.samples)
    proposal = run.balancer.propose(run.split.shares, compute_s, samples, update=update)
    if proposal is None:
        return
    if run.topo.is_ps:
        rates = run.balancer.estimate  # the rates the proposal was made from
        assert rates is not None
        report.log(
            f"rebalance at step {run.step}: shares {run.split.shares} -> {proposal} "
            f"(predicted imbalance {imbalance(run.split.shares, rates):.1%})"
        )
    run.split.set_shares(proposal)


def _balance_due(run: Run, step: int | None = None) -> bool:
    """A check in the step's schedule (every ``rebalance_every`` steps), unless the window
    since the last check (e.g. the epoch's end, two steps ago) holds fewer than
    ``MIN_WINDOW_STEPS`` steps: then the check waits for the next mark. Every rank knows
    the steps, so all agree. ``step``: at that global step instead of the run's."""
    spec, every = run.spec, run.spec.rebalance_every
    step = run.step if step is None else step
    if spec.split_policy != "weighted" or not every:
        return False
    enough = step - run.last_balance >= min(MIN_WINDOW_STEPS, every)
    return enough and _crossed(step, run.last_balance, every)


def control_due(run: Run, step: int | None = None) -> bool:
    """True when :func:`control_point` at this step will run a collective (every rank agrees).

    ``step``: at that later global step of the epoch instead (by the marks as they are now:
    ``diloco``'s asynchronous exchange finds its next control point ahead of time)."""
    if step is None and run.split.epoch_done:
        return False
    spec = run.spec
    step = run.step if step is None else step
    return (
        _balance_due(run, step)
        or _crossed(step, run.last_checkpoint, spec.checkpoint_every)
        or _agreement_due(run, step)
    )


def _agreement_due(run: Run, step: int | None = None) -> bool:
    """A parameter checksum check in the step's schedule (every ``agreement_every`` steps)."""
    spec = run.spec
    return spec.on_disagreement != "off" and _crossed(
        run.step if step is None else step, run.last_agreement, spec.agreement_every
    )


def reads_model(run: Run) -> bool:
    """True when :func:`control_point` at this step reads the model (a checkpoint or an
    agreement check), so every rank must hold the global one (every rank agrees)."""
    if run.split.epoch_done:
        return False
    every = run.spec.checkpoint_every
    return _crossed(run.step, run.last_checkpoint, every) or _agreement_due(run)


def control_point(run: Run) -> None:
    """After a sync point inside an epoch: check the parameters' agreement, rebalance and
    checkpoint when their marks are crossed."""
    spec = run.spec
    if not control_due(run):
        return
    with run.clock.waiting():  # the control point's collectives wait for every rank
        if _agreement_due(run):
            check_parameters(run)
            run.last_agreement = run.step
        if _balance_due(run):
            rebalance(run, run.window)
            run.window, run.last_balance = Work(), run.step
        if _crossed(run.step, run.last_checkpoint, spec.checkpoint_every):
            checkpoint(run, f"step-{run.step}.pt", epoch_complete=False)
            run.last_checkpoint = run.step


def pull_replica(run: Run) -> None:
    """Replicated strategies: the parameter server takes the first worker's parameters and
    buffers, and the epoch's loss sum and sample count, so far (one point-to-point vector
    ``[params (P), buffers (B)]``, then ``[loss_sum, samples]`` in float64); other workers do
    nothing.

    Both sides skip it when it already happened at this step, so the calls at a
    checkpoint and at the epoch's end cost one transfer.
    """
    if run.pulled_at == run.step:
        return
    run.pulled_at = run.step
    state, topo = run.state, run.topo
    if topo.is_ps:
        state.load_(receive_at_ps(topo, state.n_params + state.n_buffers, run.params[0].dtype, 1))
        totals = receive_at_ps(topo, 2, torch.float64, 1)
        run.loss_sum, run.samples = float(totals[0]), int(round(float(totals[1])))
    elif topo.rank == FIRST_WORKER:
        send_to_ps(topo, state.vector())
        # The totals apart, in float64: a half-precision model's dtype would overflow them.
        send_to_ps(topo, torch.tensor([run.loss_sum, float(run.samples)], dtype=torch.float64))


def checkpoint(run: Run, name: str, *, epoch_complete: bool) -> None:
    """Control point: workers send RNG and local optimizer states; the PS writes ``name``.

    With a replicated optimizer (sync) the parameter server first takes the first
    worker's model (:func:`pull_replica`) and optimizer state, so the checkpoint
    holds what the workers train with.
    """
    replicated = run.strategy.replicated
    if replicated:
        pull_replica(run)
    if run.ledger is not None and not epoch_complete:
        # At an epoch's end the segment was closed before the neighbour exchange.
        run.ledger.close(run.split, epoch=run.epoch, step=run.step)
    local_optimizer = None
    sends = run.topo.rank == FIRST_WORKER if replicated else run.topo.am_i_leader
    if run.optimizer is not None and not run.topo.is_ps and sends:
        local_optimizer = run.optimizer.state_dict()
    states = gather_worker_states(run.topo.is_ps, run.topo.rank, local_optimizer)
    if states is None:
        return
    if replicated and run.optimizer is not None:
        run.optimizer.load_state_dict(states[FIRST_WORKER]["optimizer"])
    per_group = run.strategy.group_optimizers
    leaders = run.spec.leader_ranks()
    state: dict[str, Any] = {
        "model": run.model.state_dict(),
        "optimizer": None if per_group or run.optimizer is None else run.optimizer.state_dict(),
        "group_optimizers": {g: states[r]["optimizer"] for g, r in enumerate(leaders)}
        if per_group
        else None,
        "epoch": run.epoch,
        "step": run.step,
        "epoch_complete": epoch_complete,
        "split": run.split.state_dict(),
        "rng": {r: s["rng"] for r, s in states.items()},
        "excluded_groups": sorted(run.spec.groups[g].name for g in run.excluded_groups),
        "outer_optimizer": run.outer.state_dict() if run.outer is not None else None,
    }
    provenance = run.ledger.drain(run.split.n_items) if run.ledger is not None else None
    save_checkpoint(Path(run.spec.checkpoint_dir) / name, state, provenance)
