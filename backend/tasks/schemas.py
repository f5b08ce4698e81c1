import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from backend.core.schemas import UtcDateTime
from backend.tasks.models import EventKind, NodeRole, SubTaskStatus, TaskStatus
from contracts.data import DataOptions
from contracts.payload import (
    DEFAULT_MAX_RUNTIME_S,
    DEFAULT_MEMORY_LIMIT_MB,
    MAX_RUNTIME_S,
    TaskLimits,
)
from contracts.plan import (
    DILOCO_PERIOD,
    MAX_PS_SHARDS,
    PS_SHARDED_STRATEGIES,
    SHARDED_STRATEGIES,
    AgreementTolerance,
    DeviceType,
    DilocoExchange,
    FsdpParamDtype,
    OnDisagreement,
    OnGroupLoss,
    Sharding,
    SplitPolicy,
    SyncStrategy,
    check_local_batch,
    check_period,
    check_sharded_strategy,
)
from contracts.preprocess import PreprocessStep
from contracts.strict import StrictModel
from contracts.task_spec import ENGINE_OPTIONS


def _class_name(value: str) -> str:
    if not value.isidentifier():
        raise ValueError(f"{value!r} is not a class name (a Python identifier, e.g. Block)")
    return value


ClassName = Annotated[str, Field(max_length=100), AfterValidator(_class_name)]
"""A module class name, as `fsdp_units` lists them (`type(module).__name__`)."""

TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:=+/-]*$"
MAX_TAGS = 16

Tag = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        pattern=TAG_PATTERN,
        description="a label: a letter or digit, then letters, digits and _ . : = + / -",
    ),
]


def _unique_tags(value: list[str]) -> list[str]:
    return sorted(set(value))


Tags = Annotated[list[Tag], Field(max_length=MAX_TAGS), AfterValidator(_unique_tags)]
"""A task's labels (`baseline`, `lr=3e-4`, `paper:fig3`): at most 16, stored sorted and once."""

MAX_HYPERPARAMETERS = 64
HYPERPARAMETER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,99}")
Scalar = str | int | float | bool | None
"""A hyperparameter's value: a JSON scalar (string, number, true/false or null)."""


def check_hyperparameters(value: dict[str, Any]) -> dict[str, Any]:
    """Names of at most 100 characters (a letter or _, then letters, digits, _ . -), JSON
    scalars as values (a finite number), at most MAX_HYPERPARAMETERS of them."""
    if len(value) > MAX_HYPERPARAMETERS:
        raise ValueError(f"at most {MAX_HYPERPARAMETERS} hyperparameters")
    for name, item in value.items():
        if not HYPERPARAMETER_NAME.fullmatch(name):
            raise ValueError(f"{name[:100]!r} is not a hyperparameter name (e.g. lr, hidden_width)")
        if item is not None and not isinstance(item, str | int | float | bool):
            raise ValueError(
                f"{name}: a hyperparameter is a JSON scalar (string, number, true/false or "
                f"null), not {type(item).__name__}"
            )
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{name}: {item} is not a finite number")
        if isinstance(item, str) and len(item) > 1000:
            raise ValueError(f"{name}: a string of at most 1000 characters")
    return value


Hyperparameters = Annotated[dict[str, Any], AfterValidator(check_hyperparameters)]
"""Values of the names the training code declares in `HYPERPARAMETERS`, overriding them."""


