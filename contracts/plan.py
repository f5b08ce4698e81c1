"""How a task is laid out over resource groups: one group's part (`GroupPlan`), the device
types a group may have, how data and batch are split between its workers and how the groups
sync (the strategy names the API accepts; the engine has one class per name,
`worker.engine.strategy`)."""

import math
from collections.abc import Sequence
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, Field

DeviceType = Literal["cpu", "cuda", "npu"]
SplitPolicy = Literal["even", "weighted"]
SyncStrategy = Literal["sync", "periodic", "quorum", "diloco"]
Sharding = Literal["none", "fsdp"]
"""How a group holds the model: `none`, every worker the whole of it; `fsdp`, each of its W
workers 1/W of the parameters, gradients and optimizer state (torch's FSDP2 over the group,
worker/engine/fsdp.py)."""
FsdpParamDtype = Literal["float32", "bfloat16"]
"""The dtype a sharded group computes in: its gathered parameters and activations (FSDP2's
``MixedPrecisionPolicy.param_dtype``); its gradients are reduced and its optimizer steps in
float32 whichever (``reduce_dtype``), and the parameters stay float32 between steps."""
BFLOAT16_TOLERANCE = 0.05
"""The agreement checks' tolerance (relative L2) for a group that computes in bfloat16
(``fsdp_param_dtype``), unless the task gives a wider one: bfloat16 keeps 8 bits of
mantissa, so its gradients differ from float32's by about 1e-2 (measured on the test models
0.4-1.3e-2)."""
DilocoExchange = Literal["blocking", "overlapped", "async"]
"""How `diloco` rounds meet the parameter server: `blocking` waits for the outer update before
the next round; `overlapped` goes on at once and takes it one round late; `async` has the
parameter server apply each group's update as it arrives, so a group waits for its own
exchange only (two or more groups)."""
MAX_PS_SHARDS = 16
"""The most processes a task's parameter server may be cut into (``ps_shards``)."""
PS_SHARDED_STRATEGIES = ("sync", "periodic", "diloco")
"""The strategies whose parameter server may be sharded (``ps_shards`` > 1)."""
SHARDED_STRATEGIES = ("sync", "periodic", "diloco")
"""The strategies that run a group sharded (``sharding: fsdp``): not ``quorum``, nor
``diloco``'s ``async`` exchange (:func:`check_sharded_strategy`)."""


def check_sharded_strategy(strategy: str | None, exchange: str | None) -> None:
    """Raises ValueError, naming the field, where a task with a sharded (``fsdp``) group
    asks for a strategy or exchange that does not run one: a strategy not in
    :data:`SHARDED_STRATEGIES`, or ``diloco_exchange: async``. None: not known (yet)."""
    if strategy is not None and strategy not in SHARDED_STRATEGIES:
        allowed = ", ".join(map(repr, SHARDED_STRATEGIES))
        raise ValueError(
            f"sharding 'fsdp' runs with sync_strategy {allowed}, not {strategy!r} (its "
            "exchange of the workers' own rows is not built): choose one of those, or "
            "sharding 'none'"
        )
    if strategy == "diloco" and exchange == "async":
        raise ValueError(
            "sharding 'fsdp' runs with diloco_exchange 'blocking' or 'overlapped', not 'async' "
            "(a group's rows applied as they arrive is not built): choose one of those, or "
            "sharding 'none'"
        )


def ps_ranks(n_workers: int, ps_shards: int) -> list[int]:
    """The global ranks of a task's parameter server, shard order: rank 0, then the owners of
    its other ``ps_shards - 1`` shards, after the ``n_workers`` compute ranks 1 .. W."""
    return [0, *range(n_workers + 1, n_workers + ps_shards)]


ROUND_STRATEGIES = ("periodic", "diloco")
"""The strategies whose groups train on their own for `sync_period` steps (a round) and keep
one inner optimizer state per group, which another layout of groups cannot take over."""
GUARDED_STRATEGIES = ("sync", "periodic", "diloco")
"""The strategies whose groups all meet at every step or round, or (``diloco``'s overlapped
and async exchanges) at the rounds where the guard checks, where the guard may park a group
that lengthens them (worker/engine/guard.py; the planner predicts the same)."""
GUARD_MARGIN = 0.10
"""The predicted shortening of the step, as a fraction, that moves a group (guard, planner)."""
GUARD_CHECK_STEPS = 10
"""Steps before the guard's first check at most (fewer where steps are long:
:func:`guard_first_check_steps`), which comes at the first control point from that
many steps of the attempt on, whatever ``rebalance_every`` (a ``diloco`` round's end;
without in-epoch rebalancing it would wait for the first epoch's end); the steps before it
run on every group (guard, planner)."""
GUARD_FIRST_CHECK_S = 4.0
"""Seconds of steps after which the guard's first check may come sooner than
``GUARD_CHECK_STEPS`` (:func:`guard_first_check_steps`)."""
GUARD_FIRST_CHECK_MIN_STEPS = 4
"""The fewest steps before the guard's first check: a window of fewer measures a group's
fixed part and rate too roughly."""


