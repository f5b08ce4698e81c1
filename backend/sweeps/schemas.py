"""Request and response bodies of hyperparameter sweeps (`/api/v1/sweeps`)."""

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from backend.core.schemas import UtcDateTime
from backend.sweeps.space import grid_size
from backend.sweeps.stopping import DEFAULT_MIN_EPOCHS, DEFAULT_MIN_TRIALS
from backend.tasks.schemas import HYPERPARAMETER_NAME, check_hyperparameters
from contracts.strict import StrictModel

MAX_TRIALS = 1000
MAX_PARAMETERS = 16


class ParameterSpace(StrictModel):
    """One hyperparameter's search space: `values` to choose from (grid or random), or,
    for random search, a range `min` .. `max` on a `linear` or `log` scale (`integer`:
    rounded to whole numbers)."""

    values: list[Any] | None = Field(default=None, max_length=MAX_TRIALS)
    min: float | None = None
    max: float | None = None
    scale: Literal["linear", "log"] = "linear"
    integer: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> "ParameterSpace":
        ranged = self.min is not None or self.max is not None
        if self.values is not None:
            if ranged:
                raise ValueError("give either values or a range (min, max), not both")
            if not self.values:
                raise ValueError("no values: list at least one")
            for index, value in enumerate(self.values):
                try:
                    check_hyperparameters({"value": value})
                except ValueError as exc:
                    raise ValueError(f"values.{index}: {exc}".replace("value: ", "")) from None
            return self
        if self.min is None or self.max is None:
            raise ValueError("no values: give a list of values, or a range with min and max")
        if not (math.isfinite(self.min) and math.isfinite(self.max)):
            raise ValueError("min and max must be finite numbers")
        if self.min >= self.max:
            raise ValueError(f"min {self.min:g} must be below max {self.max:g}")
        if self.scale == "log" and self.min <= 0:
            raise ValueError("a log scale needs min > 0")
        if self.integer and math.floor(self.max) < math.ceil(self.min):
            raise ValueError(f"no whole number between {self.min:g} and {self.max:g}")
        return self

    def stored(self) -> dict[str, Any]:
        if self.values is not None:
            return {"values": list(self.values)}
        return {"min": self.min, "max": self.max, "scale": self.scale, "integer": self.integer}


