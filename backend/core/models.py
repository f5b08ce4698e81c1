"""Every table, imported in one place for Alembic and the app."""

from backend.agents.models import Agent
from backend.projects.models import CodeVersion, Project
from backend.resource_groups.models import ResourceGroup
from backend.tasks.models import (
    Allocation,
    Checkpoint,
    LogLine,
    Metric,
    SubTask,
    Task,
    TaskEvent,
)

__all__ = [
    "Agent", "Allocation", "Checkpoint", "CodeVersion", "LogLine", "Metric",
    "Project", "ResourceGroup", "SubTask", "Task", "TaskEvent",
]