def guard_first_check_steps(step_s: float | None) -> int:
    """Steps before the guard's first check for a step predicted to take ``step_s`` seconds
    (the throughput profile's: the slowest worker's compute at its share; None where the
    attempt did not profile, e.g. on resuming): as many as fill ``GUARD_FIRST_CHECK_S``,
    between ``GUARD_FIRST_CHECK_MIN_STEPS`` and ``GUARD_CHECK_STEPS``. Long steps are
    measured well in fewer of them, and each step run on a group that costs more than it
    adds is lost (at 25M parameters, 10 steps of 2.2 s against 0.5 s without the slow
    group: 17 s)."""
    if step_s is None or step_s <= 0:
        return GUARD_CHECK_STEPS
    wanted = math.ceil(GUARD_FIRST_CHECK_S / step_s)
    return max(GUARD_FIRST_CHECK_MIN_STEPS, min(GUARD_CHECK_STEPS, wanted))


def warm_point(step: int, split_step: int, steps_per_epoch: int, period: int) -> int:
    """The global step of the attempt's warm point from global step ``step`` (the split at
    ``split_step`` of ``steps_per_epoch``): its second sync point (``sync``: the end of the
    second step; ``periodic`` and ``diloco``: the second round's end, rounds ending at
    multiples of ``period`` in the epoch), or the epoch's end if that comes first. A worker's
    optimizer step is its own work, which its busy clock (worker/engine/compute.py) charges
    to its next compute section: the first one (which makes the optimizer's state) to its
    second local step, in the first round, or for a group of one local step a round in the
    second round's first; an epoch's end drops it (a new clock)."""
    period = max(1, period)
    first = min((split_step // period + 1) * period, steps_per_epoch)
    second = min((first // period + 1) * period, steps_per_epoch)
    return step + second - split_step


DILOCO_PERIOD = 16
"""`diloco`'s round length (`sync_period`) when none is given; a round of one step is refused
(every group would take every step, which is `periodic` with an outer step)."""


def check_period(value: int, strategy: object) -> int:
    """`sync_period` for `strategy`: other than 1 only with `periodic` or `diloco`, and at
    least 2 with `diloco`. Raises ValueError saying what to set."""
    if value != 1 and strategy not in ROUND_STRATEGIES:
        raise ValueError("sync_period applies to sync_strategy 'periodic' or 'diloco' only")
    if value < 2 and strategy == "diloco":
        raise ValueError(
            f"a diloco round needs 2 steps or more (sync_period; leave it out for {DILOCO_PERIOD})"
        )
    return value


OnDisagreement = Literal["fail", "exclude", "off"]
OnGroupLoss = Literal["restart", "shrink", "wait"]
"""What a restart does when a group the task ran on cannot take its workers again: `restart`
moves them to a compatible group (same device type) and waits for one with room; `shrink`
does that if one has room now, else goes on with the surviving groups (the lost group's
share goes to them by their measured rates, the global batch unchanged); `wait` waits for
the task's own groups."""

AGREEMENT_BATCH = 8
"""Items in the fixed batch of the agreement check before training, which every worker takes
whatever its ``max_local_batch`` (worker/engine/agreement.py; the planner's fit check)."""

DEFAULT_AGREEMENT_TOLERANCE = {"cpu/cpu": 0.0}
"""Cross-device agreement (``worker.engine.agreement``): the relative L2 distance allowed
between a group's result and the parameter server's, per device-type pair ("a/b", sorted):
float32 CPU against CPU must agree bit for bit; any other pair within ``OTHER_PAIR_TOLERANCE``.
"""
OTHER_PAIR_TOLERANCE = 1e-4


def pair_key(a: str, b: str) -> str:
    """The tolerance key of device types ``a`` and ``b``: both names, sorted, joined by "/"."""
    return "/".join(sorted((a, b)))


def _valid_pairs(tolerances: dict[str, float]) -> dict[str, float]:
    kinds = get_args(DeviceType)
    out = {}
    for key, value in tolerances.items():
        parts = key.split("/")
        if len(parts) != 2 or not all(p in kinds for p in parts):
            raise ValueError(
                f"key {key!r} must be two device types joined by '/', "
                f"e.g. 'cpu/cuda' (device types: {', '.join(kinds)})"
            )
        out[pair_key(*parts)] = value
    return out


AgreementTolerance = Annotated[
    dict[str, Annotated[float, Field(ge=0.0, le=1.0)]], AfterValidator(_valid_pairs)
]
"""Per-task overrides of :data:`DEFAULT_AGREEMENT_TOLERANCE`, e.g. ``{"cpu/cuda": 1e-3}``."""


class GroupPlan(BaseModel):
    """One resource group's part in a task.

    ``speed_factor`` (0 < f <= 1) is *emulation*: every compute section of the
    group's workers is padded with sleep so it takes ``1 / f`` times as long as
    this host takes undisturbed (see :mod:`worker.engine.emulation`). 1.0 means
    the hardware's own speed. ``sharding``: the group's own (:data:`Sharding`), None for the
    task's. ``max_local_batch``: the most samples one worker of the group takes in a step (its
    memory cap, which a planner sets from measured memory); the split never gives a worker of
    the group more (:func:`worker.engine.sharding.capped_shares`); None: no cap.
    """

    name: str = Field(min_length=1)
    device_type: DeviceType
    workers: int = Field(ge=1)
    speed_factor: float = Field(default=1.0, gt=0.0, le=1.0)
    sharding: Sharding | None = None  # the group's own; None: the task's
    max_local_batch: int | None = Field(default=None, ge=1)  # per worker and step; None: no cap

    def sharded(self, task_sharding: str) -> bool:
        """True when the group holds its model sharded (``fsdp``): its own ``sharding``, else
        the task's ``task_sharding``."""
        return (self.sharding or task_sharding) == "fsdp"


def check_local_batch(
    groups: list[tuple[str, int, int | None]], global_batch_size: int, split_policy: str | None
) -> None:
    """Raises ValueError when the groups' ``max_local_batch`` cannot run the task: the caps
    (``max_local_batch × workers`` summed over the groups; a group without one takes any
    share) hold fewer than ``global_batch_size`` samples a step, or ``split_policy`` ``even``
    gives a worker more than its group's cap (the largest even share, ``ceil(B / W)``, is
    checked, whichever workers take the extra samples). ``groups``: ``(label, workers,
    max_local_batch)`` each, the label naming the group in the message. ``split_policy``
    None: the first check only."""
    capped = [(label, workers, cap) for label, workers, cap in groups if cap is not None]
    if len(capped) == len(groups) and capped:
        room = sum(workers * cap for _, workers, cap in capped)
        if room < global_batch_size:
            parts = "; ".join(f"{label} {w} × {cap}" for label, w, cap in capped)
            raise ValueError(
                f"max_local_batch lets the groups take at most {room} samples a step (workers "
                f"× max_local_batch: {parts}), "
                f"fewer than global_batch_size {global_batch_size}: lower global_batch_size, "
                "add workers, or raise a group's max_local_batch"
            )
    if split_policy != "even" or not capped:
        return
    n_workers = sum(workers for _, workers, _ in groups)
    even = -(-global_batch_size // n_workers)
    for label, _, cap in capped:
        if even > cap:
            raise ValueError(
                f"split_policy 'even' gives each worker up to {even} samples a step "
                f"(global_batch_size {global_batch_size} over {n_workers} workers), more than "
                f"the max_local_batch {cap} of {label}: use split_policy 'weighted' (it keeps "
                "each share within its group's max_local_batch), lower global_batch_size, add "
                "workers, or raise that max_local_batch"
            )


def local_steps(totals: Sequence[float], length: int, *, batch: int | None) -> list[int]:
    """Local steps ``tau_g`` each group takes in a round of ``length`` split steps.

    ``totals[g]`` is group ``g``'s samples ``n_g`` in the round. Without ``batch`` every
    group takes ``length`` steps; with the global batch B, a group takes
    ``clamp(round(n_g / B), 1, length)`` (steps of about B samples, as it would train
    alone). A group without samples (left out) takes none.
    """
    steps = []
    for total in totals:
        if total == 0:
            steps.append(0)
        elif batch is None:
            steps.append(length)
        else:
            steps.append(min(length, max(1, math.floor(total / batch + 0.5))))
    return steps
