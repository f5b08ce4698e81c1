"""A plan: its request, its trial task, the trial's timings and the model fitted from them."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base, utcnow


class Plan(Base):
    """`request` is the validated `PlanCreate` (JSON); `trial_task_id` the trial task (a real
    task on the candidate groups, `null` once that task is deleted); `trial` the
    `contracts.trial.TrialResult` its parameter server reported and `model` the
    `backend.plans.performance.PerformanceModel` fitted from it (both null until then);
    `error` why the model could not be fitted."""

    __tablename__ = "plan"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("project.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(200))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    trial_task_id: Mapped[int | None] = mapped_column(
        ForeignKey("task.id", ondelete="SET NULL"), default=None, index=True
    )
    trial: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    model: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    error: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
