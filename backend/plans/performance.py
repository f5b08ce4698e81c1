"""A plan's performance model: fitted from a trial's timings, it predicts a task's step,
epoch and finish time on any subset of the candidate groups (docs/architecture.md, "Plans").

Pure functions over plain data, no database.

**Compute.** A worker's step (forward, backward, optimizer step) at local batch ``b`` takes
``t(b) = a + c b`` seconds: a least-squares line through the group's mean step time at
each trial batch size (``a`` the per-step fixed cost in s, ``c`` the s per sample).

**Exchanges.** An allreduce of ``n`` bytes among ``p`` processes follows the ring cost of
Thakur, Rabenseifner and Gropp (2005), ``2 (p - 1) alpha + 2 (p - 1) / p * n * beta``
(``alpha`` the per-message latency in s, ``beta`` the s per byte), fitted from the trial's
two sizes; it prices a group's in-group allreduce at any worker count and, for ``sync``,
the group leaders' allreduce for any number of groups. For ``periodic`` and ``quorum``
each leader's round trip to the parameter server is a line ``l + n m``; the server's link
carries every group's bytes, so ``k`` groups cost ``max l + n * sum m``, once a period.

**A step.** ``sync``: the slowest group's compute and in-group allreduce, plus the cross-
group exchange; ``periodic``: the same with the exchange over ``sync_period`` steps;
``quorum``: the same with each group's round trip every step (every group runs every step of
the epoch, ``worker/engine/strategy_quorum.py``, so the slowest group still sets the epoch;
the quorum only lets updates go ahead of it, within ``max_staleness``). A group's step time
is the slowest of its workers' mean step times. Reductions are priced as if they did not
overlap with the backward pass (the engine overlaps them bucket by bucket), and the in-group
broadcast after the leaders' allreduce is not priced (docs/benchmarks.md, ``plan_error``,
gives the measured error).

**DiLoCo.** With the ``weighted`` split a ``diloco`` group takes, in a round, its share of
the round's samples in local steps of the global batch ``G`` (``G / W_g`` per worker), so
its rate is ``r_g = G / (a_g + c_g G / W_g)`` with its fixed cost ``a_g``, every group's
round ends together, and a split step (``G`` samples) takes ``G / sum r_g`` plus the round
trip over ``sync_period`` steps. With ``even``, as ``periodic``.

**Splits.** ``even``: every worker takes ``G / W`` samples. ``weighted``: the shares the
load balancer aims for, the split that makes every group's compute and in-group allreduce
end together (water filling, in closed form: a group whose fixed cost alone exceeds that
time gets no samples, yet still pays its fixed cost every step: the engine gives every
worker at least one sample).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from contracts.plan import GUARD_CHECK_STEPS, GUARD_MARGIN, GUARDED_STRATEGIES, ROUND_STRATEGIES
from contracts.trial import PROFILE_STEPS, ExchangeTiming, TrialResult, WorkerTiming

MAX_SUBSETS = 2_000  # the deadline search's worker-count combinations, at most


@dataclass(frozen=True)
class Line:
    """``y = intercept + slope * x``, both clamped at 0 (a fitted negative cost is noise)."""

    intercept: float
    slope: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least-squares line through ``(x, y)`` points (two or more, at two or more distinct x);
    raises ValueError otherwise."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError("a line needs points at two or more distinct x")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(y for _, y in points)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    slope = max(0.0, slope)
    return Line(max(0.0, mean_y - slope * mean_x), slope)


@dataclass(frozen=True)
class Ring:
    """Ring allreduce cost (Thakur et al. 2005): ``alpha`` s per message, ``beta`` s/byte."""

    alpha: float
    beta: float

    def seconds(self, n_bytes: float, members: int) -> float:
        """Seconds to allreduce ``n_bytes`` among ``members`` processes (0 for one)."""
        if members < 2:
            return 0.0
        return 2 * (members - 1) * self.alpha + 2 * (members - 1) / members * n_bytes * self.beta

    @classmethod
    def fit(cls, timing: ExchangeTiming) -> Ring:
        """From an allreduce timed among ``timing.members`` at two or more sizes."""
        line = fit_line(list(zip(map(float, timing.bytes), timing.seconds, strict=True)))
        p = timing.members
        return cls(line.intercept / (2 * (p - 1)), line.slope * p / (2 * (p - 1)))


@dataclass(frozen=True)
class GroupModel:
    """One candidate group: ``workers`` asked for it, its step line, and its in-group ring
    (None: timed with one worker, so it cannot be priced for more)."""

    name: str
    device_type: str
    workers: int
    step: Line
    ring: Ring | None = None
    round_trip: Line | None = None  # to the parameter server (periodic, quorum)
    setup_s: float = 0.0  # building the user's optimizer, before the first step
    val_s_per_item: float = 0.0  # a validation pass's seconds per item
    startup_s: float = 0.0  # its own start-up: process creation to data, no waits
    jitter: float = 0.0  # its steps' coefficient of variation (standard deviation / mean)

    def fixed_s(self, workers: int, n_bytes: int) -> float:
        """Seconds of a step that do not grow with the local batch: ``a`` and the in-group
        allreduce among ``workers``."""
        ring = self.ring.seconds(n_bytes, workers) if self.ring is not None else 0.0
        return self.step.intercept + ring


@dataclass(frozen=True)
class PerformanceModel:
    """Everything a prediction needs, fitted once from a trial (:func:`fit`)."""

    groups: list[GroupModel]
    n_train: int
    exchange_bytes: int
    startup_s: float
    sync_strategy: str
    sync_period: int = 1
    quorum: int | None = None
    cross: Ring | None = None  # sync: the leaders' allreduce
    n_val: int = 0
    checkpoint_s: float = 0.0  # one checkpoint written by the parameter server
    ps_startup_s: float = 0.0  # the parameter server's own start-up, without waits

    def group(self, name: str) -> GroupModel:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"no candidate group named {name!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PerformanceModel:
        def ring(d: dict[str, Any] | None) -> Ring | None:
            return Ring(**d) if d else None

        groups = [
            GroupModel(
                name=g["name"],
                device_type=g["device_type"],
                workers=g["workers"],
                step=Line(**g["step"]),
                ring=ring(g["ring"]),
                round_trip=Line(**g["round_trip"]) if g["round_trip"] else None,
                setup_s=g.get("setup_s", 0.0),
                val_s_per_item=g.get("val_s_per_item", 0.0),
                startup_s=g.get("startup_s", 0.0),
                jitter=g.get("jitter", 0.0),
            )
            for g in data["groups"]
        ]
        return cls(**{**data, "groups": groups, "cross": ring(data["cross"])})


def fit(
    trial: TrialResult,
    groups: Sequence[tuple[str, str, int]],
    *,
    sync_strategy: str,
    sync_period: int = 1,
    quorum: int | None = None,
) -> PerformanceModel:
    """The performance model of a trial on ``groups`` (``(name, device_type, workers)`` in the
    trial's group order). A group's step line goes through its slowest worker's time at
    each batch size. Raises ValueError when a group has no timed worker, its workers were
    timed at different sizes, or an exchange the strategy needs was not timed."""
    fitted = []
    for index, (name, device_type, workers) in enumerate(groups):
        timed = [w for w in trial.workers if w.group_index == index]
        if not timed:
            raise ValueError(f"the trial timed no worker of group {name!r}")
        sizes = timed[0].batch_sizes
        if any(w.batch_sizes != sizes for w in timed):
            raise ValueError(f"the workers of group {name!r} were timed at other batch sizes")
        points = [(float(b), max(w.step_s[i] for w in timed)) for i, b in enumerate(sizes)]
        ring = next(
            (
                Ring.fit(e)
                for e in trial.exchanges
                if e.kind == "group_allreduce" and e.group_index == index
            ),
            None,
        )
        trip = next(
            (
                fit_line(list(zip(map(float, e.bytes), e.seconds, strict=True)))
                for e in trial.exchanges
                if e.kind == "ps_round_trip" and e.group_index == index
            ),
            None,
        )
        if ring is None and len(timed) > 1:
            raise ValueError(f"the trial timed no allreduce of group {name!r}")
        if trip is None and len(groups) > 1 and sync_strategy != "sync":
            raise ValueError(f"the trial timed no round trip of group {name!r}")
        fitted.append(
            GroupModel(
                name,
                device_type,
                workers,
                fit_line(points),
                ring,
                trip,
                setup_s=max((w.setup_s or 0.0) for w in timed),
                val_s_per_item=max((w.val_s_per_item or 0.0) for w in timed),
                startup_s=max((w.startup_s or 0.0) for w in timed),
                jitter=max(_jitter(w) for w in timed),
            )
        )
    cross = next((Ring.fit(e) for e in trial.exchanges if e.kind == "leaders_allreduce"), None)
    if cross is None and len(groups) > 1 and sync_strategy == "sync":
        raise ValueError("the trial timed no allreduce of the group leaders")
    return PerformanceModel(
        groups=fitted,
        n_train=trial.n_train,
        exchange_bytes=trial.exchange_bytes,
        startup_s=trial.startup_s,
        sync_strategy=sync_strategy,
        sync_period=sync_period,
        quorum=quorum,
        cross=cross,
        n_val=trial.n_val,
        checkpoint_s=trial.checkpoint_s or 0.0,
        ps_startup_s=trial.ps_startup_s or 0.0,
    )


@dataclass
class Prediction:
    """A task's predicted times on ``workers`` (group name -> workers) with ``split_policy``:
    ``step_s``, ``epoch_s`` and ``finish_s`` (start-up and every epoch) in seconds,
    ``samples_per_s``, ``start_s`` (before the first step) and ``epoch_end_s`` (each epoch's
    validation, model transfers and checkpoint), and per group its local batch per worker
    (``local_batch``), its step's
    compute seconds (``compute_s``) and the cross-group exchange per step (``exchange_s``).
    ``idle`` names groups the split gives no samples: they still pay their fixed cost and
    the exchange every step. ``parked``: groups the guard would park (worker/engine/guard.py:
    ``sync`` and ``periodic`` with the weighted split), which take no samples and no part
    in the steps once it has: the times are the other groups', after the first check
    (``GUARD_CHECK_STEPS``) on them all."""

    workers: dict[str, int]
    split_policy: str
    step_s: float
    epoch_s: float
    finish_s: float
    samples_per_s: float
    exchange_s: float
    local_batch: dict[str, float]
    compute_s: dict[str, float]
    idle: list[str] = field(default_factory=list)
    start_s: float = 0.0  # before the first step (:func:`_outside_steps`)
    epoch_end_s: float = 0.0  # each epoch's validation, model transfers and checkpoint
    parked: list[str] = field(default_factory=list)

    @property
    def total_workers(self) -> int:
        return sum(self.workers.values())


def exchange_s(model: PerformanceModel, names: Sequence[str]) -> float:
    """The cross-group exchange's seconds per step for the groups ``names``: 0 for one."""
    if len(names) < 2:
        return 0.0
    n = model.exchange_bytes
    if model.sync_strategy == "sync":
        if model.cross is None:
            raise ValueError("the trial timed no leaders' allreduce for sync")
        return model.cross.seconds(n, len(names))
    trips = [model.group(name).round_trip for name in names]
    if any(trip is None for trip in trips):
        raise ValueError("the trial timed no round trip to the parameter server")
    seconds = max(t.intercept for t in trips if t) + n * sum(t.slope for t in trips if t)
    return seconds / model.sync_period if model.sync_strategy in ROUND_STRATEGIES else seconds


def _balanced(fixed: list[float], slopes: list[float], counts: list[int], batch: int) -> float:
    """The time ``T`` at which ``sum(counts[g] * max(0, (T - fixed[g]) / slopes[g])) ==
    batch``: the weighted split's common step time (water filling in closed form: with the
    groups of the lowest fixed costs taking samples, ``T = (batch + sum n f / s) /
    sum n / s``; the first such set whose ``T`` stays below the next group's fixed cost)."""
    order = sorted(range(len(fixed)), key=lambda g: fixed[g])
    weight = offset = 0.0
    common = fixed[order[0]]
    for position, g in enumerate(order):
        weight += counts[g] / slopes[g]
        offset += counts[g] * fixed[g] / slopes[g]
        common = (batch + offset) / weight
        following = order[position + 1] if position + 1 < len(order) else None
        if following is None or common <= fixed[following]:
            break
    return common


def _diloco_round(
    fixed: list[float], slopes: list[float], counts: list[int], batch: int
) -> tuple[list[float], list[float]]:
    """``diloco`` with the weighted split (worker/engine/strategy_diloco.py): every group
    takes its samples in steps of the global batch, ``batch / W_g`` per worker, so its rate
    is ``batch / (f_g + s_g batch / W_g)``; the split gives it samples in proportion. Returns
    every group's per-worker share of a split step and the seconds a split step's samples
    take (alike for every group: their rounds end together)."""
    rates = [batch / (f + s * batch / n) for f, s, n in zip(fixed, slopes, counts, strict=True)]
    seconds = batch / sum(rates)
    local = [batch * r / sum(rates) / n for r, n in zip(rates, counts, strict=True)]
    return local, [seconds] * len(counts)


def _jitter(worker: WorkerTiming) -> float:
    """A worker's step-time coefficient of variation: the median over its batch sizes of
    standard deviation / mean (0 without ``step_sd``)."""
    if not worker.step_sd:
        return 0.0
    return statistics.median(
        sd / mean for sd, mean in zip(worker.step_sd, worker.step_s, strict=True) if mean > 0
    )


def expected_max(means: Sequence[float], sds: Sequence[float]) -> float:
    """E[max_i X_i] of independent normal X_i ~ N(means[i], sds[i]^2): the expected time of a
    synchronous step, which waits for the slowest of the groups' varying step times.

    Clark's method (C. E. Clark, "The Greatest of a Finite Set of Random Variables",
    Operations Research 9(2), 1961): the max of two normals has exact first two moments,
    and the running max is taken as normal with them. Exact for one or two variables; with
    every ``sd`` 0 it is ``max(means)``. Raises ValueError for no means or a negative sd."""
    if not means or len(means) != len(sds) or min(sds) < 0:
        raise ValueError("expected_max needs one non-negative sd per mean")
    mean, var = means[0], sds[0] ** 2
    for mu, sd in zip(means[1:], sds[1:], strict=True):
        spread = math.sqrt(var + sd * sd)
        if spread == 0:
            mean, var = max(mean, mu), 0.0
            continue
        alpha = (mean - mu) / spread
        cdf, cdf_neg = _phi_cdf(alpha), _phi_cdf(-alpha)
        pdf = math.exp(-alpha * alpha / 2) / math.sqrt(2 * math.pi)
        first = mean * cdf + mu * cdf_neg + spread * pdf
        second = (mean**2 + var) * cdf + (mu**2 + sd * sd) * cdf_neg + (mean + mu) * spread * pdf
        mean, var = first, max(0.0, second - first * first)
    return mean


def _phi_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _spreads(
    model: PerformanceModel, groups: list[GroupModel], compute: list[float]
) -> list[float]:
    """The standard deviation of each group's step time where it decides the wait: every
    step under ``sync``; a round's sum of H steps under ``periodic`` and ``diloco`` (its
    spread shrinks by sqrt(H), the steps' variations being independent); none under
    ``quorum``, which does not wait for the slowest group."""
    if model.sync_strategy == "quorum":
        return [0.0] * len(groups)
    scale = 1 / math.sqrt(model.sync_period) if model.sync_strategy in ROUND_STRATEGIES else 1
    return [g.jitter * c * scale for g, c in zip(groups, compute, strict=True)]


def _startup(model: PerformanceModel, groups: list[GroupModel]) -> float:
    """The start-up of a task on ``groups``: its slowest rank's own start-up (process
    creation to data, without waits), the parameter server's included; the trial's (which
    waited for every group) where the groups' own start-ups were not timed."""
    own = [g.startup_s for g in model.groups]
    if min(own, default=0.0) <= 0 or model.ps_startup_s <= 0:
        return model.startup_s
    return max(model.ps_startup_s, *(g.startup_s for g in groups))


def _outside_steps(
    model: PerformanceModel,
    groups: list[GroupModel],
    counts: list[int],
    local: list[float],
    global_batch_size: int,
    split_policy: str,
    compute: list[float],
    cross: float,
) -> tuple[float, float]:
    """The seconds of a task outside its steps, as the engine spends them
    (worker/engine/session.py): ``(start, epoch_end)``.

    ``start``: the trial's start-up (process creation to data, with the rendezvous that
    waits for the last rank), the slowest group's optimizer construction, the model sent to
    every group, the throughput profile (``PROFILE_STEPS`` + 1 steps at the even share, and
    under the weighted split but for ``diloco`` as many again at the chosen shares) and the
    agreement check's gradient (one step at the even share). ``epoch_end``: validation
    (each worker a block of the validation set in proportion to its batch share, the
    slowest group's), the model sent out again (and, under ``sync``, first fetched from the
    first worker) and the epoch's checkpoint. Sending the model is priced as the slowest
    group's timed round trip to the parameter server, or the step's exchange (``cross``)
    without one.
    """
    total = sum(counts)
    even = global_batch_size / total
    even_step = max(g.step.at(even) for g in groups)
    passes = (
        2 if split_policy == "weighted" and total > 1 and model.sync_strategy != "diloco" else 1
    )
    profile = (PROFILE_STEPS + 1) * (even_step + (max(compute) if passes == 2 else 0.0))
    trips = [g.round_trip.at(model.exchange_bytes) for g in groups if g.round_trip is not None]
    transfer = max(trips) if trips else cross
    setup = max(g.setup_s for g in groups)
    start = _startup(model, groups) + setup + transfer + profile + even_step
    val = max(
        model.n_val * b / global_batch_size * g.val_s_per_item
        for g, b in zip(groups, local, strict=True)
    )
    pulls = 2 if model.sync_strategy == "sync" and len(groups) > 1 else 1
    return start, val + pulls * transfer + model.checkpoint_s


@dataclass
class _Step:
    """One step on some groups: its seconds, and per group its local batch and compute."""

    seconds: float
    local: list[float]
    compute: list[float]
    cross: float


def _step(
    model: PerformanceModel,
    workers: dict[str, int],
    names: Sequence[str],
    global_batch_size: int,
    split_policy: str,
) -> _Step:
    """A step on the groups ``names`` (of ``workers``), split by ``split_policy``."""
    n = model.exchange_bytes
    groups = [model.group(name) for name in names]
    total = sum(workers[name] for name in names)
    fixed = [g.fixed_s(workers[g.name], n) for g in groups]
    slopes = [max(g.step.slope, 1e-12) for g in groups]
    counts = [workers[g.name] for g in groups]
    if split_policy == "weighted" and model.sync_strategy == "diloco":
        local, compute = _diloco_round(fixed, slopes, counts, global_batch_size)
    else:
        if split_policy == "weighted":
            common = _balanced(fixed, slopes, counts, global_batch_size)
            local = [max(0.0, (common - f) / s) for f, s in zip(fixed, slopes, strict=True)]
        else:
            local = [global_batch_size / total] * len(groups)
        compute = [f + s * b for f, s, b in zip(fixed, slopes, local, strict=True)]
    cross = exchange_s(model, names)
    seconds = expected_max(compute, _spreads(model, groups, compute)) + cross
    return _Step(seconds, local, compute, cross)


def guarded_groups(
    model: PerformanceModel,
    workers: dict[str, int],
    *,
    global_batch_size: int,
    split_policy: str,
    guard: bool = True,
) -> list[str]:
    """The groups of ``workers`` the guard keeps stepping (worker/engine/guard.py): one at a
    time, the group whose leaving shortens the predicted step by ``GUARD_MARGIN`` or more
    is parked, while one does (``sync`` and ``periodic`` with the weighted split and
    ``guard`` on; every group otherwise)."""
    active = list(workers)
    if not (guard and split_policy == "weighted" and model.sync_strategy in GUARDED_STRATEGIES):
        return active
    now = _step(model, workers, active, global_batch_size, split_policy).seconds
    while len(active) > 1:
        options = [
            (_step(model, workers, rest, global_batch_size, split_policy).seconds, rest)
            for rest in ([a for a in active if a != g] for g in active)
        ]
        best_s, rest = min(options, key=lambda option: option[0])
        if best_s > now * (1.0 - GUARD_MARGIN):
            break
        now, active = best_s, rest
    return active


def predict(
    model: PerformanceModel,
    workers: dict[str, int],
    *,
    global_batch_size: int,
    epochs: int,
    split_policy: str,
    guard: bool = True,
) -> Prediction:
    """Predicted times of the task on ``workers`` (candidate group name -> workers, each
    at least 1), with the guard's parking (:func:`guarded_groups`) when ``guard``. Raises
    KeyError for a group the model does not have, ValueError when the global batch is
    smaller than the workers or the trial lacks an exchange it needs."""
    names = list(workers)
    total = sum(workers.values())
    if not names or min(workers.values()) < 1:
        raise ValueError("every group predicted needs one worker or more")
    if global_batch_size < total:
        raise ValueError(f"global batch {global_batch_size} < {total} workers")
    groups = [model.group(name) for name in names]
    counts = [workers[g.name] for g in groups]
    kept = guarded_groups(
        model, workers, global_batch_size=global_batch_size, split_policy=split_policy, guard=guard
    )
    full = _step(model, workers, names, global_batch_size, split_policy)
    on = full if kept == names else _step(model, workers, kept, global_batch_size, split_policy)
    by_name = dict(zip(kept, zip(on.local, on.compute, strict=True), strict=True))
    local = [by_name[name][0] if name in by_name else 0.0 for name in names]
    compute = [by_name[name][1] if name in by_name else 0.0 for name in names]
    steps = math.ceil(model.n_train / global_batch_size)
    # Start-up and each epoch's end as with every group (a parked one still meets the others
    # at the epoch's collectives); the steps before the guard's first check on them all.
    start, epoch_end = _outside_steps(
        model, groups, counts, full.local, global_batch_size, split_policy, full.compute, full.cross
    )
    before_check = min(GUARD_CHECK_STEPS, steps * epochs) * (full.seconds - on.seconds)
    return Prediction(
        workers=dict(workers),
        split_policy=split_policy,
        step_s=on.seconds,
        epoch_s=on.seconds * steps,
        finish_s=start
        + epochs * (on.seconds * steps + epoch_end)
        + before_check
        + model.checkpoint_s,
        start_s=start,
        epoch_end_s=epoch_end,
        samples_per_s=global_batch_size / on.seconds if on.seconds > 0 else math.inf,
        exchange_s=on.cross,
        local_batch={g.name: b for g, b in zip(groups, local, strict=True)},
        compute_s={g.name: c for g, c in zip(groups, compute, strict=True)},
        idle=[g.name for g, b in zip(groups, local, strict=True) if b <= 0.0 and g.name in kept],
        parked=[name for name in names if name not in kept],
    )


def subsets(names: Sequence[str]) -> Iterable[tuple[str, ...]]:
    """Every non-empty subset of ``names``, smallest first, in the given order."""
    for size in range(1, len(names) + 1):
        yield from itertools.combinations(names, size)


def fits_batch(model: PerformanceModel, workers: dict[str, int], batch: int) -> bool:
    return sum(workers.values()) <= batch


@dataclass
class Recommendation:
    """What a plan recommends (:func:`recommend`): every subset's prediction at its full
    worker counts for each split policy (``options``, fastest first), the fastest
    (``best``), each candidate's marginal gain in the best set (seconds of ``finish_s`` it
    saves there, or would cost if added: negative; each set under its fastest split
    policy; None where it cannot be left out, the best set's only group, or added, the
    workers would exceed the global batch), why each
    group left out is left out, and for a deadline the fewest workers that meet it (None:
    no set does)."""

    options: list[Prediction]
    best: Prediction
    marginal_gain_s: dict[str, float | None]
    left_out: dict[str, str]
    deadline_s: float | None = None
    for_deadline: Prediction | None = None


def recommend(
    model: PerformanceModel,
    *,
    global_batch_size: int,
    epochs: int,
    split_policies: Sequence[str] = ("even", "weighted"),
    deadline_s: float | None = None,
) -> Recommendation:
    """Predict every subset of the candidate groups at their asked workers under each split
    policy; recommend the fastest and, given ``deadline_s`` (seconds from now), the set with
    the fewest workers finishing within it (ties: the fastest), searching worker counts
    below the asked ones too (at most :data:`MAX_SUBSETS` combinations, else full counts).

    Raises ValueError when no subset can hold the global batch."""
    names = [g.name for g in model.groups]
    asked = {g.name: g.workers for g in model.groups}
    kwargs: dict[str, Any] = {"global_batch_size": global_batch_size, "epochs": epochs}
    options = [
        predict(model, {n: asked[n] for n in subset}, split_policy=policy, **kwargs)
        for subset in subsets(names)
        if fits_batch(model, {n: asked[n] for n in subset}, global_batch_size)
        for policy in split_policies
    ]
    if not options:
        raise ValueError("no subset of the candidate groups can hold the global batch")
    options.sort(key=lambda p: (p.finish_s, p.total_workers))
    best = options[0]

    def fastest(workers: dict[str, int]) -> Prediction | None:
        """The prediction on ``workers`` under its fastest split policy (None: no workers, or
        more than the global batch)."""
        if not workers or not fits_batch(model, workers, global_batch_size):
            return None
        guesses = [predict(model, workers, split_policy=p, **kwargs) for p in split_policies]
        return min(guesses, key=lambda p: p.finish_s)

    def finish(workers: dict[str, int]) -> float:
        found = fastest(workers)
        return math.inf if found is None else found.finish_s

    gains: dict[str, float | None] = {}
    left_out: dict[str, str] = {}
    for name in names:
        if name in best.workers:
            without = {n: w for n, w in best.workers.items() if n != name}
            gain = finish(without) - best.finish_s
            gains[name] = gain if math.isfinite(gain) else None
            continue
        with_it = {**best.workers, name: asked[name]}
        gain = best.finish_s - finish(with_it)
        gains[name] = gain if math.isfinite(gain) else None
        if not math.isfinite(gain):
            left_out[name] = "with it the workers would exceed the global batch"
            continue
        guarded = fastest(with_it)
        assert guarded is not None
        # Why it costs: its prediction as if the guard let it be (it parks it after its first
        # check, when the predicted step is that much longer).
        unguarded = [
            predict(model, with_it, split_policy=p, guard=False, **kwargs) for p in split_policies
        ]
        added = min(unguarded, key=lambda p: p.finish_s)
        exchange = added.exchange_s - best.exchange_s
        saved = max(best.compute_s.values()) - max(added.compute_s.values())
        compute = (
            f"its compute saves {saved * 1000:.1f} ms per step"
            if saved >= 0
            else f"its own step is {-saved * 1000:.1f} ms slower than the others' (it sets "
            "the pace)"
        )
        left_out[name] = (
            f"adding it would finish {-gain:.1f} s later: its cross-group exchange adds "
            f"{exchange * 1000:.1f} ms per step, {compute}"
        )
        if name in guarded.parked:
            left_out[name] += "; submitted with it, the guard parks it at its first check"
    result = Recommendation(options, best, gains, left_out)
    if deadline_s is not None:
        result.deadline_s = deadline_s
        result.for_deadline = _for_deadline(model, asked, deadline_s, split_policies, kwargs)
    return result


def _for_deadline(
    model: PerformanceModel,
    asked: dict[str, int],
    deadline_s: float,
    split_policies: Sequence[str],
    kwargs: dict[str, Any],
) -> Prediction | None:
    """The prediction with the fewest workers finishing within ``deadline_s`` (ties: the
    fastest), or None."""
    names = list(asked)
    ranges = [range(0, asked[n] + 1) for n in names]
    combos = math.prod(len(r) for r in ranges)
    counts: Iterable[tuple[int, ...]] = (
        itertools.product(*ranges)
        if combos <= MAX_SUBSETS
        else (tuple(asked[n] if n in s else 0 for n in names) for s in subsets(names))
    )
    found: Prediction | None = None
    if deadline_s <= 0:
        return None
    for combo in counts:
        workers = {n: w for n, w in zip(names, combo, strict=True) if w}
        if not workers or not fits_batch(model, workers, kwargs["global_batch_size"]):
            continue
        for policy in split_policies:
            guess = predict(model, workers, split_policy=policy, **kwargs)
            if guess.finish_s > deadline_s:
                continue
            key = (guess.total_workers, guess.finish_s)
            if found is None or key < (found.total_workers, found.finish_s):
                found = guess
    return found