class GroupRequest(StrictModel):
    """Workers asked of one named resource group, or of a device type with a placement policy.

    `{"name": "cpu-a", "workers": 2}` names the group. `{"device_type": "cpu",
    "workers": 3, "placement": "uniform"}` lets the scheduler choose groups of
    that device type (and `labels`) when it allocates: `uniform` spreads the
    workers over every such group, `resource_state` fills the largest free group first.
    """

    name: str | None = Field(default=None, min_length=1, max_length=64, examples=["cpu-a"])
    device_type: DeviceType | None = None
    workers: int = Field(ge=1, le=1024, examples=[2])
    placement: Literal["uniform", "resource_state"] | None = None
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    speed_factor: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="emulation only: the group computes this fraction as fast (1 = real speed)",
    )
    sharding: Sharding | None = Field(
        default=None,
        description="this group's own `sharding` (see the task's), e.g. `fsdp` on the "
        "group whose workers cannot hold the whole model; default: the task's. `fsdp` needs "
        "2 or more workers in the group (a device_type item: in each group it is placed on)",
    )

    max_local_batch: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="the most samples one worker of this group takes in a step (its memory "
        "cap; a plan sets it from measured memory): the split keeps each of its workers' "
        "shares within it and the guard parks no group when the others could not hold the "
        "global batch without exceeding theirs. Default: no cap. The groups' caps times their "
        "workers must hold global_batch_size, and split_policy `even` must give no worker "
        "more than its cap (a device_type item: each of its workers, whatever group)",
    )

    @field_validator("sharding")
    @classmethod
    def _shards_something(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value == "fsdp" and info.data.get("workers") == 1:
            raise ValueError(
                "'fsdp' needs 2 or more workers in the group: with 1 there is nothing to shard "
                "(give it more workers, or sharding 'none')"
            )
        return value

    @model_validator(mode="after")
    def _one_form(self) -> "GroupRequest":
        if (self.name is None) == (self.device_type is None):
            raise ValueError("give either a group name or a device_type")
        if self.name is not None and (self.placement or self.labels):
            raise ValueError("placement and labels go with device_type, not a group name")
        return self


class TaskCreate(StrictModel):
    """A training task: one code version, trained across the listed resource groups."""

    project_id: int
    code_version_id: int
    name: str = Field(default="", max_length=200)
    resource_groups: list[GroupRequest] = Field(min_length=1, max_length=16)
    epochs: int = Field(default=5, ge=1, le=10_000)
    global_batch_size: int = Field(
        default=64, ge=1, le=1_000_000, description="samples per optimizer step across all workers"
    )
    split_policy: SplitPolicy = Field(
        default="even",
        validate_default=True,  # the even split is checked against each max_local_batch
        description="`weighted`: shares of data and batch follow measured "
        "samples/s, re-balanced online",
    )
    sync_strategy: SyncStrategy = Field(
        default="sync",
        description="cross-group sync: `sync` every step, the group leaders allreducing the "
        "gradient sum and every worker stepping its optimizer replica (exact; for groups of "
        "near-equal speed), `periodic` model averaging every `sync_period` steps, `quorum` once "
        "`quorum` groups reported, `diloco` rounds of `sync_period` steps in which each "
        "group takes local steps scaled to its speed, then an outer Nesterov step (choose it "
        "when a slower pool, or a slow link between pools, would hold a faster one back)",
    )
    sync_period: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="periodic: steps between model averages (default 1); diloco: steps in a "
        f"round (global batches, at least 2; default {DILOCO_PERIOD})",
    )
    quorum: int | None = Field(
        default=None, ge=1, le=16, description="groups a quorum update waits for (default M - 1)"
    )
    max_staleness: int = Field(
        default=2, ge=0, le=1000, description="quorum: oldest gradient version an update may use"
    )
    outer_lr: float | None = Field(
        default=None,
        gt=0.0,
        le=10.0,
        description="diloco: the outer optimizer's learning rate (default 0.7; 1 with no "
        "momentum averages the groups' models)",
    )
    outer_momentum: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="diloco: the outer optimizer's Nesterov momentum, in [0, 1) (default 0.5)",
    )
    diloco_exchange: DilocoExchange = Field(
        default="blocking",
        description="diloco: `blocking` (default) starts each round from the outer update; "
        "`overlapped` starts it at once and takes the update one round late, so no group "
        "waits for the exchange; `async` (two or more groups) has the parameter server apply "
        "each group's update as it arrives, scaled down when stale, so no group waits for "
        "another",
    )
    guard: bool = Field(
        default=True,
        description="sync, periodic and diloco with the weighted split: park a group whose "
        "part in each step costs more than it adds (its update or the exchange outlasts the "
        "others' step), and take it back when it would gain, at each rebalancing check and "
        "at a first check from step 10; each move is an event of the task",
    )
    sharding: Sharding = Field(
        default="none",
        description="how each group holds the model: `none`, every worker all of it; `fsdp` "
        "(FSDP2 within a group), each of a group's W workers holds 1/W of the parameters, "
        "gradients and optimizer state. Choose `fsdp` when the model, its gradients and "
        "optimizer state do not fit one worker's memory. Needs sync_strategy `sync`, "
        "`periodic` or `diloco` (not its `async` exchange) and 2 or more workers in every "
        "sharded group (a device_type request may be placed as several groups: one given 1 "
        "worker fails the task at its start); a group's own `sharding` in resource_groups "
        "wins",
    )
    fsdp_units: list[ClassName] = Field(
        default_factory=list,
        max_length=32,
        title="FSDP units",
        description="fsdp: the module classes wrapped as FSDP units, by class name (e.g. "
        "TransformerBlock); empty: chosen by size",
    )
    fsdp_param_dtype: FsdpParamDtype = Field(
        default="float32",
        title="FSDP compute dtype",
        description="fsdp: the dtype a sharded group computes in; bfloat16 is mixed "
        "precision (for CUDA groups: less memory and time; its gradients are still reduced "
        "and its optimizer stepped in float32, and its agreement checks allow bfloat16's "
        "rounding, a relative distance of 0.05)",
    )
    ps_shards: int = Field(
        default=1,
        ge=1,
        le=MAX_PS_SHARDS,
        title="Parameter-server shards",
        description="sync, periodic and diloco (blocking, overlapped): the parameter server's "
        "processes, each owning a slice of the model (and of diloco's outer optimizer; under "
        "sync, of each step's gradient sum), which every worker exchanges its own part of (an "
        "fsdp group's workers their own rows) with that slice's owner alone (default 1). "
        "Choose 2-4 when "
        "many groups or a large model make the parameter server's link the bottleneck; the "
        "other shards run beside it, on its agent",
    )
    exchange_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of each worker's shard passed to its ring neighbour per epoch",
    )
    checkpoint_every: int | None = Field(
        default=None, ge=1, le=10_000_000, description="also checkpoint every N steps"
    )
    rebalance_every: int = Field(
        default=10,
        ge=0,
        le=10_000_000,
        description="steps between load-balance checks (0: epoch ends; default 10, 0 with "
        "diloco's overlapped or async exchange, where a check would make every group wait)",
    )
    on_nonfinite: Literal["fail", "skip_step"] = Field(
        default="fail",
        description="a non-finite loss or gradient on any worker: `fail` ends "
        "the task naming epoch, step, rank and group; `skip_step` skips that optimizer step "
        "everywhere and counts it in the `skipped_steps` metric",
    )
    on_group_loss: OnGroupLoss | None = Field(
        default=None,
        description="a restart after a group was lost (its agent died, a rank was killed) "
        "when that group cannot take its workers again: `restart` waits for a compatible "
        "group (same device type) with room; `shrink` goes on with the surviving groups from "
        "the last checkpoint, the lost group's share redistributed by their measured rates "
        "and the global batch unchanged (unless a compatible group has room now); `wait` "
        "waits for the task's own groups. Default: `shrink` for a task on several groups, "
        "else `restart`",
    )
    on_disagreement: OnDisagreement = Field(
        default="fail",
        description="a group whose gradient of one fixed batch (before training) differs "
        "from the parameter server's, or whose parameters (`sync` only, every "
        "`agreement_every` steps) differ from the first group's, beyond "
        "`agreement_tolerance`: an alarm naming it, then `fail` ends the task, "
        "`exclude` trains on without it; `off` skips both checks",
    )
    agreement_every: int = Field(
        default=100,
        ge=0,
        le=10_000_000,
        description="`sync`: steps between parameter checksum checks (0: the check before "
        "training only; the other strategies run that check only)",
    )
    agreement_tolerance: AgreementTolerance = Field(
        default_factory=dict,
        max_length=16,
        description="relative L2 distance allowed per device-type pair, e.g. "
        '{"cpu/cuda": 0.001}; defaults: cpu/cpu 0 (bit for bit), any other pair 1e-4',
    )
    step_metrics_every: int | None = Field(
        default=None,
        ge=0,
        le=10_000_000,
        description="steps between two points of the per-step curves (training loss, "
        "samples/s, learning rate; the task's metrics named `step/...`): default about 100 "
        "an epoch (steps per epoch // 100, at least 1); 0: none",
    )
    preprocess: list[PreprocessStep] = Field(
        default_factory=list,
        max_length=16,
        description="per-item steps run where each worker reads its items (statistics "
        "computed once, before training): resize, normalize, augment, tokenize",
    )
    data: DataOptions = Field(
        default_factory=DataOptions,
        description="how each worker reads its shard: `path` streaming (DataLoader) or "
        "memory, `num_workers`, `prefetch_factor`, `persistent_workers`, `pin_memory`",
    )
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="higher runs first; equal priorities run oldest first",
    )
    depends_on: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="tasks that must succeed before this one starts",
    )
    max_restarts: int = Field(
        default=2, ge=0, le=20, description="restarts after an agent or process failure"
    )
    max_runtime_s: int = Field(
        default=DEFAULT_MAX_RUNTIME_S,
        ge=1,
        le=MAX_RUNTIME_S,
        description="wall-clock seconds each attempt may run; beyond it the task FAILS",
    )
    plan_id: int | None = Field(
        default=None,
        description="the plan (POST /api/v1/plans) this task follows: its model predicts the "
        "task's time, so `eta_s` is known before the first step",
    )
    memory_limit_mb: int = Field(
        default=DEFAULT_MEMORY_LIMIT_MB,
        ge=128,
        le=1_048_576,
        description="data memory of each rank process in MiB (torch itself takes about "
        "300); an allocation beyond it FAILS the task",
    )
    tags: Tags = Field(
        default_factory=list,
        description="labels to find and compare runs by (e.g. baseline, lr=3e-4): task lists "
        "filter on them; they can be changed later",
    )
    hyperparameters: Hyperparameters = Field(
        default_factory=dict,
        description="values overriding the defaults the training code declares in "
        '`HYPERPARAMETERS` (e.g. `{"lr": 0.003}`): JSON scalars, each name one it declares',
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "project_id": 1,
                    "code_version_id": 1,
                    "name": "mnist across two groups",
                    "resource_groups": [
                        {"name": "cpu-a", "workers": 2},
                        {"name": "cpu-b", "workers": 1},
                    ],
                    "epochs": 5,
                    "global_batch_size": 64,
                }
            ]
        }
    )

    @model_validator(mode="after")
    def _check(self) -> "TaskCreate":
        names = [g.name for g in self.resource_groups if g.name]
        if len(set(names)) != len(names):
            raise ValueError("resource_groups lists a group twice")
        if self.sync_strategy == "diloco" and "sync_period" not in self.model_fields_set:
            self.sync_period = DILOCO_PERIOD
        if self.diloco_exchange != "blocking" and "rebalance_every" not in self.model_fields_set:
            # A rebalancing check is a collective: every group would wait for the slowest at
            # each one, which is what the overlapped and async exchanges exist to avoid.
            self.rebalance_every = 0
        return self

    @field_validator("on_group_loss")
    @classmethod
    def _shrink_needs_groups(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value == "shrink" and _most_groups(info.data.get("resource_groups") or []) < 2:
            raise ValueError(
                "shrink needs a task on two or more resource groups: with one, no group "
                "would be left to hold the global batch (use 'restart' or 'wait')"
            )
        return value

    def group_loss(self) -> str:
        """`on_group_loss` as given, else `shrink` for a task on several groups, else
        `restart`."""
        if self.on_group_loss is not None:
            return self.on_group_loss
        return "shrink" if _most_groups(self.resource_groups) > 1 else "restart"

    @field_validator("global_batch_size")
    @classmethod
    def _batch_covers_workers(cls, value: int, info: ValidationInfo) -> int:
        groups = info.data.get("resource_groups") or []
        workers = sum(g.workers for g in groups)
        if value < workers:
            raise ValueError(
                f"global_batch_size ({value}) is smaller than the number of workers ({workers})"
            )
        check_local_batch(_capped(groups), value, None)
        return value

    @field_validator("split_policy")
    @classmethod
    def _even_within_caps(cls, value: str, info: ValidationInfo) -> str:
        if "global_batch_size" in info.data:  # checked against a valid batch only
            groups = info.data.get("resource_groups") or []
            check_local_batch(_capped(groups), info.data["global_batch_size"], value)
        return value

    @field_validator("quorum")
    @classmethod
    def _quorum_fits(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        if _strategy(info) not in ("quorum", None):
            raise ValueError("quorum applies to sync_strategy 'quorum' only")
        groups = info.data.get("resource_groups") or []
        most = _most_groups(groups)
        if groups and value > most:
            raise ValueError(f"quorum ({value}) is larger than the number of groups ({most})")
        return value

    @field_validator("sync_strategy", "diloco_exchange")
    @classmethod
    def _sharded_groups_run(cls, value: str, info: ValidationInfo) -> str:
        groups = info.data.get("resource_groups") or []
        own = [i for i, g in enumerate(groups) if g.sharding == "fsdp"]
        if not own:
            return value
        where = f"resource_groups.{own[0]} has sharding 'fsdp'"
        if info.field_name == "sync_strategy" and value not in SHARDED_STRATEGIES:
            allowed = ", ".join(map(repr, SHARDED_STRATEGIES))
            raise ValueError(
                f"{value!r} does not run sharded groups ({where}; its exchange of the workers' "
                f"own rows is not built): use {allowed}, or leave that group's sharding out"
            )
        if (
            info.field_name == "diloco_exchange"
            and value == "async"
            and _strategy(info) == "diloco"
        ):
            raise ValueError(
                f"'async' does not run sharded groups ({where}; a group's rows applied as they "
                "arrive is not built): use 'blocking' or 'overlapped', or leave that group's "
                "sharding out"
            )
        return value

    @field_validator("ps_shards")
    @classmethod
    def _ps_shards_fit(cls, value: int, info: ValidationInfo) -> int:
        strategy = _strategy(info)
        if value > 1 and strategy not in (*PS_SHARDED_STRATEGIES, None):
            allowed = " or ".join(map(repr, PS_SHARDED_STRATEGIES))
            raise ValueError(
                f"ps_shards {value} runs with sync_strategy {allowed} only so far, not "
                f"{strategy!r} (use ps_shards 1)"
            )
        if value > 1 and info.data.get("diloco_exchange") == "async":
            raise ValueError(
                f"ps_shards {value} runs with diloco_exchange 'blocking' and 'overlapped' so "
                "far, not 'async' (use ps_shards 1)"
            )
        return value

    @field_validator("sharding")
    @classmethod
    def _sharding_fits(cls, value: str, info: ValidationInfo) -> str:
        if value != "fsdp":
            return value
        check_sharded_strategy(_strategy(info), info.data.get("diloco_exchange"))
        for i, group in enumerate(info.data.get("resource_groups") or []):
            if group.sharding is None and group.workers == 1:
                raise ValueError(
                    f"'fsdp' needs 2 or more workers in each group, and resource_groups.{i} "
                    f"({group.name or group.device_type}) has 1: there is nothing to shard "
                    "(give it more workers, or its own sharding 'none')"
                )
        return value

    @field_validator("fsdp_units", "fsdp_param_dtype")
    @classmethod
    def _needs_fsdp(cls, value: Any, info: ValidationInfo) -> Any:
        if value in ([], "float32") or not {"sharding", "resource_groups"} <= info.data.keys():
            return value  # the default, or checked against valid settings only
        groups = info.data["resource_groups"]
        if not any((g.sharding or info.data["sharding"]) == "fsdp" for g in groups):
            raise ValueError(
                f"{info.field_name} applies only where a group has sharding 'fsdp' (set "
                "sharding 'fsdp', for the task or a group)"
            )
        return value

    @field_validator("sync_period")
    @classmethod
    def _period_needs_periodic(cls, value: int, info: ValidationInfo) -> int:
        strategy = _strategy(info)
        return value if strategy is None else check_period(value, strategy)

    @field_validator("outer_lr", "outer_momentum", "diloco_exchange")
    @classmethod
    def _outer_needs_diloco(cls, value: Any, info: ValidationInfo) -> Any:
        unset = value is None or (info.field_name == "diloco_exchange" and value == "blocking")
        if not unset and _strategy(info) not in ("diloco", None):
            raise ValueError(f"{info.field_name} applies to sync_strategy 'diloco' only")
        if value == "async" and _most_groups(info.data.get("resource_groups") or []) < 2:
            raise ValueError(
                "diloco_exchange 'async' needs two or more resource groups: with one, every "
                "update is the group's own (use 'blocking' or 'overlapped')"
            )
        return value

    def engine_options(self) -> dict[str, Any]:
        """The training-engine settings stored in the task's spec (see worker.engine.spec)."""
        models = ("preprocess", "data", "trial")  # trial: a plan's trial task only
        keys = ("split_policy", *(key for key in ENGINE_OPTIONS if key not in models))
        options = {key: getattr(self, key) for key in keys}
        options["preprocess"] = [step.model_dump() for step in self.preprocess]
        options["data"] = self.data.model_dump()
        return options

    def limits(self) -> TaskLimits:
        """The per-rank limits stored in the task's spec and enforced by the agents."""
        return TaskLimits(max_runtime_s=self.max_runtime_s, memory_limit_mb=self.memory_limit_mb)


def _strategy(info: ValidationInfo) -> str | None:
    """The task's sync strategy, None when it was refused: the settings that depend on it
    are not checked against it then (its own error says what is wrong)."""
    strategy: str | None = info.data.get("sync_strategy")
    return strategy


def _capped(requested: list[GroupRequest]) -> list[tuple[str, int, int | None]]:
    """Each item as `contracts.plan.check_local_batch` takes it: its label in an error
    (`resource_groups.I (name)`), its workers and its max_local_batch."""
    return [
        (
            f"resource_groups.{i} ({g.name or g.device_type})",
            g.workers,
            g.max_local_batch,
        )
        for i, g in enumerate(requested)
    ]


def _most_groups(requested: list[GroupRequest]) -> int:
    """The most groups a request may be placed on: one per named group, and a device-type
    item on several, at most one per worker."""
    return sum(1 if g.name else g.workers for g in requested)


class TaskUpdate(StrictModel):
    """What may change: a task's tags at any time; its priority and dependencies while it
    is queued."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"priority": 10}, {"depends_on": [3, 4]}, {"tags": ["baseline"]}]
        }
    )

    priority: int | None = Field(default=None, ge=-100, le=100)
    depends_on: list[int] | None = Field(default=None, max_length=64)
    tags: Tags | None = Field(default=None, description="the task's labels, replacing its own")


class TaskRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    project_id: int
    code_version_id: int
    name: str
    tags: list[str] = Field(default_factory=list, description="the task's labels, sorted")
    status: TaskStatus
    status_reason: str
    priority: int
    spec: dict
    progress: float
    epoch: int
    attempt: int = 1
    max_restarts: int = 2
    waiting: bool = False
    master_addr: str | None = Field(default=None, description="parameter server host")
    master_port: int | None = None
    created_at: UtcDateTime
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None
    eta_s: float | None = Field(
        default=None,
        description="seconds to finish, from the pace of this attempt's measured steps "
        "(progress gained since its first report over the time taken); 0 once ended, null "
        "until two progress reports apart",
    )
    predicted_finish_at: UtcDateTime | None = Field(
        default=None, description="when the task is predicted to finish (finished_at once ended)"
    )


class TaskEventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: EventKind = EventKind.STATUS
    from_status: TaskStatus | None
    to_status: TaskStatus
    reason: str
    created_at: UtcDateTime


class AllocationRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    role: NodeRole
    resource_group: str
    rank: int | None
    host: str | None
    last_heartbeat_at: UtcDateTime | None
    created_at: UtcDateTime
    released_at: UtcDateTime | None
    attempt: int = 1


class SubTaskRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    resource_group: str
    group_index: int
    part: int = 0
    first_rank: int
    workers: int
    hosts_parameter_server: bool
    agent_id: int | None = None
    status: SubTaskStatus
    detail: str
    attempt: int = 1


class LogLineRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    attempt: int = 1
    node: str
    seq: int
    time: UtcDateTime
    text: str


class MetricRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int = Field(description="the metric's id, in the order stored: the `after_id` cursor")
    step: int
    epoch: int
    name: str
    value: float | None = Field(description="null when the value was not finite")
    nonfinite: Literal["nan", "inf", "-inf"] | None = Field(
        default=None, description="the value when it was NaN or infinite (JSON has no NaN)"
    )
    rank: int | None
    created_at: UtcDateTime = Field(description="when the API received it")


class WorkerThroughput(BaseModel):
    """One compute worker's latest measurements (None until reported)."""

    rank: int
    group: str
    samples_per_s: float | None = Field(description="re-measured from real step times, per epoch")
    profiled_samples_per_s: float | None = Field(description="measured before training")
    batch_share: float | None = Field(description="fraction of the global batch")
    idle_fraction: float | None = Field(
        default=None,
        description="fraction of the last epoch's step time spent outside compute: waiting for "
        "slower workers, communication, the optimizer step (0 = never waited)",
    )


class GroupThroughput(BaseModel):
    """A resource group's sums over its workers."""

    name: str
    device_type: str
    workers: int
    samples_per_s: float | None
    profiled_samples_per_s: float | None
    batch_share: float | None
    idle_fraction: float | None = Field(default=None, description="mean over the group's workers")


class ThroughputRead(BaseModel):
    """Measured throughput (samples/s) per worker and per group, and the task's own."""

    samples_per_s: float | None = Field(description="task-level, last epoch")
    workers: list[WorkerThroughput]
    groups: list[GroupThroughput]


class CheckpointRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    epoch: int
    step: int
    size_bytes: int
    created_at: UtcDateTime
    sharded_files: int = Field(
        0,
        description="files of the optimizer states its workers wrote beside it, and of the "
        "model's slices where the parameter server's shards wrote it (0: the file holds them "
        "all); its download joins them into one file",
    )
    state_bytes: int = Field(0, description="bytes of those files stored so far")
    complete: bool = Field(
        True,
        description="every file stored: it can be downloaded and resumed from (false while "
        "the files of its state are still arriving)",
    )


class ShardRecordRead(BaseModel):
    """The samples one compute worker took between two checkpoints of an epoch (steps
    `step_from + 1` .. `step_to`, global) in one attempt; `index_hash` is the additive multiset
    hash of their indices; `rebalanced`/`exchanged` how many a rebalance or the neighbour
    exchange moved to it; `host` the host its rank ran on (null if not recorded)."""

    attempt: int
    epoch: int
    step_from: int
    step_to: int
    worker: int
    rank: int
    group_index: int
    group: str
    host: str | None
    samples: int
    index_hash: str
    rebalanced: int
    exchanged: int
    checkpoint_id: int
    kept: bool = Field(
        description="false: a later attempt resumed from an earlier step, so the model does "
        "not hold this record's updates (not counted in the epoch)"
    )


class EpochProvenance(BaseModel):
    """One epoch's records over every attempt that trained it. `exactly_once`: the kept
    records' samples sum to the training set's size (`n_items`) and their hashes to the
    whole set's hash (`set_hash`), so every training sample was trained once, by the workers
    named. `samples`, `index_hash` and `attempts` count kept records only."""

    epoch: int
    n_items: int
    samples: int
    index_hash: str = Field(description="sum of the records' hashes mod 2**64 (16 hex digits)")
    set_hash: str = Field(description="hash of the whole training set")
    exactly_once: bool
    in_progress: bool = Field(
        description="the task's latest epoch, still being trained (not all of it recorded yet)"
    )
    attempts: list[int]
    records: list[ShardRecordRead]


class ProvenanceRead(BaseModel):
    """Which worker (group, host, rank) trained how many samples of each epoch, and which
    were moved by a rebalance or the neighbour exchange. Epochs appear as their checkpoints
    are stored; a checkpoint's records hold the samples since the previous checkpoint."""

    task_id: int
    epochs: list[EpochProvenance]
    earlier_epochs: int = Field(
        default=0,
        description="recorded epochs before those listed (0: all are; the task page lists "
        "the latest only, the REST answer every one)",
    )


class ComparedTask(BaseModel):
    """One task of a comparison: what it is, how it ended, and its final metrics."""

    id: int
    project_id: int
    code_version_id: int
    name: str
    tags: list[str]
    status: TaskStatus
    created_at: UtcDateTime
    started_at: UtcDateTime | None
    finished_at: UtcDateTime | None
    duration_s: float | None = Field(description="seconds from start to finish; null until it ends")
    final_metrics: dict[str, float | None] = Field(
        description="each per-epoch task-wide metric's latest value (the last epoch's), null "
        "if not finite; per-step series (`step/...`) have curves only"
    )


class SpecDifference(BaseModel):
    """A setting that is not the same in every compared task: its dotted path in the spec
    (`data.num_workers`), and its value in each task, in the comparison's order (null:
    not set)."""

    field: str
    values: list[Any]


class CurvePoint(BaseModel):
    step: int = Field(description="optimizer steps since the start of training")
    epoch: int
    value: float | None = Field(description="null when the value was not finite")
    seconds: float | None = Field(
        description="seconds from the task's start to when the API received the value"
    )


class Curve(BaseModel):
    """One task's points of the compared metric, oldest first (evenly thinned to at most
    `MAX_CURVE_POINTS`, the last point kept)."""

    task_id: int
    points: list[CurvePoint]


class TaskComparison(BaseModel):
    """Tasks side by side (`GET /tasks/compare`)."""

    tasks: list[ComparedTask]
    differences: list[SpecDifference] = Field(
        description="the spec fields that differ, with the code version and the groups"
    )
    metrics: list[str] = Field(description="the task-wide metrics any compared task reported")
    metric: str | None = Field(description="the metric of `curves`, as asked")
    curves: list[Curve] = Field(description="one per task, in order; empty without `metric`")
