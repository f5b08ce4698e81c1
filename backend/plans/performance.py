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
its rate is ``r_g = G / t_g(G / W_g)``, with ``t_g`` its step's time at that batch as the
trial measured it (interpolated between the trial's batch sizes, which include it, not the
line: a step's cost per sample grows with the batch) plus its in-group allreduce; every
group's round ends together, and a split step (``G`` samples) takes ``G / sum r_g`` plus
the round trip over ``sync_period`` steps; the round waits for the slowest group, whose
round is the sum of its own ``tau_g`` local steps (its spread shrinks by ``sqrt(tau_g)``,
not ``sqrt(H)``: a slow group of two steps a round varies as much as two steps do). With
``even``, as ``periodic``. Under every strategy but ``sync``, one group alone still makes
its round trip to the parameter server.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from contracts.plan import (
    AGREEMENT_BATCH,
    GUARD_MARGIN,
    GUARDED_STRATEGIES,
    ROUND_STRATEGIES,
    SHARDED_STRATEGIES,
    guard_first_check_steps,
    local_steps,
    warm_point,
)
from contracts.trial import (
    PROFILE_BUDGET_S,
    PROFILE_STEPS,
    PROFILE_WARM_UP,
    ExchangeTiming,
    TrialResult,
    WorkerTiming,
    profile_timed_steps,
)

MAX_SUBSETS = 2_000  # the deadline search's worker-count combinations, at most
MIB = 2**20


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


def upper_line(points: Sequence[tuple[float, float]]) -> Line:
    """The least-squares line through ``points`` (:func:`fit_line`) raised just enough to
    lie on or above every point: a memory line that must not promise room a measurement
    did not show."""
    line = fit_line(points)
    lift = max(y - line.at(x) for x, y in points)
    return Line(line.intercept + max(0.0, lift), line.slope)


def _plus(line: Line | None, extra: float) -> Line | None:
    """``line`` raised by ``extra`` (None stays None)."""
    return None if line is None else Line(line.intercept + extra, line.slope)


def _measured(
    timed: Sequence[WorkerTiming],
    name: str,
    through: Callable[[Sequence[tuple[float, float]]], Line],
) -> Line | None:
    """The line ``through`` the largest of ``timed``'s measurements ``name`` at each batch
    size; None where any worker lacks them."""
    values = [getattr(w, name) for w in timed]
    if any(v is None for v in values):
        return None
    sizes = timed[0].batch_sizes
    return through([(float(b), max(v[i] for v in values)) for i, b in enumerate(sizes)])


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
    memory: Line | None = None  # MiB a worker holds at its peak against its local batch
    sharded_memory: Line | None = None  # the same with the model sharded over ``workers``
    sharded_step: Line | None = None  # the step's seconds with the model sharded
    startup_peak_mb: float = 0.0  # the peak before the first step (the model built whole)
    memory_per_worker_mb: float | None = None  # its hardware's memory a worker; None: unknown
    # (local batch, seconds): the slowest worker's measured step at each trial batch size
    step_points: tuple[tuple[float, float], ...] = ()

    def fixed_s(self, workers: int, n_bytes: int, sharding: str = "none") -> float:
        """Seconds of a step that do not grow with the local batch: ``a`` and the in-group
        allreduce among ``workers`` (sharded: the line's ``a``, the group's reduce-scatter and
        gathers being inside the timed step)."""
        if sharding == "fsdp" and self.sharded_step is not None:
            return self.sharded_step.intercept
        ring = self.ring.seconds(n_bytes, workers) if self.ring is not None else 0.0
        return self.step.intercept + ring

    def step_s(self, local_batch: float, workers: int, n_bytes: int) -> float:
        """Seconds of one whole (unsharded) step of ``local_batch`` samples a worker among
        ``workers``: the measured step times interpolated piecewise linearly between the
        trial's batch sizes (outside them, the nearest measured point moved along the line's
        slope, so a larger batch is never predicted faster), plus the in-group allreduce
        (none for one worker).

        A step's cost per sample is not constant: the 34k-parameter CNN of bench/workloads
        took 0.36 ms a sample at 86 and 0.47 at 256 on one core, so the line fitted
        through 43, 86 and 172 predicts a 256-sample step 20-30 % short. ``diloco`` steps at
        the global batch, beyond the even share's range, so its trial times that batch too
        (``backend.plans.service.trial_batch_sizes``) and its rounds are priced here."""
        ring = self.ring.seconds(n_bytes, workers) if self.ring is not None else 0.0
        points = sorted(self.step_points)
        if not points:
            return self.step.at(local_batch) + ring
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if x0 < x1 and x0 <= local_batch <= x1:
                return y0 + (y1 - y0) * (local_batch - x0) / (x1 - x0) + ring
        x, y = points[0] if local_batch < points[0][0] else points[-1]
        return max(0.0, y + self.step.slope * (local_batch - x)) + ring

    def slope(self, sharding: str = "none") -> float:
        """Seconds a step takes per sample of the local batch (at least 1e-12)."""
        line = self.sharded_step if sharding == "fsdp" and self.sharded_step else self.step
        return max(line.slope, 1e-12)

    def can_shard(self, workers: int, sync_strategy: str) -> bool:
        """Whether ``workers`` of this group may run the model sharded (``fsdp``: two or more,
        under a strategy that runs sharded groups, :data:`contracts.plan.SHARDED_STRATEGIES`,
        measured by the trial)."""
        measured = self.sharded_step is not None and self.sharded_memory is not None
        return measured and workers >= 2 and sync_strategy in SHARDED_STRATEGIES

    def memory_mb(self, local_batch: float, workers: int, sharding: str) -> float | None:
        """MiB one worker holds at its peak with ``local_batch`` samples a step, among
        ``workers`` (None: the trial did not measure it). Never below the start-up's peak
        (the model built whole). Sharded over ``w`` workers, a worker saves ``(1 - 1/w)`` of
        the model's state (parameters, gradients, optimizer state), which the trial measured
        at the asked workers ``W`` as the whole line less the sharded one, ``S (1 - 1/W)``."""
        if self.memory is None:
            return None
        whole = self.memory.at(local_batch)
        if sharding == "fsdp" and self.sharded_memory is not None and workers >= 2:
            saved = max(0.0, whole - self.sharded_memory.at(local_batch))
            if self.workers >= 2:
                whole -= saved * (1 - 1 / workers) / (1 - 1 / self.workers)
        return max(self.startup_peak_mb, whole)

    def limit_mb(self, task_limit_mb: float | None) -> float | None:
        """What one worker may hold, in MiB: on a CPU group the task's ``memory_limit_mb``
        (its ranks' data memory) or, if less, the host memory per worker its agents have; on a
        device group its device memory a worker (the task's limit is on host memory). None:
        not known."""
        if self.device_type != "cpu":
            return self.memory_per_worker_mb
        known = [v for v in (task_limit_mb, self.memory_per_worker_mb) if v is not None]
        return min(known) if known else None

    def most_samples(
        self, workers: int, sharding: str, most: int, limit_mb: float | None
    ) -> int | None:
        """The most samples a step, at most ``most``, that one of ``workers`` holds within
        ``limit_mb`` (0: not even one; None: no limit known or memory not measured)."""
        if limit_mb is None or self.memory is None:
            return None
        low, high = 0, most
        while low < high:  # the largest b with memory_mb(b) <= the limit (memory grows with b)
            mid = (low + high + 1) // 2
            needed = self.memory_mb(mid, workers, sharding)
            if needed is not None and needed <= limit_mb:
                low = mid
            else:
                high = mid - 1
        return low


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
    memory_limit_mb: float | None = None  # the planned task's (its ranks' data memory)
    ps_peak_mb: float = 0.0  # the parameter server's peak in the trial (0: not measured)

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

        def line(d: dict[str, Any] | None) -> Line | None:
            return Line(**d) if d else None

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
                memory=line(g.get("memory")),
                sharded_memory=line(g.get("sharded_memory")),
                sharded_step=line(g.get("sharded_step")),
                startup_peak_mb=g.get("startup_peak_mb", 0.0),
                memory_per_worker_mb=g.get("memory_per_worker_mb"),
                step_points=tuple(tuple(p) for p in g.get("step_points", ())),
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
    memory_limit_mb: float | None = None,
    group_memory_mb: dict[str, float] | None = None,
) -> PerformanceModel:
    """The performance model of a trial on ``groups`` (``(name, device_type, workers)`` in the
    trial's group order). A group's step line goes through its slowest worker's time at
    each batch size, its memory lines (whole and sharded) over its largest peak at each,
    raised to lie on or above every measured peak (:func:`upper_line`); the whole line one
    step's vector more (``exchange_bytes``): a whole worker keeps its gradient vector
    between steps (the reducer's) and receives the model into another at an epoch's end,
    where the trial's step holds one, and the sharded line its rows of it (a sharded worker
    receives only its rows). Measured on a 50M-parameter MLP over 2 workers (SGD with
    momentum): the trial's whole step peaked at 1,378 MiB and the task at 1,506-1,553, one
    vector being 191 MiB; the sharded step at 765-877 MiB from run to run, the task at
    802-844. ``memory_limit_mb`` is the planned task's (its ranks' data memory, MiB) and
    ``group_memory_mb`` each group's hardware memory a worker (group name -> MiB: host
    memory on a CPU group, device memory on a device group; a group left out has none
    known). Raises ValueError when a group has no timed worker, its workers were timed at
    different sizes, or an exchange the strategy needs was not timed."""
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
                memory=_plus(_measured(timed, "peak_mb", upper_line), trial.exchange_bytes / MIB),
                sharded_memory=_plus(
                    _measured(timed, "sharded_peak_mb", upper_line),
                    trial.exchange_bytes / MIB / max(1, len(timed)),
                ),
                sharded_step=_measured(timed, "sharded_step_s", fit_line),
                startup_peak_mb=max((w.startup_peak_mb or 0.0) for w in timed),
                memory_per_worker_mb=(group_memory_mb or {}).get(name),
                step_points=tuple(points),
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
        memory_limit_mb=memory_limit_mb,
        ps_peak_mb=trial.ps_peak_mb or 0.0,
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
    (:func:`contracts.plan.guard_first_check_steps` of the slowest group's compute) on
    them all. Memory, per group (:func:`placements`): its
    ``sharding``, the cap on a worker's share (``max_local_batch``, None: none), a worker's
    predicted peak MiB at its local batch (``memory_mb``, None: not measured) and what it
    may hold (``memory_limit_mb``, None: not known)."""

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
    sharding: dict[str, str] = field(default_factory=dict)  # per group: none or fsdp
    max_local_batch: dict[str, int | None] = field(default_factory=dict)  # its memory's cap
    memory_mb: dict[str, float | None] = field(default_factory=dict)  # a worker's peak
    memory_limit_mb: dict[str, float | None] = field(default_factory=dict)

    @property
    def total_workers(self) -> int:
        return sum(self.workers.values())


def exchange_s(model: PerformanceModel, names: Sequence[str]) -> float:
    """The cross-group exchange's seconds per step for the groups ``names``. Under ``sync``
    0 for one group (its leader has no one to allreduce with); under the others one group
    alone still sends its model or update to the parameter server and takes the result
    back (0 for a trial that timed none: one group's trials did not before 2026-11-29)."""
    n = model.exchange_bytes
    if model.sync_strategy == "sync":
        if len(names) < 2:
            return 0.0
        if model.cross is None:
            raise ValueError("the trial timed no leaders' allreduce for sync")
        return model.cross.seconds(n, len(names))
    trips = [model.group(name).round_trip for name in names]
    if any(trip is None for trip in trips):
        if len(names) < 2:
            return 0.0
        raise ValueError("the trial timed no round trip to the parameter server")
    seconds = max(t.intercept for t in trips if t) + n * sum(t.slope for t in trips if t)
    return seconds / model.sync_period if model.sync_strategy in ROUND_STRATEGIES else seconds


def _balanced(fixed: list[float], slopes: list[float], counts: list[int], batch: float) -> float:
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
    steps: list[float], counts: list[int], batch: int
) -> tuple[list[float], list[float]]:
    """``diloco`` with the weighted split (worker/engine/strategy_diloco.py): every group
    takes its samples in steps of the global batch, ``batch / W_g`` per worker, each
    ``steps[g]`` seconds (:meth:`GroupModel.step_s`), so its rate is ``batch / steps[g]``;
    the split gives it samples in proportion. Returns every group's per-worker share of a
    split step and the seconds a split step's samples take (alike for every group: their
    rounds end together)."""
    rates = [batch / t for t in steps]
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
    model: PerformanceModel,
    groups: list[GroupModel],
    compute: list[float],
    round_steps: list[int] | None = None,
) -> list[float]:
    """The standard deviation of each group's step time where it decides the wait: every
    step under ``sync``; a round's sum of its local steps under ``periodic`` and ``diloco``
    (its spread shrinks by sqrt(k) for k local steps, the steps' variations being
    independent: k = H, or ``round_steps[g]`` where a group takes its own count, as a
    weighted ``diloco`` group takes ``tau_g``); none under ``quorum``, which does not wait
    for the slowest group."""
    if model.sync_strategy == "quorum":
        return [0.0] * len(groups)
    if model.sync_strategy not in ROUND_STRATEGIES:
        steps = [1] * len(groups)
    else:
        steps = round_steps or [model.sync_period] * len(groups)
    return [g.jitter * c / math.sqrt(k) for g, c, k in zip(groups, compute, steps, strict=True)]


