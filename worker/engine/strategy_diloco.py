"""DiLoCo across groups: speed-scaled local steps, normalised pseudo-gradients, an outer optimizer.

Inside a group every step is synchronous and exact, as with ``periodic``: the
in-group allreduce sums per-sample gradients and counts, every member divides
by the group's count and steps its own copy of the user's optimizer (the
*inner* optimizer). Across groups the unit is a *round*: the ``sync_period`` = H
steps of the split's schedule up to the next multiple of H in the epoch (or the
epoch's end). In a round every worker takes the samples the split assigns it
for those H steps, but a group takes them in its own number of local steps:

- ``split_policy: weighted``: the split's shares follow each worker's measured
  samples/s, so a group's samples in the round are in proportion to its speed. A
  group takes them in steps of the task's global batch B, as it would train alone:
  ``tau_g = clamp(round(n_g / B), 1, H)`` local steps, ``n_g`` its round samples (a
  round holds H global batches in all). A group at a third of the speed takes a third
  as many steps, each as large as a faster group's (not H steps of a third of the
  size, whose fixed costs, the backward over every parameter and the update, would
  dominate), and a faster group takes fewer steps than H, each of B samples, rather
  than H smaller ones: at 10M parameters a step costs about the same at 50 samples as
  at 64 (its weights' traffic and the update dominate), so only fewer steps make the
  fast group faster. Every group then spends about the same time on its round, so none
  waits long for another (Liu et al., "Asynchronous Local-SGD Training for Language
  Modeling", 2024, arXiv 2401.09135: local step counts scaled to each worker's speed).
- ``even``: every group takes H local steps of the split's shares.

At the round's end each leader sends its *pseudo-gradient*
``Delta_g = theta_start - theta_g`` normalised by its local step count and
weighted by its samples, ``n_g Delta_g / tau_g``, with ``n_g tau_g`` and
``n_g``; the parameter server forms the FedNova update (Wang et al., "Tackling
the Objective Inconsistency Problem in Heterogeneous Federated Optimization",
NeurIPS 2020)::

    d = tau_eff * sum_g (n_g / n) Delta_g / tau_g,   tau_eff = sum_g (n_g / n) tau_g

(plain averaging of unequal step counts would weight the groups by their step
counts and converge to another objective), sets it as the gradient of the
global model and steps the *outer* optimizer: SGD with Nesterov momentum
(``outer_lr``, ``outer_momentum``; Douillard et al., "DiLoCo: Distributed
Low-Communication Training of Language Models", 2023). The result goes back to
every worker, which starts the next round from it (``diloco_exchange: blocking``), or
takes it a round late (``overlapped``, :class:`RoundExchange`); with ``async`` the server
applies each group's part as it arrives and answers that group alone
(:class:`AsyncServer`). With outer lr 1 and no
momentum the outer step is ``theta_start - d``; with equal step counts that is
the sample-weighted mean of the group models, which is ``periodic``.

Buffers are not moved by the outer optimizer: as with ``periodic``, each group's
buffer change over the round is weighted by ``n_g`` and the parameter server
adds the weighted mean (integer buffers rounded). The inner optimizers' state
stays with each group; the outer optimizer's momentum lives on the parameter
server and is checkpointed (``outer_optimizer``). Rounds end at multiples of H
inside the epoch and every control point (checkpoint, rebalance, agreement
check) comes after a round, so a checkpoint is always at a round's end and a
resume continues exactly.

Trade-off: one exchange per round, and a slower group adds its samples without
adding its step count to every round; but the groups' models drift apart
during a round, so per sample it converges more slowly than ``sync`` (more so
with a long round or a high inner learning rate), and it is not step-for-step
equal to a single process.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from contracts.plan import local_steps  # noqa: F401 (the engine's and the planner's rule)
from worker.engine import report
from worker.engine.distributed import Arrivals, Topology
from worker.engine.exchange import (
    broadcast_down,
    expect_at_ps,
    gather_at_ps,
    post_from_ps,
    post_to_leader,
    post_to_ps,
    receive_any_at_ps,
    vector_to_grads,
    wait_all,
)
from worker.engine.run import (
    Run,
    control_due,
    control_point,
    guard_due,
    reads_model,
    stepping,
    stepping_leaders,
)
from worker.engine.shard_server import COUNTS, ServerShards, SliceExchange, round_dtype, sgd_over
from worker.engine.sharded import local
from worker.engine.sharding import Batches, even_shares
from worker.engine.split import SplitState
from worker.engine.state import ModelState
from worker.engine.strategy import Strategy
from worker.engine.strategy_sync import (
    PROGRESS_REPORTS_PER_EPOCH,
    group_step,
    report_progress,
    step_point,
)

# The tail of a leader's round vector: [loss_sum, n_g * tau_g, n_g].
TAIL = 3


def round_end(split: SplitState, period: int, start: int) -> int:
    """The in-epoch step at which the round starting at step ``start`` ends: the next
    multiple of ``period`` (H), or the epoch's last step."""
    return min((start // period + 1) * period, split.steps_per_epoch)


def round_samples(split: SplitState, start: int, end: int) -> list[int]:
    """Samples each worker takes in the split's steps ``[start, end)`` of this epoch."""
    before, after = split.needs_from(start), split.needs_from(end)
    return [a - b for a, b in zip(before, after, strict=True)]


def chunk_counts(split: SplitState, worker: int, start: int, end: int, steps: int) -> list[int]:
    """Worker ``worker``'s samples in each of its group's ``steps`` local steps of the round
    ``[start, end)``: the split's own per-step counts when the group takes one local step per
    split step, else its round samples in ``steps`` near-equal parts; none when the group
    takes no step (it has no samples this round: left out, or a short last round)."""
    if steps == 0:
        return []
    if steps == end - start:
        return [split.counts(t)[worker] for t in range(start, end)]
    return even_shares(round_samples(split, start, end)[worker], steps)


def group_samples(run: Run, start: int, end: int) -> list[int]:
    """Every group's samples ``n_g`` in the round ``[start, end)`` under the split's shares."""
    samples = round_samples(run.split, start, end)
    return [
        sum(samples[r - 1] for r in run.spec.group_ranks(g)) for g in range(len(run.spec.groups))
    ]


def group_steps(run: Run, start: int, end: int, totals: list[int] | None = None) -> list[int]:
    """Every group's local steps in the round ``[start, end)`` under the split's shares
    (``totals``: its :func:`group_samples`, when the caller has them); with a group's
    ``max_local_batch``, at least as many as keep each of its workers' local steps within
    it (:func:`capped_steps`)."""
    spec = run.spec
    batch = spec.global_batch_size if spec.split_policy == "weighted" else None
    totals = group_samples(run, start, end) if totals is None else totals
    steps = local_steps(totals, end - start, batch=batch)
    caps = spec.local_batch_caps
    if caps is None:
        return steps
    samples = round_samples(run.split, start, end)
    return [
        capped_steps(steps[g], [(samples[r - 1], caps[r - 1]) for r in spec.group_ranks(g)])
        for g in range(len(spec.groups))
    ]


def capped_steps(steps: int, workers: list[tuple[int, int | None]]) -> int:
    """A group's local steps in a round: ``steps``, or more where a worker's round samples in
    ``steps`` near-equal parts (:func:`chunk_counts`) would exceed its cap (``workers``: each
    worker's ``(round samples, cap)``, None: no cap). No more than the round's split steps
    are needed: a share is within its cap. A group of no steps (no samples) keeps none."""
    if steps == 0:
        return 0
    return max([steps, *(math.ceil(n / cap) for n, cap in workers if cap is not None)])


class RoundPlan:
    """One worker's local steps for the rest of the epoch, under the split's current shares.

    ``rounds[r]`` is ``(start, end, counts)``: the split steps the round spans and this
    worker's sample count in each of its group's local steps. The indices come from the
    worker's shard in order, from where the split stands when the plan is made.
    """

    def __init__(self, run: Run) -> None:
        split, period, topo = run.split, run.spec.sync_period, run.topo
        worker, group = topo.worker_index, topo.group_index
        assert group is not None
        self.rounds: list[tuple[int, int, list[int]]] = []
        start = split.step
        while start < split.steps_per_epoch:
            end = round_end(split, period, start)
            steps = group_steps(run, start, end)[group]
            self.rounds.append((start, end, chunk_counts(split, worker, start, end, steps)))
            start = end
        self.flat = split.shards[worker][split.used[worker] :]
        self.shares = list(split.shares)

    def upcoming(self, round_index: int, chunk: int, offset: int) -> Batches:
        """The batches from local step ``chunk`` of round ``round_index`` to the epoch's end,
        ``offset`` being the samples this plan has handed out before it."""
        counts = list(self.rounds[round_index][2][chunk:])
        for _, _, later in self.rounds[round_index + 1 :]:
            counts += later
        return Batches(self.flat[offset:], counts)


def outer_optimizer(run: Run) -> torch.optim.Optimizer:
    """The parameter server's outer optimizer over the global model, built at first use (from
    ``run.outer_state``, a checkpoint's, when there is one): SGD with ``outer_lr`` and, when
    ``outer_momentum`` > 0, Nesterov momentum. A resumed run takes the checkpoint's momentum
    but the spec's ``outer_lr`` and ``outer_momentum``, as the sharded server's owners do
    (:class:`worker.engine.shard_server.OuterSlice`): a resume that changes them uses the
    new values."""
    if run.outer is None:
        run.outer = sgd_over(run.spec, run.params)
        if run.outer_state is not None:
            settings = [dict(group) for group in run.outer.param_groups]
            run.outer.load_state_dict(run.outer_state)
            for group, wanted in zip(run.outer.param_groups, settings, strict=True):
                group.update({k: v for k, v in wanted.items() if k != "params"})
            run.outer_state = None
    return run.outer


class RoundExchange:
    """A compute worker's side of the rounds' exchange with the parameter server, one epoch.

    ``base`` (``[P + B]``; a sharded worker's ``[its rows, B]``,
    :meth:`worker.engine.state.ModelState.held_vector`) is the model at the current round's
    start. At a round's end
    (:meth:`end_round`) the worker forms ``D = base - now``; the leader (with the server in
    shards, every member its chunk) sends
    ``[n_g D_P / tau_g (P), -n_g D_B (B), loss_sum, n_g tau_g, n_g]`` (the pseudo-gradient
    and the buffers' change, this module's docstring) and posts the receive of the global
    model that the parameter server makes from every group's vector.

    - ``blocking``: the worker then waits for that model and starts the next round from it.
    - ``overlapped``: it starts the next round from its own model at once, and takes the
      global model at the *next* round's end, keeping that round's own progress on top of it:
      ``base' = global + (now - base)`` (the outer update arrives one round late; Douillard
      et al., "Streaming DiLoCo with overlapping communication", 2025, arXiv 2501.18512; Liu
      et al. 2024, arXiv 2401.09135). The pseudo-gradient it sends is that round's own
      progress, which the server applies to its current global model (the one the worker
      takes at that same round's end).

    Where every rank must hold the global model (a checkpoint, an agreement check, the
    epoch's end) the worker drains the exchange (:meth:`drain`). Every member of a whole group
    forms the same ``D`` and ``base`` from its identical model. With one server only the
    leader talks to it, and the other members take the global model from it by a broadcast
    in the group; with the server in shards every member sends its chunk of the vector and
    takes its chunk of the global model, and the members gather the chunks
    (:class:`worker.engine.shard_server.SliceExchange`). A sharded (``fsdp``) group's member
    forms ``D`` and ``base`` from its own rows, sends them and takes back its rows of the
    global model (with one shard from rank 0, which owns it all).
    Buffers: ``base`` holds them whole and every rank's model changes alike, so integer
    buffers (counters) stay exact.
    """

    def __init__(self, run: Run) -> None:
        state = run.state
        # A sharded (fsdp) worker's vectors hold its own rows of the parameters (n_held).
        self.size, self.n_held = state.n_held + state.n_buffers, state.n_held
        self.base = state.held_vector().cpu().to(exchange_dtype(run))
        # The round's buffers, made at its end and let go by a drain (:meth:`_round_buffers`).
        self.send = self.receive = self.base.new_empty(0)
        self.sends: list[Any] = []
        self.receives: list[Any] = []
        self.pending = False  # a global model is on its way
        # The parameter server in shards: every member sends its chunk, each slice of it to
        # the slice's owner (worker.engine.shard_server).
        self.slices = None
        if run.topo.shards is not None:
            counts = COUNTS["diloco"]
            self.slices = SliceExchange.of_member(run.topo, run.params, counts, sharded=run.sharded)

    @torch.no_grad()
    def end_round(self, run: Run, totals: list[float], *, drain: bool) -> None:
        """The round's end: send this group's vector (``totals`` = ``[loss_sum, n_g, tau_g]``,
        the group's, alike on every member), take the global model that is due, and with
        ``drain`` wait for the one just asked for too.

        The pseudo-gradient, the merge and (``blocking``) the upload are this
        worker's own work, the rest of the transfers waits
        (:class:`worker.engine.compute.BusyClock`), so a group whose exchange costs it more
        gets a smaller share of the data."""
        state, topo = run.state, run.topo
        with run.clock.waiting():
            wait_all(self.sends)  # the last round's vector is out of the send buffer
        self._round_buffers()
        delta = self.send[: self.size]
        self._base_minus_model(state, delta)
        if self.pending:
            self._take_global(run)
            torch.sub(self.receive, delta, out=self.base)  # the global model plus own progress
            state.load_held_(self.base)
        elif not drain:
            torch.sub(self.base, delta, out=self.base)  # the model now (a drain replaces it)
        if topo.am_i_leader or self.slices is not None:  # every member forms the same one
            loss_sum, samples, steps = totals
            delta[: self.n_held].mul_(samples / steps if steps > 0 else 0.0)
            delta[self.n_held :].mul_(-samples)
            self.send[self.size :] = self.send.new_tensor([loss_sum, samples * steps, samples])
            if self.slices is not None:
                self.sends, self.receives = self.slices.post(self.send, self.receive)
            else:
                self.sends = post_to_ps(topo, self.send)
                self.receives = post_from_ps(topo, self.receive)
            if run.spec.diloco_exchange == "blocking":
                # The upload is the group's own cost (the server takes every group's at once),
                # so it counts as busy: a group whose link or CPU makes it slow gets a smaller
                # share of the data, as its slower steps would.
                wait_all(self.sends)
                self.sends = []
        self.pending = True
        if drain:
            self.drain(run)

    @torch.no_grad()
    def drain(self, run: Run) -> None:
        """Wait for the global model on its way, if any, and load it (the model then is the
        global one on every rank)."""
        if not self.pending:
            return
        self._take_global(run)
        self.base, self.receive = self.receive, self.base
        run.state.load_held_(self.base)
        self.pending = False
        with run.clock.waiting():
            wait_all(self.sends)
        self.sends = []
        # Nothing on its way: the round's buffers go until the next round's end, so the steps
        # between hold the base alone beside the model (two model-sized buffers less, where
        # the blocking exchange drains every round).
        self.send = self.receive = self.base.new_empty(0)

    def _round_buffers(self) -> None:
        """The round's send ``[size + TAIL]`` and receive ``[size]`` buffers, made again where
        a drain let them go."""
        if self.send.numel() != self.size + TAIL:
            self.send = self.base.new_empty(self.size + TAIL)
        if self.receive.numel() != self.size:
            self.receive = self.base.new_empty(self.size)

    def _base_minus_model(self, state: ModelState, out: Tensor) -> None:
        """``out = base - [params, buffers]`` (a sharded worker: its rows of the parameters),
        tensor by tensor (no copy of a CPU model; a GPU model is copied to the CPU once)."""
        if state.params[0].device.type != "cpu":
            torch.sub(self.base, state.held_vector().cpu(), out=out)
            return
        offset = 0
        for tensor in [*(local(p) for p in state.params), *state.buffers]:
            n = tensor.numel()
            part = tensor.detach().reshape(-1).to(out.dtype)
            torch.sub(self.base[offset : offset + n], part, out=out[offset : offset + n])
            offset += n

    def _take_global(self, run: Run) -> None:
        """Wait for the leader's receive, then the group's broadcast of it (with the server in
        shards, each member's receive of its chunk, then the chunks gathered; a sharded
        worker's receive of its rows)."""
        topo = run.topo
        assert topo.group is not None and topo.leader_rank is not None
        with run.clock.waiting():
            wait_all(self.receives)
            self.receives = []
            if self.slices is not None:  # each member took its part: the others' gathered
                self.slices.assemble()
                if not self.slices.gathers:  # a sharded worker: its rows are all it holds
                    return
                params = self.receive[: self.n_held]
                on_device = params.to(topo.device)  # nccl groups gather on the device
                self.slices.gather(on_device)
                if on_device.data_ptr() != params.data_ptr():
                    params.copy_(on_device)
            elif len(topo.group_ranks) > 1:  # nccl groups broadcast on the device
                on_device = self.receive.to(topo.device)
                dist.broadcast(on_device, src=topo.leader_rank, group=topo.group)
                if on_device.data_ptr() != self.receive.data_ptr():
                    self.receive.copy_(on_device)


def exchange_dtype(run: Run) -> torch.dtype:
    """The dtype of the rounds' vectors: the model's, at least float32, so that a
    half-precision model's pseudo-gradients and the round's totals (``n_g tau_g`` passes
    float16's 65,504 in an ordinary round) are not rounded away."""
    return round_dtype("diloco", run.params[0].dtype)


def drains(run: Run) -> bool:
    """True when the round that just ended must end with every rank on the global model: the
    ``blocking`` and ``async`` exchanges (a group waits for its own update there), the epoch's
    last round, a round whose control point checkpoints or checks the parameters'
    agreement (every rank computes the same answer), and one whose control point lets the
    guard move a group (a group parked or taken back there leaves or joins with no global
    model on its way, and the parameter server gathers the round from the groups that
    stepped in it)."""
    waits = run.spec.diloco_exchange != "overlapped"
    return waits or run.split.epoch_done or reads_model(run) or guard_due(run)


def log_local_steps(
    run: Run, start: int, end: int, steps: list[int], logged: list[int]
) -> list[int]:
    """Log the groups' local steps of the round ``[start, end)`` when they differ from the
    ``logged`` ones (a short last round apart); returns the steps now logged."""
    full = end - start == run.spec.sync_period or start == 0
    if steps == logged or not full:
        return logged
    names = ", ".join(f"{g.name} {k}" for g, k in zip(run.spec.groups, steps, strict=True))
    report.log(f"diloco round at step {run.step + start - run.split.step}: local steps {names}")
    return steps


class AsyncServer:
    """The parameter server's side of ``diloco_exchange: async`` for the rounds up to the next
    barrier: it applies each group's round vector as it arrives and sends the global model
    back to that group alone, so a group waits for its own exchange only.

    Every group takes the same rounds (the split's steps ``[start, end)``), so the server
    knows each arrival's round by counting the group's arrivals. Round ``r``'s FedNova
    factors come from the split (``n_r`` samples, ``tau_eff,r``), so group ``g``'s part of
    the round's update is ``d_g = tau_eff,r (n_g / n_r) Delta_g / tau_g``: with every group
    in step the parts sum to the blocking update.

    - Staleness: ``s = floor(k / G)``, ``k`` the updates applied since the group took its
      model and ``G`` the groups (the other groups' updates of the same round do not count);
      the part is scaled by ``1 / (1 + s)`` (Zhang et al., "Staleness-aware Async-SGD for
      Distributed Deep Learning", IJCAI 2016; HALoS, ICML 2025).
    - Outer step: delayed Nesterov (Liu et al., "Asynchronous Local-SGD Training for
      Language Modeling", 2024, arXiv 2401.09135): each part is applied at once as
      ``theta -= lr d_g``; the momentum buffer takes the sum ``D`` of every ``G`` parts
      (``m = beta m + D``, the outer SGD's ``momentum_buffer``, so it is checkpointed as
      ``outer_optimizer``) and adds ``theta -= lr beta m``. With the groups in step this is
      the blocking round's Nesterov step exactly.
    - Buffers: each group's change is added as it arrives, weighted by ``n_g / n_r``.

    A *barrier* is a round after which every rank must meet: the epoch's last, or one whose
    control point runs a collective (:func:`worker.engine.run.control_due`). The server
    holds the groups' models there until every group has arrived, sends them all the same
    global model, and the control point follows, so checkpoints, rebalances and agreement
    checks see one model and the count of applied parts is a multiple of ``G``.
    """

    def __init__(self, run: Run, logged: list[int]) -> None:
        split, spec = run.split, run.spec
        self.rounds: list[tuple[int, int, float, float, bool]] = []
        start = split.step
        while start < split.steps_per_epoch:
            end = round_end(split, spec.sync_period, start)
            per_group = group_samples(run, start, end)
            steps = group_steps(run, start, end, per_group)
            logged = log_local_steps(run, start, end, steps, logged)
            n = float(sum(per_group))
            tau_eff = sum(m * k for m, k in zip(per_group, steps, strict=True)) / n if n else 0.0
            last = end == split.steps_per_epoch
            barrier = last or control_due(run, run.step + end - split.step)
            self.rounds.append((start, end, n, tau_eff, barrier))
            start = end
            if barrier:
                break
        self.logged = logged  # the local steps last logged (:func:`log_local_steps`)

    @torch.no_grad()
    def serve(self, run: Run, every: int) -> None:
        """Take every group's rounds up to the barrier, then release the groups together.

        A part of a barrier round waits until every group's has come and they are applied in
        group order (the order of arrival would change the sum's last bits): a run whose
        every round is a barrier gives the same bits every time, and resumes exactly."""
        state, topo = run.state, run.topo
        self.n_params, n_buffers = state.n_params, state.n_buffers
        dtype = exchange_dtype(run)
        leaders = stepping_leaders(run)  # every group's, unless the guard parked some
        self.groups = len(leaders)
        self.outer = outer_optimizer(run)
        beta = self.outer.param_groups[0]["momentum"]
        self.pending = [torch.zeros_like(p) for p in run.params] if beta > 0 else []
        self.applied, self.stalest = 0, 0
        vector = torch.empty(self.n_params + n_buffers + TAIL, dtype=dtype)
        arrived = [0] * self.groups  # rounds each group delivered
        taken = [0] * self.groups  # the count of parts applied when each group took its model
        held: dict[int, Tensor] = {}  # the barrier round's parts, by group
        replies: list[tuple[Tensor, list[Any]]] = [(vector, [])] * self.groups
        last = len(self.rounds) - 1
        completed = 0
        arrivals = Arrivals(topo)  # each group's next round, expected while it has one to send
        for leader in leaders:
            expect_at_ps(arrivals, leader, vector.numel(), dtype)
        while len(held) < self.groups:
            g = leaders.index(receive_any_at_ps(topo, vector, arrivals))
            r = arrived[g]
            arrived[g] += 1
            if r < last:
                expect_at_ps(arrivals, leaders[g], vector.numel(), dtype)
            if r == last:
                held[g] = vector.clone()
            else:
                self._apply(run, vector, r, stale=(self.applied - taken[g]) // self.groups)
                replies[g] = self._reply(topo, state, dtype, leaders[g], replies[g])
                taken[g] = self.applied
            while completed < min(min(arrived), last):
                self._complete(run, completed, every)
                completed += 1
        for g in range(self.groups):
            self._apply(run, held[g], last, stale=(self.applied - taken[g]) // self.groups)
        self._complete(run, last, every)
        for g in range(self.groups):  # the barrier: every group takes the same global model
            replies[g] = self._reply(topo, state, dtype, leaders[g], replies[g])
        wait_all([work for _, works in replies for work in works])
        if self.stalest:
            report.log(
                f"diloco async: updates up to {self.stalest} round(s) stale by step {run.step}"
            )

    def _apply(self, run: Run, vector: Tensor, r: int, *, stale: int) -> None:
        """Apply one group's part of round ``r``, scaled by ``1 / (1 + stale)`` (the class's
        docstring); the delayed momentum step after every ``G`` parts."""
        _, _, n, tau_eff, _ = self.rounds[r]
        n_params, state = self.n_params, run.state
        lr, beta = self.outer.param_groups[0]["lr"], self.outer.param_groups[0]["momentum"]
        self.stalest = max(self.stalest, stale)
        if n > 0:
            part = vector[:n_params] * (tau_eff / n / (1 + stale))
            offset = 0
            accumulators: list[Tensor | None] = [*self.pending] or [None] * len(run.params)
            for param, acc in zip(run.params, accumulators, strict=True):
                size = param.numel()
                piece = part[offset : offset + size].view_as(param).to(param.dtype)
                param.sub_(piece, alpha=lr)
                if acc is not None:
                    acc.add_(piece)
                offset += size
            state.add_mean_change(None, vector[n_params : n_params + state.n_buffers], n)
        run.loss_sum += float(vector[-3])
        run.samples += int(round(float(vector[-1])))
        run.curve.add(float(vector[-3]), int(round(float(vector[-1]))))
        self.applied += 1
        if self.pending and self.applied % self.groups == 0:
            self._momentum_step(self.outer, self.pending, lr, beta)

    def _complete(self, run: Run, r: int, every: int) -> None:
        """Every group delivered round ``r``: the server's split and step move past it."""
        start, end, *_ = self.rounds[r]
        for _ in range(start, end):
            run.record_batch()
            run.split.advance()
            run.step += 1
        report_progress(run, every)
        step_point(run, 0.0, 0)  # the parts applied so far (:meth:`_apply`)

    @staticmethod
    def _reply(
        topo: Topology,
        state: ModelState,
        dtype: torch.dtype,
        leader: int,
        last: tuple[Tensor, list[Any]],
    ) -> tuple[Tensor, list[Any]]:
        """Send the global model as it is now to ``leader`` (a copy: the model moves on while
        it is sent), once the last transfer to it is done; returns the copy and the works."""
        wait_all(last[1])
        model = state.vector().to(dtype)
        return model, post_to_leader(topo, model, leader)

    @staticmethod
    def _momentum_step(
        outer: torch.optim.Optimizer, pending: list[Tensor], lr: float, beta: float
    ) -> None:
        """The delayed Nesterov momentum step over the last ``G`` parts summed in ``pending``
        (then zeroed), as torch's SGD keeps its buffer (the first is the sum itself)."""
        for param, acc in zip(outer.param_groups[0]["params"], pending, strict=True):
            state = outer.state[param]
            buffer = state.get("momentum_buffer")
            if buffer is None:
                state["momentum_buffer"] = buffer = acc.clone()
            else:
                buffer.mul_(beta).add_(acc)
            param.sub_(buffer, alpha=lr * beta)
            acc.zero_()


class DiLoCo(Strategy[Run]):
    """``diloco``: exact steps inside each group, local step counts scaled to the groups'
    speeds, FedNova-normalised pseudo-gradients and an outer Nesterov step every round."""

    name = "diloco"
    group_optimizers = True
    steps_at_share = False  # every group takes steps of the global batch
    guarded = True

    @override
    def worker_epoch(self, run: Run) -> None:
        """Compute rank: the epoch's rounds, each its group's local steps, then the exchange.

        The plan is made again after a control point changed the shares (a rebalance moves
        samples between the shards). A group the guard parked takes no local step and no part
        in the exchange; taken back, it starts its rounds from the model it is given then
        (:func:`worker.engine.run.refresh`, or beside a sharded group
        :func:`worker.engine.run.catch_up`)."""
        assert run.optimizer is not None
        plan, r, position = RoundPlan(run), 0, 0
        exchange = RoundExchange(run)
        while not run.split.epoch_done:
            if plan.shares != run.split.shares:
                plan, r, position = RoundPlan(run), 0, 0
            start, end, counts = plan.rounds[r]
            loss_sum, samples, steps = 0.0, 0.0, 0
            for k, count in enumerate(counts):  # none while the group is parked
                indices = plan.flat[position : position + count]
                upcoming = partial(plan.upcoming, r, k, position)
                step_loss, step_count = group_step(run, indices, upcoming)
                position += count
                loss_sum, samples = loss_sum + step_loss, samples + step_count
                steps += 1 if step_count > 0 else 0
            for _ in range(start, end):
                run.split.advance()
                run.step += 1
            r += 1
            was_stepping = stepping(run)
            if was_stepping:
                exchange.end_round(run, [loss_sum, samples, float(steps)], drain=drains(run))
            control_point(run)
            if stepping(run) and not was_stepping:  # taken back, with the global model
                exchange = RoundExchange(run)

    @override
    def server_epoch(self, run: Run) -> None:
        """Parameter server: follow the rounds, apply the outer step to the groups' normalised
        pseudo-gradients (this module's docstring) and send the global model back; with the
        ``async`` exchange, group by group as they arrive (:class:`AsyncServer`)."""
        state = run.state
        n_params, n_buffers = state.n_params, state.n_buffers
        every = max(1, run.split.steps_per_epoch // PROGRESS_REPORTS_PER_EPOCH)
        logged: list[int] = []
        if run.spec.diloco_exchange == "async":
            while not run.split.epoch_done:
                server = AsyncServer(run, logged)
                server.serve(run, every)
                control_point(run)
                logged = server.logged
            return
        sharded = run.topo.shards is not None
        if sharded and run.ps_shards is None:  # the attempt's first epoch: the owners' slices
            run.ps_shards = ServerShards(run.topo, run.spec, state, run.outer_state)
            run.outer_state = None
        outer = None if sharded else outer_optimizer(run)
        while not run.split.epoch_done:
            start = run.split.step
            end = round_end(run.split, run.spec.sync_period, start)
            steps = group_steps(run, start, end)
            logged = log_local_steps(run, start, end, steps, logged)
            for _ in range(start, end):
                run.record_batch()
                run.split.advance()
                run.step += 1
            drain = drains(run)
            if not drain:  # the workers go on: the control point (a rebalance) comes first
                control_point(run)
            dtype = exchange_dtype(run)
            leaders = stepping_leaders(run)  # every group's, unless the guard parked some
            if run.ps_shards is not None:
                loss_sum, samples = run.ps_shards.outer_round(leaders)
            else:
                assert outer is not None
                total = gather_at_ps(run.topo, n_params + n_buffers + TAIL, dtype, leaders)
                samples, weighted_steps = float(total[-1]), float(total[-2])
                loss_sum = float(total[-3])
                if samples > 0:
                    tau_eff = weighted_steps / samples
                    update = total[:n_params] * (tau_eff / samples)
                    vector_to_grads(update.to(run.params[0].dtype), run.params)
                    outer.step()
                    outer.zero_grad(set_to_none=True)
                    state.add_mean_change(None, total[n_params : n_params + n_buffers], samples)
                broadcast_down(run.topo, state.vector().to(dtype), leaders)
            run.loss_sum += loss_sum
            run.samples += int(round(samples))
            report_progress(run, every)
            step_point(run, loss_sum, int(round(samples)))
            if drain:
                control_point(run)
