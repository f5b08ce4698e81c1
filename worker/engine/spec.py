"""The run specification: the one JSON payload every process of a task receives.

Besides the rank layout it fixes how the task is spread over heterogeneous
groups: the split policy (``even`` or ``weighted`` by measured throughput),
the cross-group sync strategy, the neighbour data exchange, checkpoint
frequency, the per-task preprocessing steps and, for emulation on one host,
each group's ``speed_factor``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from contracts.data import DataOptions
from contracts.plan import (
    MAX_PS_SHARDS,
    PS_SHARDED_STRATEGIES,
    ROUND_STRATEGIES,
    AgreementTolerance,
    DilocoExchange,
    FsdpParamDtype,
    GroupPlan,
    OnDisagreement,
    Sharding,
    SplitPolicy,
    SyncStrategy,
    check_local_batch,
    check_sharded_strategy,
    ps_ranks,
)
from contracts.preprocess import PreprocessStep
from contracts.trial import PROFILE_BUDGET_S, PROFILE_STEPS, TrialOptions

OnNonFinite = Literal["fail", "skip_step"]


class RunSpec(BaseModel):
    """Everything a rank needs to take part in a task.

    Rank 0 is the parameter server; compute ranks start at 1 and each group in
    ``groups`` occupies a contiguous block of ranks, in list order. ``code`` is
    ``example:<name>`` (module ``examples/<name>.py`` of this repository) or an
    absolute path to a ``.py`` file. ``checkpoint_dir`` is written by the
    parameter server, and by the workers that hold an optimizer state (a sharded group's
    members, their rows; a group leader under ``periodic`` or ``diloco``, its group's), in
    each checkpoint's state folders (contracts/sharded_state.py); ``resume_from``
    is a checkpoint path it can read. A compute worker reads the resume checkpoint's state
    folders beside ``resume_from``, or in ``resume_state_dir`` where that is given (an
    agent's rank, which downloads them into its own directory).

    Heterogeneity: ``split_policy`` gives each worker an equal (``even``) or
    throughput-proportional (``weighted``) share of data and global batch;
    ``rebalance_every`` is the online controller's check interval in steps
    (0: only at epoch ends). Each worker's throughput profile at the start times
    ``profile_steps`` steps after a warm-up, or fewer once their seconds reach
    ``profile_budget_s`` (:func:`contracts.trial.profile_timed_steps`; not in a sharded
    group, whose members step together). ``sync_strategy`` is ``sync`` (parameter server
    every step), ``periodic`` (groups train locally, models averaged every
    ``sync_period`` steps) or ``quorum`` (update once ``quorum`` of the groups
    reported, late gradients at most ``max_staleness`` updates old) or ``diloco`` (rounds of
    ``sync_period`` steps, local step counts scaled to each group's speed, an outer Nesterov
    step of ``outer_lr`` and ``outer_momentum`` on the groups' pseudo-gradients, the next
    round waiting for it (``diloco_exchange: blocking``) or not (``overlapped``), or each
    group's update applied as it arrives (``async``), :mod:`worker.engine.strategy_diloco`).
    ``guard`` (default on) lets a ``sync`` task with the ``weighted`` split park a group
    whose part in each step costs more than it adds (:mod:`worker.engine.guard`).
    ``sharding`` (``none`` or ``fsdp``; a group's own ``sharding`` wins) shards the model,
    its gradients and its optimizer state over each ``fsdp`` group's workers, in units of the
    module classes ``fsdp_units`` names or chosen by size (:mod:`worker.engine.fsdp`),
    computing in ``fsdp_param_dtype`` (``bfloat16``: mixed precision, FSDP2's policy); with
    ``sync``, ``periodic`` and ``diloco`` (not its ``async`` exchange; :attr:`owner_rounds`),
    and the guard never parks a sharded group (nor acts on a ``sync`` task with one).
    ``ps_shards`` (S, default 1) cuts the parameter server's model into S slices, each owned
    by its own process (rank 0 and the ranks after the workers, :meth:`shard_servers`): each
    group leader exchanges slice s with its owner only (:mod:`worker.engine.shard_server`);
    with ``sync`` (the owners sum each step's gradients; each worker of an ``fsdp`` group
    sends its own rows), ``periodic`` and ``diloco`` (not its ``async`` exchange).
    ``exchange_fraction`` of each worker's shard moves to its ring neighbour
    after every epoch. ``checkpoint_every`` adds a checkpoint every N steps.
    ``data`` says how compute workers read their shards (:class:`contracts.data.DataOptions`:
    streaming through a DataLoader or stacked in memory, loader processes, prefetch).
    ``on_nonfinite``: a non-finite loss, gradient or buffer on any worker ends
    the task (``fail``, :class:`worker.engine.numerics.NonFiniteError` naming
    epoch, step, rank and group) or skips that optimizer step (``skip_step``).
    Cross-device agreement (:mod:`worker.engine.agreement`): before training every group's
    gradient of one fixed batch, and every ``agreement_every`` steps (0: never) its
    parameters, are compared with the parameter server's within ``agreement_tolerance``
    (per device-type pair, :data:`contracts.plan.DEFAULT_AGREEMENT_TOLERANCE`); a group
    that disagrees raises an alarm and fails the task (``on_disagreement: fail``) or is
    left out of training (``exclude``); ``off`` skips both checks.
    ``step_metrics_every``: steps between two points of the per-step series (training loss,
    samples/s, learning rate; :class:`worker.engine.report.StepCurve`), 0: none; None (the
    default): about 100 an epoch (:func:`worker.engine.report.step_every`).
    ``emulation_pace`` (benchmarks) gives every emulated group one fixed
    undisturbed speed, ``(samples, seconds)`` points of a compute section
    measured before the run (:class:`worker.engine.emulation.Pace`); None: each
    worker's fastest recent section.
    ``debug_dump_dir`` (debugging, like ``emulation_pace`` set on the RunSpec
    only, never from a task's options): each rank saves its final parameters
    and buffers ``[P + B]`` (:meth:`worker.engine.state.ModelState.vector`) to
    ``rank-{rank}.pt`` there, and the parameter server every step's global
    batch indices (every strategy; the split's batches) to ``batches.pt``; the
    equivalence tests replay those batches in one process (docs/heterogeneity.md).
    ``debug_guard_schedule`` (tests, set on the RunSpec only): at the guard's check at step
    ``s`` the parked groups become exactly ``schedule[s]`` (group indices), and they move
    at no other check, so a test can park a group and take it back at known steps.
    ``trial`` (a plan's trial task, set from the task's spec): the ranks time the task's
    step and exchanges instead of training (:mod:`worker.engine.trial`).
    ``hyperparameters`` (the task's, name -> JSON scalar) override the defaults the training
    code declares in ``HYPERPARAMETERS`` (:func:`worker.engine.contract.apply_hyperparameters`).
    A group's ``max_local_batch`` caps the samples each of its workers takes in a step: the
    split keeps every share within it (:class:`worker.engine.balance.Balancer`), and a spec
    whose caps cannot hold the global batch, or whose ``even`` split exceeds one, is refused
    (:func:`check_local_batches`).
    """

    task_id: int
    code: str = Field(min_length=1)
    epochs: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)
    seed: int = Field(default=0, ge=0)
    groups: list[GroupPlan] = Field(min_length=1)
    split_policy: SplitPolicy = "even"
    rebalance_every: int = Field(default=10, ge=0)
    profile_steps: int = Field(default=PROFILE_STEPS, ge=1, le=100)
    profile_budget_s: float = Field(default=PROFILE_BUDGET_S, gt=0.0, le=3600.0)
    sync_strategy: SyncStrategy = "sync"
    sync_period: int = Field(default=1, ge=1)
    quorum: int | None = Field(default=None, ge=1)
    max_staleness: int = Field(default=2, ge=0)
    outer_lr: float = Field(default=0.7, gt=0.0, le=10.0)
    outer_momentum: float = Field(default=0.5, ge=0.0, lt=1.0)
    diloco_exchange: DilocoExchange = "blocking"
    guard: bool = True
    sharding: Sharding = "none"
    fsdp_units: list[str] = Field(default_factory=list)
    fsdp_param_dtype: FsdpParamDtype = "float32"
    ps_shards: int = Field(default=1, ge=1, le=MAX_PS_SHARDS)
    exchange_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    checkpoint_every: int | None = Field(default=None, ge=1)
    on_nonfinite: OnNonFinite = "fail"
    on_disagreement: OnDisagreement = "fail"
    agreement_every: int = Field(default=100, ge=0)
    agreement_tolerance: AgreementTolerance = Field(default_factory=dict)
    step_metrics_every: int | None = Field(default=None, ge=0)
    preprocess: list[PreprocessStep] = Field(default_factory=list)
    data: DataOptions = Field(default_factory=DataOptions)
    checkpoint_dir: str
    resume_from: str | None = None
    resume_state_dir: str | None = None
    emulation_pace: (
        list[tuple[Annotated[int, Field(ge=1)], Annotated[float, Field(gt=0)]]] | None
    ) = Field(default=None, min_length=1)
    debug_dump_dir: str | None = None
    debug_guard_schedule: dict[int, list[int]] | None = None
    trial: TrialOptions | None = None
    hyperparameters: dict[str, str | int | float | bool | None] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        if self.global_batch_size < self.n_workers:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} < {self.n_workers} workers"
            )
        if self.quorum is not None and self.quorum > len(self.groups):
            raise ValueError(f"quorum {self.quorum} > {len(self.groups)} groups")
        if any(step.op == "tokenize" for step in self.preprocess[1:]):
            raise ValueError("tokenize must be the first preprocessing step")
        check_sharding(self)
        check_ps_shards(self)
        check_local_batches(self)
        return self

    def sharded(self, g: int | str | None) -> bool:
        """True when group ``g`` (index or name) holds its model sharded (``fsdp``); False for
        None (the parameter server's group index: it holds the whole model)."""
        if g is None:
            return False
        return self.groups[self.group_index(g)].sharded(self.sharding)

    @property
    def any_sharded(self) -> bool:
        """True when some group holds its model sharded."""
        return any(self.sharded(g) for g in range(len(self.groups)))

    @property
    def world_size(self) -> int:
        """Number of processes: the parameter server, every compute worker and the parameter
        server's other shard owners (``ps_shards - 1``)."""
        return self.n_workers + self.ps_shards

    @property
    def owner_rounds(self) -> bool:
        """True when every compute worker exchanges its own part of its group's vectors with
        the parameter server's owners (:mod:`worker.engine.shard_server`): with ``ps_shards``
        > 1, and under ``periodic`` and ``diloco`` with a sharded group (whose workers each
        send their own rows of a round; with one shard, to rank 0)."""
        return self.ps_shards > 1 or (self.any_sharded and self.sync_strategy in ROUND_STRATEGIES)

    @property
    def model_in_slices(self) -> bool:
        """True when the parameter server's owners hold the global model, rank 0 slice 0 only
        and no copy of it beside (the owners' rounds, :attr:`owner_rounds`, under ``periodic``
        and ``diloco``: ``ps_shards`` > 1, or one shard beside a sharded group): each group
        leaves an epoch with the global model from its last round, and each checkpoint's
        model is written by the owners
        (:meth:`worker.engine.shard_server.ServerShards.write_model`)."""
        return self.owner_rounds and self.sync_strategy in ROUND_STRATEGIES

    def shard_servers(self) -> list[int]:
        """Global ranks owning the parameter server's shards, shard order: rank 0, then the
        ranks after the last compute worker."""
        return ps_ranks(self.n_workers, self.ps_shards)

    def is_shard_server(self, rank: int) -> bool:
        """True for a rank that owns a shard of the parameter server and is not rank 0 (it
        holds no model and trains nothing: :func:`worker.engine.shard_server.serve`)."""
        return rank > self.n_workers and rank in self.shard_servers()

    def rank_sharded(self, rank: int) -> bool:
        """True for a compute worker of a group that holds its model sharded (``fsdp``)."""
        return 0 < rank <= self.n_workers and self.sharded(self.group_of(rank))

    @property
    def n_workers(self) -> int:
        """Number of compute workers over all groups."""
        return sum(g.workers for g in self.groups)

    @property
    def quorum_size(self) -> int:
        """Groups a quorum update waits for: ``quorum``, by default all groups but one (>= 1)."""
        return self.quorum if self.quorum is not None else max(1, len(self.groups) - 1)

    def group_index(self, g: int | str) -> int:
        """Index in ``groups`` of group ``g`` (an index or a name); raises KeyError if unknown."""
        if isinstance(g, int):
            if not 0 <= g < len(self.groups):
                raise KeyError(f"no group with index {g}")
            return g
        for i, plan in enumerate(self.groups):
            if plan.name == g:
                return i
        raise KeyError(f"no group named {g!r}")

    def group_ranks(self, g: int | str) -> list[int]:
        """Global ranks of group ``g`` (index or name), contiguous and ascending."""
        index = self.group_index(g)
        first = 1 + sum(p.workers for p in self.groups[:index])
        return list(range(first, first + self.groups[index].workers))

    def group_of(self, rank: int) -> int:
        """Index of the group that compute rank ``rank`` belongs to.

        Raises ValueError for rank 0 (the parameter server), a rank owning one of its shards,
        or a rank outside the world.
        """
        if rank == 0 or self.is_shard_server(rank):
            raise ValueError(f"rank {rank} is the parameter server's, not in any group")
        for i in range(len(self.groups)):
            if rank in self.group_ranks(i):
                return i
        raise ValueError(f"rank {rank} outside world of size {self.world_size}")

    def leader_ranks(self) -> list[int]:
        """First rank of every group, in group order."""
        return [self.group_ranks(i)[0] for i in range(len(self.groups))]

    def speed_factor_of(self, rank: int) -> float:
        """Emulated speed factor of compute rank ``rank`` (its group's)."""
        return self.groups[self.group_of(rank)].speed_factor

    @property
    def local_batch_caps(self) -> list[int | None] | None:
        """Each compute worker's cap on its samples a step (its group's ``max_local_batch``),
        in worker order; None when no group has one."""
        if all(g.max_local_batch is None for g in self.groups):
            return None
        return [g.max_local_batch for g in self.groups for _ in range(g.workers)]


def check_sharding(spec: RunSpec) -> None:
    """Raises ValueError, naming the field, for sharding that cannot be run: ``fsdp`` on a
    group of one worker (nothing to shard), with a strategy other than ``sync``, ``periodic``
    and ``diloco`` (:data:`contracts.plan.SHARDED_STRATEGIES`) or with diloco's ``async``
    exchange, or ``fsdp_units`` or ``fsdp_param_dtype`` on a task that shards no group."""
    sharded = [g for g in spec.groups if (g.sharding or spec.sharding) == "fsdp"]
    for group in sharded:
        if group.workers < 2:
            raise ValueError(
                f"sharding 'fsdp' needs 2 or more workers in group {group.name!r}, which has "
                "1: there is nothing to shard (give it more workers, or sharding 'none')"
            )
    if sharded:
        check_sharded_strategy(spec.sync_strategy, spec.diloco_exchange)
    if spec.fsdp_units and not sharded:
        raise ValueError("fsdp_units applies only where a group has sharding 'fsdp'")
    if spec.fsdp_param_dtype != "float32" and not sharded:
        raise ValueError("fsdp_param_dtype applies only where a group has sharding 'fsdp'")


def check_ps_shards(spec: RunSpec) -> None:
    """Raises ValueError, naming ``ps_shards``, for a sharded parameter server that cannot be
    run: a strategy other than ``sync``, ``periodic`` and ``diloco``
    (:data:`contracts.plan.PS_SHARDED_STRATEGIES`), diloco's ``async`` exchange, or a plan's
    trial (which times one server's exchange). More shards than
    the model has parameters fails at the start (:func:`worker.engine.exchange.shard_bounds`).
    """
    if spec.ps_shards == 1:
        return
    if spec.sync_strategy not in PS_SHARDED_STRATEGIES:
        raise ValueError(
            f"ps_shards {spec.ps_shards} runs with sync_strategy "
            f"{' or '.join(map(repr, PS_SHARDED_STRATEGIES))} only so far, not "
            f"{spec.sync_strategy!r} (use ps_shards 1)"
        )
    if spec.trial is not None:
        raise ValueError("ps_shards applies to training, not to a plan's trial")
    if spec.sync_strategy == "diloco" and spec.diloco_exchange == "async":
        raise ValueError(
            "ps_shards applies to diloco_exchange 'blocking' and 'overlapped' so far, not "
            "'async' (use ps_shards 1)"
        )


def check_local_batches(spec: RunSpec) -> None:
    """Raises ValueError, naming ``max_local_batch``, the group and the numbers, when the
    groups' caps cannot run the spec: together they hold fewer than ``global_batch_size``
    samples a step, or the ``even`` split gives a worker more than its group's cap
    (:func:`contracts.plan.check_local_batch`)."""
    groups = [(f"group {g.name!r}", g.workers, g.max_local_batch) for g in spec.groups]
    check_local_batch(groups, spec.global_batch_size, spec.split_policy)
