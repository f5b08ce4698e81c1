"""A task's stored spec (`Task.spec`): what was asked (`request`), where it was placed
(`groups`), the training settings and engine options, the per-rank limits and the tasks it
waits on.

The stored JSON is this model dumped with `exclude_unset`: a key is stored only when it was
given, so rows written before a field existed (e.g. without `request`) read back and are
written again unchanged. The backend reads and writes it through one accessor
(`backend.tasks.spec`).
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.data import DataOptions
from contracts.payload import TaskLimits
from contracts.plan import DeviceType, GroupPlan, OnGroupLoss, Sharding, SplitPolicy
from contracts.preprocess import PreprocessStep
from contracts.trial import TrialOptions

Placement = Literal["uniform", "resource_state"]

# The engine options a task's spec carries (see worker.engine.spec), in stored order.
ENGINE_OPTIONS = (
    "sync_strategy",
    "sync_period",
    "quorum",
    "max_staleness",
    "outer_lr",
    "outer_momentum",
    "diloco_exchange",
    "guard",
    "sharding",
    "fsdp_units",
    "fsdp_param_dtype",
    "ps_shards",
    "exchange_fraction",
    "checkpoint_every",
    "rebalance_every",
    "preprocess",
    "on_nonfinite",
    "on_disagreement",
    "agreement_every",
    "agreement_tolerance",
    "step_metrics_every",
    "data",
    "trial",
)


class RequestItem(BaseModel):
    """One item of the request as stored: a named group (`name`, `device_type`, `workers`)
    or a device type the scheduler places (`device_type`, `workers`, `placement`,
    `labels`); `speed_factor` only when it is not 1 (emulation); `sharding` and
    `max_local_batch` only when the item sets its own."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    device_type: DeviceType | None = None
    workers: int = Field(ge=1)
    placement: Placement | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    speed_factor: float = Field(default=1.0, gt=0.0, le=1.0)
    sharding: Sharding | None = None
    max_local_batch: int | None = Field(default=None, ge=1)


class TaskSpec(BaseModel):
    """The stored spec of a task. `groups` is empty until a device-type request is placed;
    `request` is absent from tasks submitted before the request form (their `groups` are
    the request)."""

    model_config = ConfigDict(extra="allow")

    epochs: int | None = None
    global_batch_size: int | None = None
    seed: int = 0
    groups: list[GroupPlan] = Field(default_factory=list)
    request: list[RequestItem] = Field(default_factory=list)
    split_policy: SplitPolicy = "even"
    sync_strategy: str | None = None
    sync_period: int | None = None
    quorum: int | None = None
    max_staleness: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    diloco_exchange: str | None = None
    guard: bool | None = None
    sharding: Sharding | None = None
    fsdp_units: list[str] | None = None
    fsdp_param_dtype: str | None = None
    ps_shards: int | None = None
    exchange_fraction: float | None = None
    checkpoint_every: int | None = None
    rebalance_every: int | None = None
    on_nonfinite: str | None = None
    on_disagreement: str | None = None
    agreement_every: int | None = None
    agreement_tolerance: dict[str, float] | None = None
    step_metrics_every: int | None = None
    preprocess: list[PreprocessStep] | None = None
    data: DataOptions | None = None
    trial: TrialOptions | None = None
    limits: TaskLimits | None = None
    depends_on: list[int] = Field(default_factory=list)
    on_group_loss: OnGroupLoss = "restart"
    plan_id: int | None = None  # the plan the task was submitted from
    predicted_s: float | None = None  # its model's seconds from start to finish
    # Overrides of the training code's declared `HYPERPARAMETERS` (name -> JSON scalar);
    # absent when the task sets none (worker.engine.contract.apply_hyperparameters).
    hyperparameters: dict[str, str | int | float | bool | None] | None = None

    def stored(self) -> dict[str, object]:
        """The JSON stored in `Task.spec`: only the keys that were given."""
        return self.model_dump(mode="json", exclude_unset=True)

    def requested(self) -> list[RequestItem]:
        """The request items (tasks from before the request form: their placed groups)."""
        if self.request:
            return list(self.request)
        return [RequestItem.model_validate(g.model_dump(exclude_unset=True)) for g in self.groups]

    def named_groups(self) -> set[str]:
        """Every group the spec names, in its request or its placement."""
        return {item.name for item in self.request if item.name} | {
            group.name for group in self.groups
        }

    def speed_factor(self, group: GroupPlan) -> float:
        """A placed group's emulated speed factor: its own if stored, else from the request
        item naming it, else from a device-type item of its device type, else 1.0 (e.g.
        after a move to another group)."""
        if "speed_factor" in group.model_fields_set:
            return group.speed_factor
        for item in self.request:
            if item.name == group.name:
                return item.speed_factor
        for item in self.request:
            if not item.name and item.device_type == group.device_type:
                return item.speed_factor
        return 1.0

    def sharding_of(self, group: GroupPlan) -> Sharding | None:
        """A placed group's own sharding: its own if stored, else that of the request item
        naming it (None if that item sets none), else of a device-type item of its device
        type; None: the task's."""
        own: Sharding | None = self._own(group, "sharding")
        return own

    def max_local_batch_of(self, group: GroupPlan) -> int | None:
        """A placed group's cap on each worker's samples a step: its own if stored, else that
        of the request item naming it, else of a device-type item of its device type; None:
        no cap (also after a move to a group the request does not name)."""
        own: int | None = self._own(group, "max_local_batch")
        return own

    def _own(self, group: GroupPlan, setting: str) -> Any:
        """A placed group's own ``setting``: the group's if stored, else the request item's
        naming it (None if that item sets none), else a device-type item's of its type."""
        if getattr(group, setting) is not None:
            return getattr(group, setting)
        for item in self.request:
            if item.name == group.name:
                return getattr(item, setting)
        for item in self.request:
            if not item.name and item.device_type == group.device_type:
                return getattr(item, setting)
        return None

    def engine_options(self) -> dict[str, object]:
        """The engine options that are set, and the task's hyperparameters when it sets
        any; a quorum above the placed groups means all groups."""
        dumped = self.model_dump(mode="json", include=set(ENGINE_OPTIONS))
        options = {k: dumped[k] for k in ENGINE_OPTIONS if dumped.get(k) is not None}
        if self.quorum is not None:
            options["quorum"] = min(self.quorum, len(self.groups))
        if self.hyperparameters:
            options["hyperparameters"] = dict(self.hyperparameters)
        return options
