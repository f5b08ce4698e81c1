"""The one accessor of `Task.spec`: read it as a `TaskSpec`, write a `TaskSpec` back.

The column holds `TaskSpec.stored()` (only the keys given), so the stored JSON and the
API's `TaskRead.spec` keep their shape.
"""

from typing import Any

from backend.tasks.models import Task
from contracts.task_spec import TaskSpec


def parse_spec(stored: dict[str, Any]) -> TaskSpec:
    """A stored spec (the column's value, e.g. selected on its own) as a `TaskSpec`."""
    return TaskSpec.model_validate(stored)


def read_spec(task: Task) -> TaskSpec:
    """The task's spec."""
    return parse_spec(task.spec)


def write_spec(task: Task, spec: TaskSpec) -> None:
    """Store `spec` as the task's spec."""
    task.spec = spec.stored()