def diloco_round_steps(local: list[float], counts: list[int], batch: int, period: int) -> list[int]:
    """Each group's local steps in a ``diloco`` round of ``period`` (H) split steps under the
    weighted split, by the engine's rule (:func:`contracts.plan.local_steps`) for its
    ``n_g = H W_g b_g`` samples."""
    totals = [period * b * n for b, n in zip(local, counts, strict=True)]
    return [max(1, k) for k in local_steps(totals, period, batch=batch)]


def _startup(model: PerformanceModel, groups: list[GroupModel]) -> float:
    """The start-up of a task on ``groups``: its slowest rank's own start-up (process
    creation to data, without waits), the parameter server's included; the trial's (which
    waited for every group) where the groups' own start-ups were not timed."""
    own = [g.startup_s for g in model.groups]
    if min(own, default=0.0) <= 0 or model.ps_startup_s <= 0:
        return model.startup_s
    return max(model.ps_startup_s, *(g.startup_s for g in groups))


def _profile_passes(model: PerformanceModel, counts: list[int], split_policy: str) -> int:
    """The throughput profile's passes: a second at the chosen shares under the weighted
    split, but for ``diloco`` (worker/engine/session.py, ``initial_shares``)."""
    again = split_policy == "weighted" and model.sync_strategy != "diloco"
    return 2 if again and sum(counts) > 1 else 1


