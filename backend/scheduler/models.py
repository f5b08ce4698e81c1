"""Dependencies between tasks: a task starts only after each of its `depends_on` succeeded."""

from sqlalchemy import ForeignKey
from sqlalchemy.orm import Mapped, mapped_column

from backend.core.db import Base


class TaskDependency(Base):
    """`task_id` waits for `depends_on_id` to succeed (and fails if it does not)."""

    __tablename__ = "task_dependency"

    task_id: Mapped[int] = mapped_column(
        ForeignKey("task.id", ondelete="CASCADE"), primary_key=True
    )
    depends_on_id: Mapped[int] = mapped_column(
        ForeignKey("task.id", ondelete="CASCADE"), primary_key=True, index=True
    )
