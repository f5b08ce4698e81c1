"""The guard: a resource group whose part in a synchronous step costs more than it adds
leaves the step path, and comes back when it would gain.

Under ``sync`` every step waits for every group. A group's step has a part that scales
with its share of the global batch (forward and backward: ``n_g / r_g`` seconds at
``r_g`` samples/s, summed over its workers) and a part that does not: the optimizer
update of every parameter and the step's bookkeeping (``a_g`` seconds), and the step pays
an overhead ``x`` beyond the slowest group's busy time (the cross-group allreduce and the
waits around it). With shares balanced so that every group finishes together, a step of
the active groups ``S`` lasts (water-filling)

    T(S) = (B + sum_{g in S'} r_g a_g) / sum_{g in S'} r_g        (1)

where ``S'`` is the groups of ``S`` with ``a_g < T(S)`` (a group whose fixed part alone
outlasts that gets no samples, and its step still costs ``a_g``), and the whole step
``max(T(S), max_{g in S} a_g) + x(S)``. ``B`` is the global batch, the same whatever
``S``, so the set with the shortest step has the most samples/s. A group's *marginal
contribution* is the step time without it minus the step time with it: when it is
negative (adding the group makes every step longer: at 10M parameters a CPU group's
one-sample step, update included, outlasts a faster group's whole step), the guard parks
the group. A parked group takes no share and no part in the step's collectives: the
active groups' leaders allreduce in a ring without it (worker/engine/ring.py). At every
later check the guard compares the step with the group back, from the group's last
measured costs and the active groups' fresh ones, and takes it back when that is shorter.

The overhead with several groups and with one is each taken from the last window that ran
so; before a window has run with one group, a single group's overhead is taken as none (its
step has no cross-group exchange). A park is then checked by measurement: unless the window
after it shows a step (wall seconds) at least half the margin shorter than the window before
it, the group is taken back at once, and the overhead that window measured keeps the guard
from parking it again on the same costs.

A group whose workers have a cap (``max_local_batch``) takes at most ``cap × workers``
samples a step (``room``): the guard never parks a group when the groups left could not hold
the global batch within their caps; it keeps the group instead.

Decisions are this module's pure functions of a table every rank holds alike (the
rebalancing window's work, :func:`worker.engine.run.rebalance`), so every rank parks the
same groups at the same step without a broadcast. A move needs a predicted gain of
``margin`` (default 10 %) of the current step, so noise around the break-even point does
not move groups back and forth; one group moves per check.

Under ``diloco`` (every exchange) every group takes its round's samples in local steps
of the whole global batch, so a group adds its rate ``R_g = B / (a_g + B / r_g)`` and no
group's fixed part holds the others; what a slow group can cost is the round's exchange (its
upload and download at its own speed, which the others wait for at the round's end), the
overhead ``x``. A split step then lasts ``B / sum R_g + x`` (the planner's ``diloco`` model,
backend/plans/performance.py).

This is the per-step cost model of heterogeneity-aware data parallelism with a
per-worker fixed cost (Chen et al., "Semi-Dynamic Load Balancing", SoCC 2020; the
fastest-subset rule of Jiang et al., "HeterPS", 2021), applied to whole resource groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from contracts.plan import GUARD_MARGIN

VETO_CHANGE = 0.15
"""How much slower the step must become before a park that was undone is tried again."""


@dataclass(frozen=True)
class GroupCost:
    """One resource group's measured per-step cost: ``fixed_s`` seconds a step that do not
    depend on its share (the slowest of its workers' update and bookkeeping), and ``rate``
    samples/s of the part that does (forward and backward, summed over its workers)."""

    fixed_s: float
    rate: float


def step_seconds(costs: Iterable[GroupCost], batch: int) -> float:
    """Seconds of one balanced step of ``batch`` samples on the groups of ``costs``, before
    the overhead: equation (1) of this module, at least the largest fixed part.

    Raises ValueError when ``costs`` is empty or no group has a positive rate.
    """
    groups = sorted(costs, key=lambda cost: cost.fixed_s)
    if not groups:
        raise ValueError("a step needs at least one group")
    longest_fixed = groups[-1].fixed_s
    taking = [cost for cost in groups if cost.rate > 0]
    if not taking:
        raise ValueError("no group has a measured rate")
    # Drop the groups whose fixed part outlasts the balanced step (they get no samples).
    while taking:
        total_rate = sum(cost.rate for cost in taking)
        seconds = (batch + sum(cost.rate * cost.fixed_s for cost in taking)) / total_rate
        if taking[-1].fixed_s < seconds or len(taking) == 1:
            return max(seconds, longest_fixed)
        taking.pop()
    raise AssertionError("unreachable")


def round_step_seconds(costs: Iterable[GroupCost], batch: int) -> float:
    """Seconds of ``batch`` samples on the groups of ``costs`` when each takes its samples in
    local steps of the whole ``batch`` (``diloco``, worker/engine/strategy_diloco.py): group
    ``g`` takes a step in ``a_g + batch / r_g`` seconds, so its rate is ``R_g = batch / (a_g
    + batch / r_g)``, and the groups together take ``batch / sum R_g``. Raises ValueError
    when no group has a positive rate."""
    rates = [batch / (c.fixed_s + batch / c.rate) for c in costs if c.rate > 0]
    if not rates:
        raise ValueError("no group has a measured rate")
    return batch / sum(rates)


@dataclass
class Guard:
    """The guard's state, alike on every rank: each group's last measured cost, the step's
    overhead as last measured with one active group and with several, and the parked groups.

    ``margin``: the predicted gain, as a fraction of the current step, a move needs.
    ``rounds``: the groups take local steps of the whole global batch (``diloco``), so a
    step of the split is priced by :func:`round_step_seconds` instead of equation (1).
    ``room``: the most samples each group takes in a step (its ``max_local_batch`` times its
    workers; None: no cap; the list None: no group has one): a group is parked only when the
    active groups left can hold the batch (:meth:`holds`).
    ``stays``: groups never parked (a sharded group, which a return could not refill
    without its members gathering a whole replica: docs/heterogeneity.md, "The guard").
    """

    n_groups: int
    margin: float = GUARD_MARGIN
    rounds: bool = False
    room: list[int | None] | None = None
    stays: frozenset[int] = frozenset()
    costs: dict[int, GroupCost] = field(default_factory=dict)
    overhead_one_s: float | None = None
    overhead_many_s: float | None = None
    parked: frozenset[int] = frozenset()
    step_s: float | None = None  # the last window's measured wall seconds a step
    probation: tuple[int, float] | None = None  # the group last parked, the step before it
    undone: tuple[float, float] | None = None  # the last decision undid a park: (before, after)
    vetoed: dict[int, float] = field(default_factory=dict)  # undone parks: the step with it
    # Measured over predicted step of each set of active groups, as it last ran: the model
    # leaves out what it cannot see (a group's compute slowed beside another, the waits of
    # an overlapped exchange), so a set that has run is priced as it measured; one that has
    # not, with the running set's ratio.
    bias: dict[frozenset[int], float] = field(default_factory=dict)

    def observe(
        self,
        costs: Mapping[int, GroupCost],
        overhead_s: float,
        active: int,
        step_s: float | None = None,
    ) -> None:
        """Take a window's measured ``costs`` (the groups that took samples in it), the
        step's overhead ``overhead_s`` (seconds), measured with ``active`` groups active, and
        the window's wall seconds a step ``step_s`` (what :meth:`decide` checks a park by)."""
        self.costs.update(costs)
        self.step_s = step_s
        if not math.isfinite(overhead_s) or overhead_s < 0:
            return
        if active == 1:
            self.overhead_one_s = overhead_s
        else:
            self.overhead_many_s = overhead_s

    def holds(self, active: Iterable[int], batch: int) -> bool:
        """True when the groups ``active`` can take ``batch`` samples a step within their
        :attr:`room` (always, where one of them has no cap)."""
        if self.room is None:
            return True
        rooms = [self.room[g] for g in active]
        return any(r is None for r in rooms) or sum(r for r in rooms if r is not None) >= batch

    def predicted_s(self, active: Iterable[int], batch: int) -> float:
        """Predicted seconds of one step on the ``active`` groups (inf without their costs)."""
        chosen = sorted(set(active))
        if not chosen or any(g not in self.costs for g in chosen):
            return math.inf
        overhead = self.overhead_one_s if len(chosen) == 1 else self.overhead_many_s
        if overhead is None and len(chosen) > 1:  # never measured with several: as with one
            overhead = self.overhead_one_s
        # One group alone, never measured so: no cross-group exchange, so none is assumed
        # (the first window after parking measures it, and the group comes back if that
        # was optimistic).
        price = round_step_seconds if self.rounds else step_seconds
        try:
            seconds = price([self.costs[g] for g in chosen], batch)
        except ValueError:
            return math.inf
        return seconds + (overhead or 0.0)

    def priced_s(self, active: Iterable[int], batch: int, default_bias: float = 1.0) -> float:
        """:meth:`predicted_s` times the set's :attr:`bias` where it has run, else times
        ``default_bias`` (:meth:`decide` passes the running set's: a shortfall of the model
        that every set shares, a first window's warm-up say, then favours none)."""
        chosen = frozenset(active)
        return self.predicted_s(chosen, batch) * self.bias.get(chosen, default_bias)

    def decide(self, batch: int, left_out: Iterable[int] = ()) -> frozenset[int]:
        """The parked groups from now on: one group parked or taken back when that shortens
        the predicted step by ``margin`` or more, else the parked groups unchanged.

        ``left_out``: groups out of training for good (excluded on disagreement), never
        taken back by the guard; :attr:`stays` are never parked. At least one group stays
        active, and the active groups
        always hold the batch within their :attr:`room` (a park that would leave too little
        is not considered).
        """
        gone = set(left_out)
        active = [g for g in range(self.n_groups) if g not in self.parked and g not in gone]
        modelled = self.predicted_s(active, batch) if active else math.inf
        if self.step_s is not None and math.isfinite(modelled) and modelled > 0:
            self.bias[frozenset(active)] = self.step_s / modelled  # also when a park is undone
        # A park is checked by measurement, once: unless the step came out at least half the
        # margin shorter than before it, it is undone (the prediction was wrong, e.g. the
        # lone group's overhead was not the none assumed; half: one window's noise).
        self.undone = None
        if self.probation is not None:
            parked_g, before_s = self.probation
            self.probation = None
            kept = self.step_s is not None and self.step_s <= before_s * (1 - self.margin / 2)
            if parked_g in self.parked and self.step_s is not None and not kept:
                self.undone = (before_s, self.step_s)
                self.vetoed[parked_g] = before_s
                return self.parked - {parked_g}
        if not active:
            return self.parked
        current = self.bias.get(frozenset(active), 1.0)
        now = modelled * current  # priced_s of the running set
        if not math.isfinite(now):  # an active group not measured yet: nothing to compare
            return self.parked
        moves: list[tuple[float, frozenset[int]]] = []
        if len(active) > 1:
            for g in (a for a in active if a not in self.stays):
                # An undone park is not tried again until the step with the group has become
                # VETO_CHANGE slower than it was measured then (with three groups or more the
                # overhead learnt from the undo is overwritten by the next window's).
                vetoed_s = self.vetoed.get(g)
                if vetoed_s is not None and (
                    self.step_s is None or self.step_s <= vetoed_s * (1 + VETO_CHANGE)
                ):
                    continue
                rest = [a for a in active if a != g]
                if not self.holds(rest, batch):  # the others' caps cannot take the batch
                    continue
                moves.append((self.priced_s(rest, batch, current), self.parked | {g}))
        for g in sorted(self.parked - gone):
            moves.append((self.priced_s([*active, g], batch, current), self.parked - {g}))
        if not moves:
            return self.parked
        best_s, best = min(moves, key=lambda move: (move[0], sorted(move[1])))
        if not (math.isfinite(best_s) and best_s <= now * (1.0 - self.margin)):
            return self.parked
        if len(best) > len(self.parked) and self.step_s is not None:
            (parked_g,) = best - self.parked
            self.probation = (parked_g, self.step_s)
        return best