def _profiled_step_s(
    model: PerformanceModel,
    groups: list[GroupModel],
    counts: list[int],
    global_batch_size: int,
    split_policy: str,
    step: _Step,
) -> float:
    """The step the engine's last profile pass measures on its slowest worker, which sizes
    the guard's first check (:func:`contracts.plan.guard_first_check_steps`): a worker's
    step at the even share, or with a second pass at its chosen share (the balancer gives
    every worker at least one sample, so a group the split leaves idle profiles its fixed
    part)."""
    if _profile_passes(model, counts, split_policy) == 2:
        return max(step.compute)
    return max(g.step_s(global_batch_size / sum(counts), 1, 0) for g in groups)


def _profile_s(warm_up_s: list[float], step_s: list[float], sharded: list[bool]) -> float:
    """Seconds of one throughput profile pass whose groups take ``warm_up_s`` seconds for
    the two-sample warm-up and ``step_s`` a timed step, ``sharded`` groups every step
    (their members gather together), the others fewer past the budget: the slowest
    group's."""
    return max(
        w + profile_timed_steps(s, PROFILE_STEPS, None if shard else PROFILE_BUDGET_S) * s
        for w, s, shard in zip(warm_up_s, step_s, sharded, strict=True)
    )


def _outside_steps(
    model: PerformanceModel,
    groups: list[GroupModel],
    counts: list[int],
    local: list[float],
    global_batch_size: int,
    split_policy: str,
    compute: list[float],
    cross: float,
    sharded: list[bool],
) -> tuple[float, float]:
    """The seconds of a task outside its steps, as the engine spends them
    (worker/engine/session.py): ``(start, epoch_end)``.

    ``start``: the trial's start-up (process creation to data, with the rendezvous that
    waits for the last rank), the slowest group's optimizer construction, the model sent to
    every group, the throughput profile (the slowest group's warm-up on two samples and
    ``PROFILE_STEPS`` timed steps at the even share, fewer past ``PROFILE_BUDGET_S``
    (:func:`contracts.trial.profile_timed_steps`; every step in a ``sharded`` group, whose
    members gather together), and under the weighted split but for ``diloco`` as many again at the
    chosen shares) and the
    agreement check's gradient (one step at the even share). ``epoch_end``: validation
    (each worker a block of the validation set in proportion to its batch share, the
    slowest group's), the model sent out again (and, under ``sync``, first fetched from the
    first worker) and the epoch's checkpoint. Sending the model is priced as the slowest
    group's timed round trip to the parameter server, or the step's exchange (``cross``)
    without one.
    """
    total = sum(counts)
    even = global_batch_size / total
    even_steps = [g.step_s(even, 1, 0) for g in groups]  # compute alone: one worker's
    even_step = max(even_steps)
    passes = _profile_passes(model, counts, split_policy)
    warm_up = [g.step_s(PROFILE_WARM_UP, 1, 0) for g in groups]
    profile = _profile_s(warm_up, even_steps, sharded)
    if passes == 2:
        profile += _profile_s(warm_up, compute, sharded)
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


