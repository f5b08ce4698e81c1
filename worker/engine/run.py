"""State of one rank during training, and the control points every rank passes together.

Both roles hold a :class:`Run`: the parameter server (global model and
optimizer, checkpoints) and each compute worker (its local copy, the
preprocessed data, its speed emulator and, when the sync strategy has
``group_optimizers`` (periodic), its group's optimizer). Every rank holds an
identical load balancer and takes each rebalancing decision itself, from the
same measured work. Control points are collectives every rank of the task joins
(through the groups and the parameter server: worker/engine/distributed.py) at
steps every rank knows in advance: the load-balancing check every
``rebalance_every`` steps and at epoch ends, and checkpoints every
``checkpoint_every`` steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from contracts import sharded_state
from contracts.plan import ROUND_STRATEGIES, guard_first_check_steps
from worker.engine import report
from worker.engine.agreement import check_parameters, hooked_precision
from worker.engine.balance import Balancer, by_group, imbalance, rates_of
from worker.engine.checkpoint import save_checkpoint
from worker.engine.compute import (
    BusyClock,
    Observer,
    Work,
    local_gradient,
    reduced_gradient,
    sharded_gradient,
)
from worker.engine.contract import TrainingCode, default_metrics
from worker.engine.data import Source
from worker.engine.distributed import (  # noqa: F401 (Topology re-exported)
    FIRST_WORKER,
    Topology,
    broadcast_object,
    in_group_control,
    leader_ring,
)
from worker.engine.emulation import SpeedEmulator
from worker.engine.exchange import gather_work, gather_worker_states, receive_at_ps, send_to_ps
from worker.engine.fsdp import (
    assemble_rows_,
    group_sum_,
    outline,
    receive_state_rows,
    rows_numel,
    save_state,
    send_state_rows,
)
from worker.engine.guard import GroupCost, Guard
from worker.engine.numerics import NonFiniteError, blame, describe, local_faults
from worker.engine.provenance import ShardLedger
from worker.engine.reducer import GradientReducer
from worker.engine.ring import LeaderRing
from worker.engine.shard_server import (
    COUNTS,
    RowSum,
    ServerShards,
    SliceExchange,
    round_dtype,
    rows_over_owners,
)
from worker.engine.sharded import local
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
    # Where the guard acts, the attempt's warm point (its second sync point,
    # contracts.plan.warm_point): the steps before it pay one-off costs (an optimizer's lazily
    # made state, the gradients' first allocation), so the guard measures from there
    # (:func:`warm`). Set with the attempt's first epoch (:func:`worker.engine.session.train`),
    # alike on every rank.
    warm_at: int | None = None
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
    # The per-step series (report.StepCurve): restarted at every epoch's start
    # (session.train), added to and reported by the strategies.
    curve: report.StepCurve = field(default_factory=report.StepCurve)
    ledger: ShardLedger | None = None  # the parameter server's shard provenance
    last_agreement: int = 0
    agreement_s: float = 0.0  # wall seconds in the agreement checks (worker.engine.agreement)
    excluded_groups: set[int] = field(default_factory=set)  # left out on disagreement
    outer: torch.optim.Optimizer | None = None  # diloco: the parameter server's outer optimizer
    outer_state: dict[str, Any] | None = None  # its checkpointed state, loaded at first use
    # The parameter server's owners (spec.owner_rounds: ps_shards > 1, or a sharded group's
    # rounds on one shard): rank 0's side under periodic and diloco, made at training's start.
    ps_shards: ServerShards | None = None
    # sync with the server in shards: rank 0's slice-0 sum of the step (made at its start).
    row_sum: RowSum | None = None
    guard: Guard | None = None  # the guard's state where it acts (:func:`guarding`)
    # The throughput profile's step: its last pass's slowest worker's median step seconds,
    # the same on every rank (None: the attempt did not profile); sizes the guard's first check.
    profiled_step_s: float | None = None
    # The stepping leaders' ring (their allreduce, worker.engine.ring), by the set of parked
    # groups; the ring links made so far, by pair (Topology.ring_links and those of the
    # rings without parked groups).
    comm: dict[frozenset[int], LeaderRing | None] = field(default_factory=dict)
    ring_links: dict[frozenset[int], Any] = field(init=False)
    # The process groups of a refresh (:func:`refresh`), by their ranks.
    links: dict[tuple[int, ...], Any] = field(default_factory=dict)
    state: ModelState = field(init=False)
    strategy: Strategy[Run] = field(kw_only=True)
    _tail: Tensor | None = field(default=None, init=False, repr=False)  # sharded: the step's
    grad_fault: bool | None = None  # sharded: this worker's gradient was non-finite before the sum
    # The latest optimizer replica's outline (sync: the source group wrote it into the last
    # checkpoint's state folder, contracts/sharded_state.py); the server never holds it.
    optimizer_in: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.state = ModelState.of(self.model)
        self.ring_links = dict(self.topo.ring_links)
        if guarding(self):
            rounds = self.spec.sync_strategy == "diloco"
            room = [
                None if g.max_local_batch is None else g.max_local_batch * g.workers
                for g in self.spec.groups
            ]
            stays = frozenset(g for g in range(len(self.spec.groups)) if self.spec.sharded(g))
            self.guard = Guard(len(self.spec.groups), rounds=rounds, room=room, stays=stays)

    @property
    def parked_groups(self) -> frozenset[int]:
        """The groups the guard has parked (indices, :mod:`worker.engine.guard`)."""
        return self.guard.parked if self.guard is not None else frozenset()

    @property
    def sharded(self) -> bool:
        """True on a worker of a group that holds its model sharded (:mod:`worker.engine.fsdp`)."""
        return self.spec.sharded(self.topo.group_index)

    @property
    def sharded_step(self) -> bool:
        """True where this worker's step is the sharded one (:meth:`_sharded_part`): every
        worker of a ``sync`` task with a sharded group (the groups' sums meet in every step),
        a sharded group's workers alone under ``periodic`` and ``diloco`` (each group's
        step is its own)."""
        if not self.spec.any_sharded:
            return False
        return self.sharded if self.spec.sync_strategy in ROUND_STRATEGIES else True

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
        this worker's loss sum in ``local_loss``. At a per-step point of training code that
        opts in (``STEP_METRICS``) the user's ``metrics`` also see this worker's output and
        target (:meth:`observer`). On the streaming path the batch was
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
        observe = self.observer() if code.step_metrics else None
        with hooked_precision(self):
            if self.sharded_step:
                self.local_loss, seconds = emulator.run(
                    lambda: self._sharded_part(
                        code, model, train, taken, device, state, base, observe
                    ),
                    len(taken),
                )
            elif reducer is None:
                vector, seconds = emulator.run(
                    lambda: local_gradient(code, model, train, taken, device, state, base, observe),
                    len(taken),
                )
                self.local_loss = float(vector[-2])
            else:
                self.local_loss, seconds = emulator.run(
                    lambda: reduced_gradient(
                        code, model, train, taken, device, state, base, reducer, observe
                    ),
                    len(taken),
                )
        seconds += own_s
        self.window.add(seconds, len(taken), waited_s, own_s)
        self.epoch_work.add(seconds, len(taken), waited_s, own_s)
        self.clock.section_done()
        if self.sharded_step:
            with self.clock.waiting():
                return self._sharded_sum()
        if reducer is None:
            return vector
        with self.clock.waiting():
            return reducer.finish()

    def observer(self) -> Observer | None:
        """At a per-step point (the step this worker computes, ``step + 1``, crossed a
        multiple of the curve's ``every``: :meth:`worker.engine.report.StepCurve.observe_due`),
        what reports the user's ``metrics`` (or the default accuracy) of this worker's part
        of the batch as ``step/train_<name>`` at its own rank; else None."""
        step = self.step + 1
        if not self.curve.observe_due(step):
            return None
        measure = self.code.metrics or default_metrics
        epoch, rank, curve = self.epoch, self.topo.rank, self.curve

        def observe(output: Tensor, target: Tensor) -> None:
            values = measure(output, target)
            curve.send(
                [
                    report.metric_event(
                        f"{report.STEP_SERIES}train_{name}",
                        float(value),
                        step=step,
                        epoch=epoch,
                        rank=rank,
                    )
                    for name, value in values.items()
                ]
            )

        return observe

    def _sharded_part(self, *args: Any) -> float:
        """A worker's forward and backward in a task with a sharded group (its own model
        sharded or whole: :func:`worker.engine.compute.sharded_gradient`); keeps its tail
        for :meth:`_sharded_sum`."""
        loss_sum, self._tail = sharded_gradient(*args)
        return loss_sum

    def _sharded_sum(self) -> Tensor:
        """A task with a sharded group: the step's gradient summed over every group (in
        place, :func:`worker.engine.fsdp.group_sum_`, when there are several; with the
        parameter server in shards each worker's rows through their owners,
        :func:`worker.engine.shard_server.rows_over_owners`; one sharded
        group's reduce-scatter has summed it already), and the returned tail
        ``[buffer_change_sum (B), loss_sum, count]`` summed over every compute worker. Under
        ``periodic`` and ``diloco`` (a sharded group's own step) the reduce-scatter's sum is
        the step's, and the tail is summed over the group."""
        # Whether this worker's gradient (a sharded worker's: its rows of its group's sum) is
        # finite before the groups' sums mix it with the others' (naming where a fault is).
        grads = [p.grad for p in self.params]
        self.grad_fault = any(g is not None and not bool(local(g).isfinite().all()) for g in grads)
        tail = self._tail
        assert tail is not None
        if self.spec.sync_strategy in ROUND_STRATEGIES:  # the group's own step: summed inside
            return sum_in_group(tail, self)
        if self.topo.shards is not None:  # the server's shards sum each worker's rows
            rows_over_owners(grads, self.params, self.topo, self.spec)
        elif len(self.spec.groups) > 1:
            group_sum_(grads, self.params, self.topo)
        return sum_over_stepping(tail, self)

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


def nonfinite_step(run: Run, sum_: Callable[[Tensor], object]) -> None:
    """After a non-finite sum: learn who, then fail or skip. ``sum_`` sums a tensor in place
    over the ranks that saw the sum (:func:`sum_over_stepping`, or over one group).

    Every rank that saw the sum calls this (:func:`worker.engine.numerics.blame`).
    Raises NonFiniteError with ``on_nonfinite: fail``; otherwise counts the skip.
    """
    faults = None
    if not run.topo.is_ps:
        faults = local_faults(run.local_loss, run.params, run.state.buffers)
        if run.grad_fault is not None:  # a task with a sharded group: as before the groups' sum
            faults[1] = run.grad_fault
    found = blame(run.spec, run.topo.worker_index, faults, sum_)
    reason = describe(found, epoch=run.epoch, step=run.step + 1)
    if run.spec.on_nonfinite == "fail":
        raise NonFiniteError(reason)
    if counts_skips(run):
        run.skipped += 1
        report.log(f"skipped the optimizer step: {reason}")


def counts_skips(run: Run) -> bool:
    """True on the rank that counts skipped optimizer steps (the strategy's, but under a
    replicated one with the guard the source worker: the first worker may be parked)."""
    if run.guard is not None and run.strategy.replicated:
        return run.topo.rank == source_worker(run)
    return run.strategy.counts_skips(run.topo)


# The fewest steps a rebalancing window holds (fewer are noise: two steps, one of them slowed).
MIN_WINDOW_STEPS = 4


def _crossed(now: int, before: int, every: int | None) -> bool:
    return bool(every) and now // every > before // every  # type: ignore[operator]


def guarding(run: Run) -> bool:
    """True when the guard acts on this run (:mod:`worker.engine.guard`): ``guard`` on, a
    strategy whose every step waits for every group, the ``weighted`` split (the guard
    decides from the measured rates) and more than one group; with a sharded group, under
    ``periodic`` and ``diloco`` only (a group taken back there takes the global model from
    the parameter server's owners, :func:`catch_up`; under ``sync`` it would take a sharded
    replica whole), and the sharded groups are never parked (:attr:`Guard.stays`), so a task
    of sharded groups only has no guard."""
    spec = run.spec
    return (
        (not spec.any_sharded or spec.sync_strategy in ROUND_STRATEGIES)
        and run.strategy.guards(spec)
        and spec.guard
        and spec.split_policy == "weighted"
        and len(spec.groups) > 1
        and not all(spec.sharded(g) for g in range(len(spec.groups)))  # one it may park
    )


def stepping(run: Run) -> bool:
    """True when this rank takes part in the steps: the parameter server, and every worker
    of a group the guard has not parked."""
    return run.topo.group_index not in run.parked_groups


def source_worker(run: Run) -> int:
    """The compute rank replicated strategies take the model and optimizer from (checkpoints,
    epoch ends, a parked group taken back): the first worker of the first group neither
    parked nor excluded for disagreeing (if every stepping group is excluded, not parked)."""
    out = run.parked_groups
    groups = [g for g in range(len(run.spec.groups)) if g not in out]
    # Not a group left out for disagreeing, while another one steps.
    trusted = [g for g in groups if g not in run.excluded_groups] or groups
    return run.spec.group_ranks(trusted[0])[0]


def stepping_leaders(run: Run) -> list[int]:
    """Global ranks of the leaders of the groups the guard has not parked, in group order."""
    out = run.parked_groups
    return [run.spec.group_ranks(g)[0] for g in range(len(run.spec.groups)) if g not in out]


def step_groups(run: Run) -> LeaderRing | None:
    """This worker's ``cross`` ring for a step: the leaders' of the groups not parked (the
    topology's own when none is; None where this rank is not one of them)."""
    out = run.parked_groups
    if not out:
        return run.topo.cross
    return run.comm[out]


def sum_over_stepping(
    tensor: Tensor, run: Run, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> Tensor:
    """Reduce ``tensor`` (CPU, or a sharded CUDA group's tail: gloo and the ring take both)
    with ``op`` over every stepping worker, in place on each:
    within the group (its gloo ``control`` group), among the stepping groups' leaders
    (:func:`step_groups`), then from each leader to its group. No process group spans the
    workers of several groups (docs/architecture.md, "Process groups")."""
    topo = run.topo
    inner = in_group_control(topo)
    cross = step_groups(run)
    if inner is not None:
        dist.all_reduce(tensor, op=op, group=inner)
    if cross is not None:
        cross.all_reduce(tensor, op=op)
    if inner is not None:
        dist.broadcast(tensor, src=topo.group_ranks[0], group=inner)
    return tensor


def sum_in_group(tensor: Tensor, run: Run) -> Tensor:
    """Sum ``tensor`` over this worker's group, in place (its gloo ``control``; CPU, or a
    sharded CUDA group's tail on its device: gloo takes both)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=run.topo.control)
    return tensor


def _step_comm(run: Run, out: frozenset[int]) -> None:
    """Build the stepping leaders' ring without the groups ``out`` (every rank, together, in
    the same order: a control point; the links between new neighbours are made then), once
    for each set; under ``sync`` only, the one strategy whose step sums among the leaders
    (:func:`step_groups`)."""
    if not out or out in run.comm or run.spec.sync_strategy != "sync":
        return
    spec, topo = run.spec, run.topo
    leaders = [spec.group_ranks(g)[0] for g in range(len(spec.groups)) if g not in out]
    run.comm[out] = leader_ring(leaders, topo.rank, run.ring_links, topo.timeout)


def refresh(run: Run, groups: set[int], source: int) -> None:
    """The workers of ``groups`` take the parameters, buffers, optimizer state and the epoch's
    loss and sample totals of rank ``source`` (point to point): a parked group coming back to
    the step path holds what the others train with. Called on every rank together, the
    parameter server's other shards' owners apart (it makes
    the process group of ``source`` and the targets, once for each such set, where the
    transfer goes); every other rank does nothing more."""
    targets = [r for g in sorted(groups) for r in run.spec.group_ranks(g)]
    members = tuple(sorted({source, *targets}))
    if members not in run.links:
        run.links[members] = dist.new_group(list(members), timeout=run.topo.timeout, backend="gloo")
    link = run.links[members]
    rank, state = run.topo.rank, run.state
    if rank == source:
        vector = state.vector().cpu()
        totals = torch.tensor([run.loss_sum, float(run.samples)], dtype=torch.float64)
        optimizer = run.optimizer.state_dict() if run.optimizer is not None else None
        outlined = outline(optimizer, whole=True) if optimizer is not None else None
        for target in targets:
            dist.send(vector, dst=target, group=link)
            dist.send(totals, dst=target, group=link)
            dist.send_object_list([outlined], dst=target, group=link)  # then a tensor at a time
            if optimizer is not None:
                send_state_rows(optimizer, dst=target, group=link)
    elif rank in targets:
        vector = torch.empty(state.n_params + state.n_buffers, dtype=run.params[0].dtype)
        dist.recv(vector, src=source, group=link)
        state.load_(vector.to(run.topo.device))
        totals = torch.empty(2, dtype=torch.float64)
        dist.recv(totals, src=source, group=link)  # the epoch's loss and samples, which it missed
        run.loss_sum, run.samples = float(totals[0]), int(round(float(totals[1])))
        box: list[Any] = [None]
        dist.recv_object_list(box, src=source, group=link)
        if box[0] is not None:
            received = receive_state_rows(box[0], source, group=link)
            if run.optimizer is not None:
                run.optimizer.load_state_dict(received)


def catch_up(run: Run, groups: set[int]) -> None:
    """Under ``periodic`` and ``diloco`` with a sharded group (the parameter server's owners,
    ``RunSpec.owner_rounds``): the workers of ``groups``, taken back by the guard, take the
    global model and buffers from the owners in a round of their own that adds nothing (no
    sample: ``periodic``'s mean and ``diloco``'s outer step leave the global model as it is),
    each worker its part (:class:`worker.engine.shard_server.SliceExchange`: a whole group's
    chunks, then gathered). Each keeps its own optimizer state, as kept while parked (under
    these strategies every group steps its own), where :func:`refresh` would copy a stepping
    worker's: that worker may be a sharded one, which holds its rows only. Rank 0 commands
    the round; called on every rank together but the other owners (which answer it)."""
    spec, topo, state = run.spec, run.topo, run.state
    leaders = [spec.group_ranks(g)[0] for g in sorted(groups)]
    if topo.is_ps:
        assert run.ps_shards is not None, "a group taken back before the owners were loaded"
        if spec.sync_strategy == "periodic":
            run.ps_shards.mean_round(leaders)  # its sums are 0: nothing counted
        else:
            run.ps_shards.outer_round(leaders)
        _dump_catch_up(run, run.ps_shards.head_slice)
        return
    if topo.group_index not in groups:
        return
    counts = COUNTS[spec.sync_strategy]
    dtype = round_dtype(spec.sync_strategy, run.params[0].dtype)
    take_round(run, torch.zeros(state.n_held + state.n_buffers + 1 + counts, dtype=dtype))
    _dump_catch_up(run, lambda: state.held_params().cpu())


def take_round(run: Run, vector: Tensor) -> None:
    """A member's whole round with the parameter server's owners, at once: send its part of
    ``vector`` (1-D CPU, ``[its held params (n_held), buffer changes (B), loss, counts]``,
    :data:`worker.engine.shard_server.COUNTS` of the strategy), and load the new model's part
    it holds and the buffers (:meth:`worker.engine.shard_server.SliceExchange.round_trip`: a
    whole group's members gather their chunks, a sharded group's take their rows)."""
    state, counts = run.state, COUNTS[run.spec.sync_strategy]
    answer = torch.empty(state.n_held + state.n_buffers, dtype=vector.dtype)
    slices = SliceExchange.of_member(run.topo, run.params, counts, sharded=run.sharded)
    state.load_held_(slices.round_trip(vector, answer))


def _dump_catch_up(run: Run, held: Callable[[], Tensor]) -> None:
    """Tests (``debug_dump_dir``): what a rank holds of the global model after
    :func:`catch_up` (rank 0 slice 0 of the parameters, a worker its part; both the buffers)
    as ``catch-up-<rank>-<step>.pt``: ``{"params", "buffers"}``."""
    if run.spec.debug_dump_dir:
        folder = Path(run.spec.debug_dump_dir)
        folder.mkdir(parents=True, exist_ok=True)
        dump = {"params": held().detach().clone(), "buffers": run.state.buffers_vector().cpu()}
        torch.save(dump, folder / f"catch-up-{run.topo.rank}-{run.step}.pt")


def _group_costs(
    run: Run, columns: tuple[list[float], ...]
) -> tuple[dict[int, GroupCost], float, float]:
    """Each stepping group's measured cost per local step (:class:`worker.engine.guard.
    GroupCost`) and the overhead of a step of the split (seconds: its wall time beyond the
    busiest worker's busy time), from the window's gathered ``(busy s, samples, own s, local
    steps, wall s)`` columns and its split steps (since the last check); a group with a
    worker that took no sample in the window is left out of the costs. Also the window's
    wall seconds a split step (its slowest worker's)."""
    busy, samples, own, steps, wall = columns
    split_steps = max(1, run.step - window_start(run))
    costs: dict[int, GroupCost] = {}
    busiest, longest = 0.0, 0.0
    for g in range(len(run.spec.groups)):
        if g in run.parked_groups:
            continue
        fixed, rate, measured = 0.0, 0.0, True
        for w in (r - 1 for r in run.spec.group_ranks(g)):
            if steps[w] <= 0 or samples[w] <= 0:
                measured = False
                continue
            per_step, own_per_step = busy[w] / steps[w], own[w] / steps[w]
            busiest = max(busiest, busy[w] / split_steps)
            longest = max(longest, wall[w] / split_steps)
            section = per_step - own_per_step
            fixed = max(fixed, own_per_step)
            rate += samples[w] / steps[w] / section if section > 0 else 0.0
        if measured and rate > 0:
            costs[g] = GroupCost(fixed_s=fixed, rate=rate)
    return costs, longest - busiest, longest


def guard_check(run: Run, columns: tuple[list[float], ...]) -> bool:
    """Control point, where the guard acts: take the window's costs, then park one group or
    take one back when the guard's prediction says the step gets shorter
    (:meth:`worker.engine.guard.Guard.decide`). Returns True when a group moved: the shares
    are set for the new groups (the balancer's usual move waits for the next window).

    A move is a guard event of the task (:func:`worker.engine.report.guard`) and a log line;
    a group taken back first takes the model and optimizer state from the first stepping
    worker (:func:`refresh`), or beside a sharded group the global model from the parameter
    server's owners, keeping its own optimizer state (:func:`catch_up`). A window that holds
    the attempt's first steps (not yet :func:`warm`) is neither judged nor kept as a group's
    costs (a test's schedule still moves groups there).
    """
    guard = run.guard
    assert guard is not None
    schedule = run.spec.debug_guard_schedule
    if schedule is None and not warm(run):
        return False  # the window holds the attempt's first steps' one-off costs (warm_at)
    costs, overhead, step_s = _group_costs(run, columns)
    before = guard.parked
    stepping_now = len(run.spec.groups) - len(before)
    # A window in which no group was measured has no step time (not one of 0 s).
    guard.observe(costs, overhead, stepping_now, step_s if step_s > 0 else None)
    if schedule is None:
        after = guard.decide(run.spec.global_batch_size, left_out=run.excluded_groups)
    else:  # a test's schedule moves the groups, alone
        after = frozenset(g for g in schedule.get(run.step, before) if g not in guard.stays)
    if after == before:
        return False
    workers = {r - 1 for g in after for r in run.spec.group_ranks(g)}
    keep = [w for w in range(run.topo.n_workers) if w not in workers | run.balancer.excluded]
    if not run.balancer.holds(keep):  # (a test's schedule: the guard's own moves hold it)
        guard.probation = None
        if run.topo.is_ps:
            names = [run.spec.groups[g].name for g in sorted(after - before)]
            report.log(
                f"guard: groups {names} stay at step {run.step}: without them the others' "
                f"max_local_batch cannot hold the global batch {run.spec.global_batch_size}"
            )
        return False
    # The balancer sizes the new shares by its rate estimate: take this window into it first
    # (the parked workers' rates are kept; at the first check there was none yet).
    busy, samples = columns[0], columns[1]
    run.balancer.update_estimate(
        rates_of(busy, samples), [t > 0 and n > 0 for t, n in zip(busy, samples, strict=True)]
    )
    source = source_worker(run)
    now_s = guard.priced_s(
        [g for g in range(guard.n_groups) if g not in before], run.spec.global_batch_size
    )
    then_s = guard.priced_s(
        [g for g in range(guard.n_groups) if g not in after], run.spec.global_batch_size
    )
    shares = run.balancer.park(workers, run.split.shares)
    guard.parked = after
    if before - after and run.spec.any_sharded:  # periodic, diloco: from the owners
        catch_up(run, set(before - after))
    elif before - after:
        refresh(run, set(before - after), source)
    _step_comm(run, after)
    if run.reducer is not None:
        run.reducer.close()
        run.reducer = None
    for g in sorted(before ^ after):
        name = run.spec.groups[g].name
        what = "parked" if g in after else "taken back"
        why = f"predicted step {now_s * 1000:.1f} ms -> {then_s * 1000:.1f} ms"
        if guard.undone is not None:
            was_s, parked_s = guard.undone
            why = (
                f"the step measured {parked_s * 1000:.1f} ms without it, {was_s * 1000:.1f} ms with"
            )
        reason = f"group {name!r} {what} at step {run.step}: {why} (shares {shares})"
        if run.topo.is_ps:
            report.guard(reason, group=name)
            report.log(f"guard: {reason}")
    run.split.set_shares(shares)
    return True


def rebalance(run: Run, window: Work, *, update: bool = True, shares: bool = True) -> None:
    """Control point: every rank learns all workers' work and takes the same decision.

    One collective: the work table comes from one allreduce in which each
    worker fills its own entries (sums with zeros, so every rank holds the
    same bits), and the balancer is a pure function of that table and of the
    shares and controller state every rank already shares, so no broadcast of
    the decision is needed. The parameter server logs it. Where the guard acts, it
    decides first, on a fresh window (``update``), and a move it makes is the check's;
    ``shares`` False: the guard's check only (:func:`guard_due`'s first check, off the
    balancer's ``rebalance_every`` schedule). Where the guard acts, neither it nor the balancer
    decides on a window up to the attempt's warm point (:func:`warm`): one round's
    one-off costs at a third of a core cut the slow group's share from 15 to 8 of 64.
    """
    columns = gather_work(
        run.topo,
        window.robust_seconds,
        window.samples,
        window.own_s,
        window.steps,
        (window.closed or time.perf_counter()) - window.opened,
    )
    compute_s, samples = columns[0], columns[1]
    if run.guard is not None and update and guard_check(run, columns):
        return
    if not shares:  # the guard's own first check: the balancer keeps to its schedule
        return
    if run.warm_at is not None and run.step <= run.warm_at:
        return  # a window of the first steps' one-off costs (warm): the next one decides
    proposal = run.balancer.propose(run.split.shares, compute_s, samples, update=update)
    if proposal is None:
        return
    if run.topo.is_ps:
        # Why it moved: the rates the proposal was made from (the balancer's estimate,
        # averaged over the checks' windows), by group, and the imbalance they predict.
        rates = run.balancer.estimate
        assert rates is not None
        groups = [(g.name, g.workers) for g in run.spec.groups]
        report.log(
            f"rebalance at step {run.step}: shares {run.split.shares} -> {proposal} "
            f"(predicted imbalance {imbalance(run.split.shares, rates, run.balancer.caps):.1%} "
            f"at the measured samples/s {by_group(rates, groups)})"
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
    enough = step - window_start(run, step) >= min(MIN_WINDOW_STEPS, every)
    return enough and _crossed(step, run.last_balance, every)


def guard_due(run: Run, step: int | None = None) -> bool:
    """True when the control point at this step (``step``: at that later global step)
    runs a rebalancing check at which the guard may park a group or take one back: every
    rebalancing check (:func:`guard_check` judges none up to the attempt's warm point,
    :func:`warm`), and the first control point
    :func:`contracts.plan.guard_first_check_steps` steps after that point (4 to
    ``GUARD_CHECK_STEPS``, as many as the profiled step fills 4 s with) while the guard has
    measured nothing (so a
    task without in-epoch rebalancing, ``diloco``'s overlapped and async exchanges, does
    not run its first epoch on a group that costs more than it adds). Every rank holds the
    same guard state, so all agree."""
    if run.guard is None:  # (it acts with the weighted split only: guarding)
        return False
    step = run.step if step is None else step
    first_at = guard_first_check_steps(run.profiled_step_s)
    first = not run.guard.costs and warm(run, step) and step - window_start(run, step) >= first_at
    return first or _balance_due(run, step)


def warm(run: Run, step: int | None = None) -> bool:
    """True past the attempt's warm point (``run.warm_at``,
    :func:`contracts.plan.warm_point`) at global step ``step`` (default the run's): a
    rebalancing window from there holds none of the first steps, whose one-off costs (an
    optimizer's state made at its first step: two model-sized tensors for Adam, written at
    a third of a core's speed on a throttled CPU group; the gradients' first allocation; on
    a GPU, kernels chosen and memory pooled) would make a group look many times slower than
    it is. The guard judges no window before it."""
    step = run.step if step is None else step
    return run.warm_at is not None and step > run.warm_at


def window_start(run: Run, step: int | None = None) -> int:
    """The global step the current rebalancing window counts from at global step ``step``
    (default the run's): the last check's, or the attempt's warm point
    (``run.warm_at``) once it has passed, where every worker started a window without its
    first steps' one-off costs (:func:`control_point`). A function of steps every rank
    knows, so all agree."""
    if not warm(run, step):
        return run.last_balance
    assert run.warm_at is not None
    return max(run.last_balance, run.warm_at)


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
        or guard_due(run, step)
        or _crossed(step, run.last_checkpoint, spec.checkpoint_every)
        or _agreement_due(run, step)
    )


def _agreement_due(run: Run, step: int | None = None) -> bool:
    """A parameter checksum check in the step's schedule (every ``agreement_every`` steps),
    for the strategies that run it (replicated ones, ``sync``: :func:`check_parameters`);
    never due under the others, so it adds no barrier to their rounds."""
    spec = run.spec
    return (
        spec.on_disagreement != "off"
        and run.strategy.replicated
        and _crossed(run.step if step is None else step, run.last_agreement, spec.agreement_every)
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
        if run.step == run.warm_at:
            _warm_window(run)
        return
    started, window = time.perf_counter(), run.window
    window.closed = started  # a check here measures the window up to this control point
    with run.clock.waiting():  # the control point's collectives wait for every rank
        if _agreement_due(run):
            check_parameters(run)
            run.last_agreement = run.step
        if _balance_due(run) or guard_due(run):
            rebalance(run, run.window, shares=_balance_due(run))
            run.window, run.last_balance = Work(), run.step
        if _crossed(run.step, run.last_checkpoint, spec.checkpoint_every):
            checkpoint(run, f"step-{run.step}.pt", epoch_complete=False)
            run.last_checkpoint = run.step
    if run.step == run.warm_at:
        _warm_window(run)  # (a check may have started a new window: its wall time stands)
    if run.window is window:  # the window goes on: its wall time leaves the control point out
        window.closed = None
        window.opened += time.perf_counter() - started
    else:  # a new window (a rebalancing check): its wall time starts here
        run.window.opened = time.perf_counter()


def _warm_window(run: Run) -> None:
    """At the attempt's warm point (:func:`warm`): a new window, unless a check here just
    started one."""
    if run.step != run.last_balance:
        run.window = Work()


def pull_replica(run: Run) -> None:
    """Replicated strategies: the parameter server takes the parameters and buffers of the
    source worker (:func:`source_worker`: not in a parked group), and the epoch's loss sum
    and sample count, so far (one point-to-point vector
    ``[params (P), buffers (B)]``, then ``[loss_sum, samples]`` in float64); other workers do
    nothing.

    Both sides skip it when it already happened at this step, so the calls at a
    checkpoint and at the epoch's end cost one transfer.
    """
    if run.pulled_at == run.step:
        return
    run.pulled_at = run.step
    state, topo = run.state, run.topo
    source = source_worker(run)
    if run.spec.sharded(run.spec.group_of(source)):
        _pull_sharded(run, source)
    elif topo.is_ps:
        n = state.n_params + state.n_buffers
        state.load_(receive_at_ps(topo, n, run.params[0].dtype, source))
        totals = receive_at_ps(topo, 2, torch.float64, source)
        run.loss_sum, run.samples = float(totals[0]), int(round(float(totals[1])))
    elif topo.rank == source:
        send_to_ps(topo, state.vector())
        # The totals apart, in float64: a half-precision model's dtype would overflow them.
        send_to_ps(topo, torch.tensor([run.loss_sum, float(run.samples)], dtype=torch.float64))


def _pull_sharded(run: Run, source: int) -> None:
    """:func:`pull_replica` from a sharded group: every member sends the parameter server its
    own rows of every parameter (one vector each, point to point), so no worker gathers the
    whole model; the server assembles them (:func:`worker.engine.fsdp.assemble_rows_`), then takes
    the buffers and the totals from ``source`` as from a whole replica."""
    state, topo, spec = run.state, run.topo, run.spec
    group = spec.group_of(source)
    members = spec.group_ranks(group)
    width = len(members)
    if topo.is_ps:
        dtype = run.params[0].dtype
        vectors = [
            _recv(rows_numel(run.params, i, width), dtype, member, topo.link(member))
            for i, member in enumerate(members)
        ]
        assemble_rows_(run.params, vectors)
        if state.buffers:
            state.load_buffers_(_recv(state.n_buffers, dtype, source, topo.link(source)))
        totals = _recv(2, torch.float64, source, topo.link(source))
        run.loss_sum, run.samples = float(totals[0]), int(round(float(totals[1])))
    elif topo.rank in members:
        link = topo.link(0)
        dist.send(state.held_params().cpu(), dst=0, group=link)
        if topo.rank == source:
            if state.buffers:
                dist.send(state.buffers_vector().cpu(), dst=0, group=link)
            totals = torch.tensor([run.loss_sum, float(run.samples)], dtype=torch.float64)
            dist.send(totals, dst=0, group=link)


def _recv(numel: int, dtype: torch.dtype, src: int, group: Any) -> Tensor:
    buffer = torch.empty(numel, dtype=dtype)
    dist.recv(buffer, src=src, group=group)
    return buffer


def _write_error(exc: BaseException) -> str:
    """What went wrong in a DCP write, in a line: the first member's own error (DCP wraps
    every member's in one CheckpointException with their tracebacks)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return f"{type(exc).__name__}: {exc}"[:500]


FAILED_WRITE = "failed_write"
"""In a sharded source group's gathered outline: the error its members' DCP write raised."""


def saved_model(run: Run, name: str) -> dict[str, Any]:
    """The parameter server's entries of checkpoint ``name`` for its model: ``model`` and
    ``outer_optimizer`` (``diloco``; None elsewhere), and where the owners hold the model
    (``RunSpec.model_in_slices``) ``model_slices``, each owner having written its slice
    (contracts/sharded_state.py); else the model whole."""
    if run.ps_shards is not None:
        model, slices, outer = run.ps_shards.write_model(name, run.model)
        return {"model": model, sharded_state.MODEL_SLICES: slices, "outer_optimizer": outer}
    outer = run.outer.state_dict() if run.outer is not None else None
    return {"model": run.model.state_dict(), "outer_optimizer": outer}


def checkpoint(run: Run, name: str, *, epoch_complete: bool) -> None:
    """Control point: workers send their RNG states, and write the optimizer states the
    checkpoint keeps into its state folders (contracts/sharded_state.py); the PS writes
    ``name``, naming those folders.

    With a replicated optimizer (sync) the parameter server first takes the source
    worker's model (:func:`pull_replica`, :func:`source_worker`), and the source group
    writes the optimizer state, so the checkpoint holds what the workers train with.
    """
    replicated = run.strategy.replicated
    if replicated:
        pull_replica(run)
    if run.ledger is not None and not epoch_complete:
        # At an epoch's end the segment was closed before the neighbour exchange.
        run.ledger.close(run.split, epoch=run.epoch, step=run.step)
    local_optimizer = None
    source = source_worker(run)
    # A parked group's optimizer is not sent: it takes the source's when taken back, and the
    # checkpoint keeps that for it (its slow link would hold up every checkpoint); but beside a
    # sharded group (periodic, diloco) it keeps its own when taken back (catch_up), so the
    # checkpoint keeps its own too, which its leader writes.
    own = run.strategy.group_optimizers and run.spec.any_sharded
    sends = (
        run.topo.rank == source if replicated else run.topo.am_i_leader and (stepping(run) or own)
    )
    source_group = run.spec.group_of(source)
    # No optimizer state is gathered: where a checkpoint keeps the workers' (sync's replica,
    # each group's under periodic and diloco), those who hold it write it, all at once, into
    # the checkpoint's state folders (torch.distributed.checkpoint): a sharded source group's
    # members their rows, a whole source worker or a stepping group leader its whole state.
    # The outline naming the files travels in the gather.
    per_group = run.strategy.group_optimizers
    writes = replicated or per_group
    # Whose state is written in rows: the sharded source group's members (a replica), or under
    # periodic and diloco every member of a sharded stepping group (its group's state).
    writer = source_group if replicated else run.topo.group_index if stepping(run) else None
    sharded: list[int] = []
    if writes and writer is not None and run.spec.sharded(writer):
        sharded = run.spec.group_ranks(writer)
    failed: BaseException | None = None
    folder = None
    writing = run.topo.rank in sharded or (writes and sends and not run.topo.is_ps)
    if run.optimizer is not None and writing:
        group = None if replicated else run.topo.group_index
        folder = Path(run.spec.checkpoint_dir) / sharded_state.folder_of(name, group)
    if folder is not None and run.optimizer is not None:
        try:
            written = save_state(run.optimizer, folder, run.topo, sharded=bool(sharded))
        except (Exception, CheckpointException) as exc:  # sharded: on every member alike
            failed, written = exc, {FAILED_WRITE: _write_error(exc)}
        local_optimizer = written if sends or failed is not None else None
    # Joined even after a failed write: the server tells every rank, which all fail now
    # with the reason rather than at the process group's timeout.
    states = gather_worker_states(run.topo, local_optimizer)
    if writes:
        told = None
        for r, sent in sorted((states or {}).items()):
            if isinstance(sent["optimizer"], dict) and FAILED_WRITE in sent["optimizer"]:
                told = f"rank {r} could not write its optimizer state for {name}: "
                told += str(sent["optimizer"][FAILED_WRITE])
                break
        told = broadcast_object(told, run.topo)
        if told is not None:
            raise RuntimeError(told) from failed
    if states is None:
        return
    optimizer_state = None
    if replicated and run.optimizer is not None:
        optimizer_state = states[source]["optimizer"]  # the outline: its state folder holds it
        run.optimizer_in = optimizer_state  # not loaded: the server never steps it (final.pt)
    leaders = run.spec.leader_ranks()
    state: dict[str, Any] = {
        **saved_model(run, name),
        "optimizer": optimizer_state
        if optimizer_state is not None
        else None
        if per_group or run.optimizer is None
        else run.optimizer.state_dict(),
        "group_optimizers": {
            g: states[source if g in run.parked_groups and not own else r]["optimizer"]
            for g, r in enumerate(leaders)
        }
        if per_group
        else None,
        "epoch": run.epoch,
        "step": run.step,
        "epoch_complete": epoch_complete,
        "split": run.split.state_dict(),
        "rng": {r: s["rng"] for r, s in states.items()},
        "excluded_groups": sorted(run.spec.groups[g].name for g in run.excluded_groups),
    }
    provenance = run.ledger.drain(run.split.n_items) if run.ledger is not None else None
    save_checkpoint(Path(run.spec.checkpoint_dir) / name, state, provenance)
