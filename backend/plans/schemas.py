"""A plan's request and answer bodies."""

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from backend.core.schemas import UtcDateTime
from backend.tasks.schemas import Hyperparameters
from contracts.payload import DEFAULT_MEMORY_LIMIT_MB
from contracts.plan import DILOCO_PERIOD, SplitPolicy, SyncStrategy, check_period
from contracts.strict import StrictModel

PlanStatus = Literal["trial", "ready", "failed", "cancelled"]


class CandidateGroup(StrictModel):
    """A resource group the plan may use, with the most workers it may take there."""

    name: str = Field(min_length=1, max_length=64, examples=["cpu-a"])
    workers: int = Field(ge=1, le=1024, examples=[2])


class PlanCreate(StrictModel):
    """A task to plan: its code version, the candidate groups (a trial runs on all of them
    at once), the global batch and epochs, the sync strategy, and optionally a deadline."""

    project_id: int
    code_version_id: int
    name: str = Field(default="", max_length=200)
    resource_groups: list[CandidateGroup] = Field(
        min_length=1,
        max_length=8,
        description="candidate groups (at most 8: every subset is predicted)",
    )
    global_batch_size: int = Field(default=64, ge=1, le=1_000_000)
    epochs: int = Field(default=5, ge=1, le=10_000)
    sync_strategy: SyncStrategy = "sync"
    sync_period: int = Field(default=1, ge=1, le=10_000)
    quorum: int | None = Field(default=None, ge=1, le=16)
    split_policies: list[SplitPolicy] = Field(
        default=["even", "weighted"], min_length=1, max_length=2
    )
    deadline: UtcDateTime | None = Field(
        default=None,
        description="when the task must have finished (UTC): the plan names the "
        "fewest workers predicted to make it",
    )
    trial_steps: int = Field(
        default=5,
        ge=1,
        le=20,
        description="timed steps per batch size (the trial's collectives wait for the "
        "slowest group's timing, within the ranks' collective timeout)",
    )
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    memory_limit_mb: int = Field(
        default=DEFAULT_MEMORY_LIMIT_MB,
        ge=128,
        le=1_048_576,
        description="data memory each rank of the planned task may use, in MiB (the task's "
        "`memory_limit_mb`): with each CPU group's memory per worker, what the plan fits the "
        "model into, whole or sharded, capping a group's batch share where needed",
    )
    hyperparameters: Hyperparameters = Field(
        default_factory=dict,
        description="the planned task's hyperparameters (as the task's: names the training "
        'code declares, e.g. `{"hidden": 512}`), so that the trial times the model they build',
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "project_id": 1,
                    "code_version_id": 1,
                    "resource_groups": [
                        {"name": "cpu-a", "workers": 2},
                        {"name": "cpu-b", "workers": 1},
                    ],
                    "global_batch_size": 64,
                    "epochs": 5,
                }
            ]
        }
    )

    @field_validator("resource_groups")
    @classmethod
    def _distinct(cls, value: list[CandidateGroup]) -> list[CandidateGroup]:
        names = [g.name for g in value]
        if len(set(names)) != len(names):
            raise ValueError("lists a group twice")
        return value

    @field_validator("deadline")
    @classmethod
    def _in_future(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)  # a time without a zone is UTC, as the API's
        if value is not None and value <= datetime.now(UTC):
            raise ValueError("is in the past: give a time to come (UTC)")
        return value

    @field_validator("global_batch_size")
    @classmethod
    def _batch_covers_a_group(cls, value: int, info: ValidationInfo) -> int:
        groups = info.data.get("resource_groups") or []
        smallest = min((g.workers for g in groups), default=1)
        if value < smallest:
            raise ValueError(
                f"is smaller than the workers of every candidate group (fewest: {smallest})"
            )
        return value

    @field_validator("sync_period")
    @classmethod
    def _period_needs_periodic(cls, value: int, info: ValidationInfo) -> int:
        return check_period(value, info.data.get("sync_strategy"))

    @model_validator(mode="after")
    def _diloco_period(self) -> "PlanCreate":
        if self.sync_strategy == "diloco" and "sync_period" not in self.model_fields_set:
            self.sync_period = DILOCO_PERIOD
        return self

    @field_validator("quorum")
    @classmethod
    def _quorum_needs_quorum(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("sync_strategy") != "quorum":
            raise ValueError("applies to sync_strategy 'quorum' only")
        return value


class PredictionRead(BaseModel):
    """A task's predicted times on `workers` (group -> workers) with `split_policy`, in
    seconds: one step, one epoch (its steps), and `finish_s` (from the ranks' start to the
    last checkpoint: `start_s`, then every epoch's steps and its end, `epoch_end_s`:
    validation, the model's transfers and the checkpoint); per group the local batch per
    worker and the step's compute seconds; the cross-group exchange per step; groups the
    split gives no samples (`idle`); per group how it holds the model (`sharding`: `none` or
    `fsdp`), the most samples a step one of its workers may take (`max_local_batch`: its
    memory's cap, null for none), a worker's predicted peak memory in MiB at its share
    (`memory_mb`, null where the trial did not measure it) and what it may hold
    (`memory_limit_mb`, null where not known)."""

    workers: dict[str, int]
    split_policy: SplitPolicy
    step_s: float
    epoch_s: float
    finish_s: float
    start_s: float = 0.0
    epoch_end_s: float = 0.0
    samples_per_s: float
    exchange_s: float
    local_batch: dict[str, float]
    compute_s: dict[str, float]
    idle: list[str]
    sharding: dict[str, str] = Field(default_factory=dict)
    max_local_batch: dict[str, int | None] = Field(default_factory=dict)
    memory_mb: dict[str, float | None] = Field(default_factory=dict)
    memory_limit_mb: dict[str, float | None] = Field(default_factory=dict)


class PlanRead(BaseModel):
    """A plan. `status`: `trial` while its trial task runs, `ready` once the model is fitted,
    `failed` (`error` says why) or `cancelled`. When ready: every subset's prediction
    (`options`, fastest first), the recommendation (`best`), each candidate's marginal gain
    in seconds of time to finish (`marginal_gain_s`: what leaving a group of `best` out would
    cost, or what adding one left out would save, negative when it would cost; null where a
    group cannot be left out or added), why each
    left-out group is left out, and for a deadline the fewest workers that meet it
    (`for_deadline`, null if none do). `task_request` is what "Use this plan" submits."""

    id: int
    project_id: int
    name: str
    status: PlanStatus
    error: str = ""
    request: dict
    trial_task_id: int | None
    created_at: UtcDateTime
    options: list[PredictionRead] = Field(default_factory=list)
    best: PredictionRead | None = None
    marginal_gain_s: dict[str, float | None] = Field(default_factory=dict)
    left_out: dict[str, str] = Field(default_factory=dict)
    deadline: UtcDateTime | None = None
    for_deadline: PredictionRead | None = None
    task_request: dict | None = None