class DoesNotFit(ValueError):
    """The groups' memory cannot hold the task; the message names the group and the MiB."""


@dataclass(frozen=True)
class Placement:
    """How one group holds the task (:func:`placements`): ``sharding`` (``none`` or
    ``fsdp``) and ``cap``, the most samples one of its workers takes a step (its memory's
    limit on its batch share; None, no limit below what the split could give it)."""

    sharding: str = "none"
    cap: int | None = None


def placements(
    model: PerformanceModel,
    workers: dict[str, int],
    names: Sequence[str],
    global_batch_size: int,
    split_policy: str,
) -> dict[str, Placement]:
    """Each group's :class:`Placement` on the groups ``names`` from its measured memory
    (:meth:`GroupModel.memory_mb`) and its limit (:meth:`GroupModel.limit_mb`), in this
    order of preference: the whole model at any share the split could give a worker
    (``even``: ``ceil(G / W)``; weighted: ``ceil(G / W_g)``, the group alone, so that the
    placement holds whichever groups the guard parks; ``diloco`` weighted runs local steps
    of that size); sharded at any such share; then, under the weighted split but for
    ``diloco``, its share capped (``max_local_batch``), whole or sharded, whichever holds
    more samples, and at least the agreement check's batch (:data:`AGREEMENT_BATCH`, which
    every worker takes whatever its cap). Raises :class:`DoesNotFit`, naming the group and
    the MiB, where a group holds too few samples either way, or the caps together hold less
    than the global batch, and where the parameter server does not fit
    (:func:`server_shortfall`)."""
    server = server_shortfall(model, model.memory_limit_mb)
    if server is not None:
        raise DoesNotFit(server)
    total = sum(workers[name] for name in names)
    diloco = split_policy == "weighted" and model.sync_strategy == "diloco"
    weighted = split_policy == "weighted" and not diloco  # a share that can be capped
    found: dict[str, Placement] = {}
    for name in names:
        group, count = model.group(name), workers[name]
        most = largest_share(global_batch_size, total, count, split_policy)
        least = min(most, AGREEMENT_BATCH)  # the agreement check's batch is not capped
        limit = group.limit_mb(model.memory_limit_mb)
        choices = ["none", "fsdp"] if group.can_shard(count, model.sync_strategy) else ["none"]
        room = {c: group.most_samples(count, c, most, limit) for c in choices}
        held = {c: most if r is None else r for c, r in room.items()}  # None: no known limit
        uncapped = [c for c in choices if held[c] >= most]
        capped = sorted(  # the choice that holds the most samples
            (c for c in choices if weighted and held[c] >= least), key=lambda c: -held[c]
        )
        if uncapped:
            found[name] = Placement(uncapped[0])
        elif capped:
            found[name] = Placement(capped[0], held[capped[0]])
        else:
            samples = least if weighted else most
            raise DoesNotFit(_no_room(group, count, samples, choices, limit, split_policy))
    room_all = sum(
        workers[n] * (p.cap if p.cap is not None else global_batch_size) for n, p in found.items()
    )
    if room_all < global_batch_size:
        caps = ", ".join(f"{n!r} {p.cap} a worker" for n, p in found.items() if p.cap)
        raise DoesNotFit(
            f"the groups' memory holds {room_all} samples a step ({caps}), fewer than the "
            f"global batch of {global_batch_size}"
        )
    sharded = sum(1 for p in found.values() if p.sharding != "none")
    server = server_shortfall(model, model.memory_limit_mb, sharded=sharded, groups=len(names))
    if server is not None:
        raise DoesNotFit(server)
    return found