class SweepCreate(StrictModel):
    """A hyperparameter search: trials of one code version, each the `task` with some
    hyperparameters set, at most `parallel` at once, judged by one epoch metric."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "project_id": 1,
                    "code_version_id": 1,
                    "name": "lr and width",
                    "task": {
                        "resource_groups": [{"name": "cpu-a", "workers": 2}],
                        "epochs": 3,
                        "global_batch_size": 64,
                    },
                    "algorithm": "random",
                    "space": {
                        "lr": {"min": 1e-4, "max": 1e-2, "scale": "log"},
                        "hidden": {"values": [32, 64, 128]},
                    },
                    "trials": 8,
                    "parallel": 2,
                    "metric": "val_loss",
                    "goal": "min",
                    "seed": 0,
                }
            ]
        }
    )

    project_id: int
    code_version_id: int
    name: str = Field(default="", max_length=200)
    task: dict[str, Any] = Field(
        description="the task each trial runs: a `POST /api/v1/tasks` body without "
        "project_id and code_version_id (resource_groups, epochs, global_batch_size, ...)",
    )
    algorithm: Literal["grid", "random"] = Field(
        default="grid",
        description="`grid`: every combination of the listed values, in order; `random`: "
        "`trials` draws (values uniformly, ranges on their scale) seeded by `seed`",
    )
    space: dict[str, ParameterSpace] = Field(
        description='hyperparameter name -> `{"values": [...]}` or (random) `{"min", '
        '"max", "scale": "linear" | "log", "integer"}`; a bare list means values',
    )
    trials: int | None = Field(
        default=None,
        ge=1,
        le=MAX_TRIALS,
        validate_default=True,
        description="how many trials (grid: default every combination, at most that many, "
        f"and a grid of more than {MAX_TRIALS} combinations needs it; random: default 10)",
    )
    parallel: int = Field(default=2, ge=1, le=64, description="trials running at once, at most")
    metric: str = Field(
        default="val_loss",
        min_length=1,
        max_length=100,
        description="the epoch metric to optimise (val_loss, val_accuracy, train_loss, ...)",
    )
    goal: Literal["min", "max"] = "min"
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="random search's seed")
    early_stopping: Literal["median", "none"] = Field(
        default="median",
        description="`median`: stop a running trial whose best objective is worse than the "
        "median of the other trials' running averages at its epoch (Google Vizier's rule)",
    )
    min_trials: int = Field(
        default=DEFAULT_MIN_TRIALS,
        ge=1,
        le=MAX_TRIALS,
        description="median rule: other trials that must have reached the epoch first",
    )
    min_epochs: int = Field(
        default=DEFAULT_MIN_EPOCHS,
        ge=1,
        le=10_000,
        description="median rule: epochs a trial reports before it may be stopped",
    )
    plan_id: int | None = Field(
        default=None,
        description="the plan whose performance model places the trials (a fitted plan of "
        "the project timing the task's sync strategy); none (the default): every trial runs "
        "on the task's own groups",
    )

    @field_validator("space", mode="before")
    @classmethod
    def _lists_are_values(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"values": v} if isinstance(v, list) else v for k, v in value.items()}
        return value

    @field_validator("space")
    @classmethod
    def _names(cls, value: dict[str, ParameterSpace]) -> dict[str, ParameterSpace]:
        if not value:
            raise ValueError("no hyperparameters: name at least one to search")
        if len(value) > MAX_PARAMETERS:
            raise ValueError(f"at most {MAX_PARAMETERS} hyperparameters")
        for name in value:
            if not HYPERPARAMETER_NAME.fullmatch(name):
                raise ValueError(f"{name[:100]!r} is not a hyperparameter name")
        return value

    @field_validator("trials")
    @classmethod
    def _bounded(cls, value: int | None, info: ValidationInfo) -> int | None:
        """A grid without `trials` runs every combination: at most MAX_TRIALS of them."""
        chosen = info.data.get("space")
        if value is None and info.data.get("algorithm") == "grid" and chosen:
            size = grid_size({name: item.stored() for name, item in chosen.items()})
            if size > MAX_TRIALS:
                raise ValueError(
                    f"the grid has {size} combinations; at most {MAX_TRIALS}, or give trials"
                )
        return value


class SweepRead(BaseModel):
    """A sweep as listed: its settings and how far it has got."""

    id: int
    project_id: int
    code_version_id: int
    name: str
    status: str
    reason: str
    algorithm: str
    space: dict[str, Any]
    task: dict[str, Any] = Field(description="the task each trial runs")
    planned: int = Field(description="trials planned")
    submitted: int = Field(description="trials submitted so far")
    parallel: int
    metric: str
    goal: str
    seed: int
    stopping: dict[str, Any]
    plan_id: int | None
    created_at: UtcDateTime
    finished_at: UtcDateTime | None


class TrialRead(BaseModel):
    """One trial: its task, the hyperparameters it tried, its objective (the best value of
    the sweep's metric over its epochs) and that metric at each epoch."""

    index: int = Field(description="the trial's number in the sweep, from 1")
    task_id: int
    name: str
    status: str
    status_reason: str
    hyperparameters: dict[str, Any]
    groups: list[str] = Field(description="the groups it runs on")
    objective: float | None
    epochs: int = Field(description="epochs it reported the metric for")
    curve: dict[int, float] = Field(description="the metric at each epoch")
    stopped_early: bool = Field(description="cancelled by the median stopping rule")


class SweepDetail(SweepRead):
    """A sweep with its trials (in submission order), the best one, and the hyperparameters
    of the trials still to submit."""

    trials: list[TrialRead]
    best: TrialRead | None
    pending: list[dict[str, Any]]
