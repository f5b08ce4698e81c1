"""A hyperparameter sweep: its search space, its planned trials and how far it has got.

Its trials are tasks (`Task.sweep_id`), submitted in the order of `trials`.
"""

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class SweepStatus(enum.StrEnum):
    RUNNING = "RUNNING"  # trials are submitted as others end
    FINISHED = "FINISHED"  # every planned trial was submitted and has ended
    CANCELLED = "CANCELLED"  # cancelled by a user: its unfinished trials were cancelled
    FAILED = "FAILED"  # a trial could not be submitted (`reason` says why)


class Sweep(Base):
    """`base` is the task every trial runs (a `TaskCreate` body without project and code
    version; its `hyperparameters` fixed for every trial); `space` the validated search
    space (name -> `{"values": [...]}` or `{"min", "max", "scale", "integer"}`); `trials`
    the planned trials' hyperparameters, in submission order; `submitted` how many of them
    have been submitted (trial `i` is `trials[i]`). `metric` and `goal` (`min` or `max`)
    name the objective, an epoch metric of the trials; `stopping` the early-stopping rule's
    settings (`{"rule": "median" | "none", "min_trials", "min_epochs"}`); `plan_id` the
    plan whose performance model places the trials (None: the base task's groups)."""

    __tablename__ = "sweep"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("project.id", ondelete="CASCADE"), index=True
    )
    code_version_id: Mapped[int] = mapped_column(ForeignKey("code_version.id"))
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=SweepStatus.RUNNING, index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    algorithm: Mapped[str] = mapped_column(String(16))
    space: Mapped[dict[str, Any]] = mapped_column(JSON)
    base: Mapped[dict[str, Any]] = mapped_column(JSON)
    trials: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    submitted: Mapped[int] = mapped_column(default=0)
    parallel: Mapped[int]
    metric: Mapped[str] = mapped_column(String(100))
    goal: Mapped[str] = mapped_column(String(8))
    seed: Mapped[int] = mapped_column(default=0)
    stopping: Mapped[dict[str, Any]] = mapped_column(JSON)
    # No foreign key: plan -> task -> sweep -> plan would be a cycle; a deleted plan's id
    # finds no plan, and the trials then run on the base task's groups.
    plan_id: Mapped[int | None] = mapped_column(default=None)
    created_by_id: Mapped[int | None] = mapped_column(
        ForeignKey("user.id", ondelete="SET NULL"), default=None
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