OWNER_ROUND_VECTORS = 2
"""Round vectors a group adds to the parameter server's peak where it serves a sharded
group's rounds (:func:`server_need_mb`): its assembled part and its workers' messages."""


def server_need_mb(model: PerformanceModel, sharded: int = 0, groups: int = 0) -> float:
    """The parameter server's predicted peak, MiB: its peak in the trial (the whole model and
    a checkpoint of the user's optimizer, groups whole), and where ``sharded`` of the task's
    ``groups`` are sharded under ``periodic`` or ``diloco``, :data:`OWNER_ROUND_VECTORS` per
    group and one more round vector (``exchange_bytes``): rank 0 then serves the rounds as a
    shard owner (docs/architecture.md, "A parameter server in shards"), each group's part
    assembled from its workers' messages, the answer cut per worker, and a flat copy of the
    model, where one server's gather sums the groups' vectors in place (measured at 25M and
    one group: 1.7 (diloco) to 3.0 (periodic) vectors more; docs/benchmarks.md)."""
    need = model.ps_peak_mb
    if sharded and model.sync_strategy in ROUND_STRATEGIES:
        need += (OWNER_ROUND_VECTORS * groups + 1) * model.exchange_bytes / MIB
    return need


def server_shortfall(
    model: PerformanceModel, memory_limit_mb: float | None, *, sharded: int = 0, groups: int = 0
) -> str | None:
    """Why the parameter server does not fit the task's ``memory_limit_mb`` (its ranks' data
    memory), by its predicted peak (:func:`server_need_mb`); None when it fits or either is
    not known. Sharding the groups does not help it: it holds the whole model (and under
    ``periodic`` and ``diloco`` a sharded group adds to its rounds' buffers)."""
    need = server_need_mb(model, sharded, groups)
    if not model.ps_peak_mb or memory_limit_mb is None or need <= memory_limit_mb:
        return None
    rounds = " and the rounds of a sharded group's rows" if need > model.ps_peak_mb else ""
    return (
        f"the parameter server does not fit its memory: it needs {need:,.0f} MiB "
        f"(the whole model, a checkpoint's optimizer state{rounds}) and may hold "
        f"{memory_limit_mb:,.0f} MiB; raise memory_limit_mb"
    )


