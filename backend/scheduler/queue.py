"""Queue reading: the head of the queue a scheduling decision looks at.

Priority high first, then age; tasks waiting on dependencies are not in the
queue. A decision reads at most `WINDOW` tasks through the index `ix_task_queue`,
never the whole queue, and decodes a task's spec only when it gets to it.
"""

from dataclasses import dataclass
from functools import cached_property

from sqlalchemy import Text, bindparam, cast, select, text
from sqlalchemy.orm import Session

from backend.scheduler import placement
from backend.tasks.models import Task
from contracts.task_spec import TaskSpec

WINDOW = 32  # queued tasks a decision looks at, at most
QUEUE_FILTER = text("task.status = 'QUEUED' AND NOT task.waiting")  # matches ix_task_queue


@dataclass(frozen=True)
class Queued:
    """What a decision reads of a queued task (not the whole row)."""

    id: int
    raw_spec: str  # decoded when the decision gets to this task (usually only the first)
    attempt: int

    @cached_property
    def spec(self) -> TaskSpec:
        return TaskSpec.model_validate_json(self.raw_spec)

    @property
    def previous(self) -> placement.Plan | None:
        """Where the last attempt ran (for a restart), else None."""
        return list(self.spec.groups) if self.attempt > 1 else None


HEAD = (
    select(Task.id, cast(Task.spec, Text), Task.attempt)
    .where(QUEUE_FILTER)
    .order_by(Task.priority.desc(), Task.id)
    .limit(bindparam("limit"))
)


def queue_head(session: Session, *, limit: int = WINDOW) -> list[Queued]:
    """The first `limit` runnable queued tasks: priority high first, then oldest."""
    rows = session.connection().execute(HEAD, {"limit": limit})
    return [Queued(*row) for row in rows]