def memory_shortfall(
    model: PerformanceModel,
    workers: dict[str, int],
    *,
    sharding: dict[str, str],
    caps: dict[str, int | None],
    memory_limit_mb: float,
    global_batch_size: int,
    split_policy: str,
) -> tuple[str, str] | None:
    """The first group of a task as submitted (``sharding`` and ``caps`` per group, the
    task's ``memory_limit_mb``) whose worker is predicted to need more memory than it may
    hold at the largest share the split can give it (its cap where set; the even share, or
    ``ceil(G / W_g)`` under the weighted split), with why; None when all fit or nothing
    was measured. A CPU group's limit is the task's ``memory_limit_mb`` or, if less, what
    the plan found its agents to have."""
    sharded = sum(1 for name in workers if sharding.get(name, "none") != "none")
    server = server_shortfall(model, memory_limit_mb, sharded=sharded, groups=len(workers))
    if server is not None:
        return "parameter server", server
    total = sum(workers.values())
    for name, count in workers.items():
        group = model.group(name)
        limit = group.limit_mb(memory_limit_mb)
        most = largest_share(global_batch_size, total, count, split_policy)
        share = min(most, caps.get(name) or most)
        held = sharding.get(name, "none")
        needed = group.memory_mb(share, count, held)
        if limit is None or needed is None or needed <= limit:
            continue
        helps = [_raise_limit(group)]
        if held == "none" and group.can_shard(count, model.sync_strategy):
            helps.append("shard the group (sharding 'fsdp')")
        if split_policy == "weighted" and model.sync_strategy != "diloco":
            helps.append("cap its share (max_local_batch; the plan's task_request sets it)")
        return name, (
            f"group {name!r} does not fit its memory: by plan measurements a worker needs "
            f"{_need(group, share, count, held)} at {share} samples a step and may hold "
            f"{limit:,.0f} MiB; {', or '.join(helps)}"
        )
    return None


def _no_room(
    group: GroupModel,
    workers: int,
    samples: int,
    choices: Sequence[str],
    limit_mb: float | None,
    split_policy: str,
) -> str:
    """Why ``group`` holds too few samples: what one worker needs, whole and sharded, what
    it may hold, and what would help."""
    needs = [_need(group, samples, workers, choice) for choice in choices]
    helps = [_raise_limit(group)]
    if len(choices) < 2 and workers < 2:
        helps.append("give it 2 or more workers so it can shard the model")
    if split_policy == "even":
        helps.append("use split_policy 'weighted', which can cap its share")
    return (
        f"group {group.name!r} does not fit its memory: a worker needs "
        f"{' or '.join(needs)} at {samples} sample{'s' if samples != 1 else ''} a step, "
        f"and may hold {limit_mb or 0:,.0f} MiB; {', or '.join(helps)}"
    )


def largest_share(global_batch_size: int, total: int, workers: int, split_policy: str) -> int:
    """The most samples a step one of a group's ``workers`` can be given, of ``total``
    workers: the even share ``ceil(G / W)``, or under the weighted split ``ceil(G / W_g)``
    (the group alone, whichever groups the guard parks)."""
    return -(-global_batch_size // (total if split_policy == "even" else workers))


def _need(group: GroupModel, samples: int, workers: int, sharding: str) -> str:
    """What one of ``group``'s ``workers`` needs at ``samples`` a step held as ``sharding``,
    e.g. ``416 MiB whole`` (memory measured: the callers have checked)."""
    needed = group.memory_mb(samples, workers, sharding) or 0.0
    label = "whole" if sharding == "none" else f"sharded over {workers}"
    return f"{needed:,.0f} MiB {label}"


def _raise_limit(group: GroupModel) -> str:
    """What raises what a worker of ``group`` may hold."""
    if group.device_type == "cpu":
        return "raise memory_limit_mb (up to its agents' host memory a worker)"
    return f"run it on {group.device_type} devices with more memory"


def _capped_fill(
    share: Callable[[list[int], float], list[float]],
    counts: list[int],
    caps: list[int | None],
    batch: int,
) -> list[float]:
    """Per-worker local batches from ``share(free, batch_left)`` (the split of what is left
    among the groups ``free``), with every group whose share exceeds its cap held at the
    cap and the rest split again among the others (water filling with ceilings)."""
    ceiling = [math.inf if c is None else float(c) for c in caps]
    local = [0.0] * len(counts)
    free, left = list(range(len(counts))), float(batch)
    while free:
        shares = share(free, left)
        over = [g for g, b in zip(free, shares, strict=True) if b > ceiling[g]]
        if not over:
            for g, b in zip(free, shares, strict=True):
                local[g] = b
            break
        for g in over:
            local[g] = ceiling[g]
            left -= local[g] * counts[g]
            free.remove(g)
    return local


@dataclass
class _Step:
    """One step on some groups: its seconds, per group its local batch and compute, and
    how each group holds the task."""

    seconds: float
    local: list[float]
    compute: list[float]
    cross: float
    placed: dict[str, Placement] = field(default_factory=dict)


def _step(
    model: PerformanceModel,
    workers: dict[str, int],
    names: Sequence[str],
    global_batch_size: int,
    split_policy: str,
) -> _Step:
    """A step on the groups ``names`` (of ``workers``), split by ``split_policy``, each
    group placed by its memory (:func:`placements`, whose DoesNotFit it raises)."""
    n = model.exchange_bytes
    placed = placements(model, workers, names, global_batch_size, split_policy)
    groups = [model.group(name) for name in names]
    total = sum(workers[name] for name in names)
    fixed = [g.fixed_s(workers[g.name], n, placed[g.name].sharding) for g in groups]
    slopes = [g.slope(placed[g.name].sharding) for g in groups]
    counts = [workers[g.name] for g in groups]
    caps = [placed[g.name].cap for g in groups]
    round_steps = None
    if split_policy == "weighted" and model.sync_strategy == "diloco":
        steps = [g.step_s(global_batch_size / w, w, n) for g, w in zip(groups, counts, strict=True)]
        local, compute = _diloco_round(steps, counts, global_batch_size)
        round_steps = diloco_round_steps(local, counts, global_batch_size, model.sync_period)
    else:
        if split_policy == "weighted":

            def share(free: list[int], left: float) -> list[float]:
                sub_fixed, sub_slopes = [fixed[g] for g in free], [slopes[g] for g in free]
                common = _balanced(sub_fixed, sub_slopes, [counts[g] for g in free], left)
                return [
                    max(0.0, (common - f) / s) for f, s in zip(sub_fixed, sub_slopes, strict=True)
                ]

            local = _capped_fill(share, counts, caps, global_batch_size)
            compute = [f + s * b for f, s, b in zip(fixed, slopes, local, strict=True)]
        else:  # every worker G / W: the measured step there (the sharded step's line)
            local = [global_batch_size / total] * len(groups)
            compute = [
                g.step_s(b, w, n) if placed[g.name].sharding == "none" else fixed[i] + slopes[i] * b
                for i, (g, w, b) in enumerate(zip(groups, counts, local, strict=True))
            ]
    cross = exchange_s(model, names)
    seconds = expected_max(compute, _spreads(model, groups, compute, round_steps)) + cross
    return _Step(seconds, local, compute, cross, placed)


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
    is parked, while one does (``sync``, ``periodic`` and ``diloco`` with the weighted
    split and ``guard`` on; a group the placement shards is never parked, and under ``sync``
    none is where one is sharded; every group otherwise)."""
    active = list(workers)
    if not (guard and split_policy == "weighted" and model.sync_strategy in GUARDED_STRATEGIES):
        return active
    first = _step(model, workers, active, global_batch_size, split_policy)
    sharded = {name for name, p in first.placed.items() if p.sharding != "none"}
    if sharded and model.sync_strategy == "sync":
        return active  # the engine's guard does not act on a sync task with a sharded group
    now = first.seconds
    while len(active) > 1:
        options = []
        # A sharded group is never parked (worker/engine/guard.py, Guard.stays).
        for rest in ([a for a in active if a != g] for g in active if g not in sharded):
            try:  # the guard does not park a group the others' memory cannot do without
                options.append(
                    (_step(model, workers, rest, global_batch_size, split_policy).seconds, rest)
                )
            except DoesNotFit:
                continue
        if not options:
            break
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
    smaller than the workers or the trial lacks an exchange it needs, and DoesNotFit (a
    ValueError) when the groups' memory cannot hold the task."""
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
    sharded = [full.placed[g.name].sharding == "fsdp" for g in groups]
    start, epoch_end = _outside_steps(
        model,
        groups,
        counts,
        full.local,
        global_batch_size,
        split_policy,
        full.compute,
        full.cross,
        sharded,
    )
    profiled = _profiled_step_s(model, groups, counts, global_batch_size, split_policy, full)
    # The check counts from the attempt's warm point (the steps before it pay one-off costs)
    # and waits for a round's end.
    period = model.sync_period if model.sync_strategy in ROUND_STRATEGIES else 1
    warm = warm_point(0, 0, steps, period)
    first_check = math.ceil((warm + guard_first_check_steps(profiled)) / period) * period
    before_check = min(first_check, steps * epochs) * (full.seconds - on.seconds)
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
        sharding={name: p.sharding for name, p in full.placed.items()},
        max_local_batch={name: p.cap for name, p in full.placed.items()},
        memory_mb={
            g.name: g.memory_mb(max(b, full_b), workers[g.name], full.placed[g.name].sharding)
            for g, b, full_b in zip(groups, local, full.local, strict=True)
        },
        memory_limit_mb={g.name: g.limit_mb(model.memory_limit_mb) for g in groups},
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
    no_room: dict[frozenset[str], str] = {}  # a set whose memory cannot hold the task: why

    def guesses(workers: dict[str, int]) -> list[Prediction]:
        """The predictions on ``workers`` under each split policy that fits its memory."""
        found = []
        for policy in split_policies:
            try:
                found.append(predict(model, workers, split_policy=policy, **kwargs))
            except DoesNotFit as exc:
                no_room.setdefault(frozenset(workers), str(exc))
        return found

    options = [
        guess
        for subset in subsets(names)
        if fits_batch(model, {n: asked[n] for n in subset}, global_batch_size)
        for guess in guesses({n: asked[n] for n in subset})
    ]
    if not options and no_room:
        raise DoesNotFit(
            "no set of the candidate groups fits its memory: "
            + no_room.get(frozenset(names), next(iter(no_room.values())))
        )
    if not options:
        raise ValueError("no subset of the candidate groups can hold the global batch")
    options.sort(key=lambda p: (p.finish_s, p.total_workers))
    best = options[0]

    def fastest(workers: dict[str, int]) -> Prediction | None:
        """The prediction on ``workers`` under its fastest split policy (None: no workers,
        more than the global batch, or more than its memory holds)."""
        if not workers or not fits_batch(model, workers, global_batch_size):
            return None
        return min(guesses(workers), key=lambda p: p.finish_s, default=None)

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
            left_out[name] = no_room.get(
                frozenset(with_it), "with it the workers would exceed the global batch"
            )
            continue
        guarded = fastest(with_it)
        assert guarded is not None
        # Why it costs: its prediction as if the guard let it be (it parks it after its first
        # check, when the predicted step is that much longer).
        unguarded = [  # under the split policies that fit its memory
            predict(model, with_it, split_policy=o.split_policy, guard=False, **kwargs)
            for o in guesses(with_it)
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
            try:
                guess = predict(model, workers, split_policy=policy, **kwargs)
            except DoesNotFit:
                continue
            if guess.finish_s > deadline_s:
                continue
            key = (guess.total_workers, guess.finish_s)
            if found is None or key < (found.total_workers, found.finish_s):
                found = guess
    return found
