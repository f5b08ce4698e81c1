"""Every table, imported in one place for Alembic (`migrations/env.py`) and the migration
drift test: each domain keeps its own models; this module, outside `core/`, gathers them."""

from backend.agents.models import Agent
from backend.audit.models import AuditEvent
from backend.auth.models import ApiToken, User, WebSession
from backend.plans.models import Plan
from backend.projects.models import CodeVersion, Project, ProjectMember
from backend.resource_groups.models import ResourceGroup
from backend.sweeps.models import Sweep
from backend.tasks.models import (
    Allocation,
    Checkpoint,
    LogLine,
    Metric,
    SubTask,
    Task,
    TaskDependency,
    TaskEvent,
)

__all__ = [
    "Agent",
    "Allocation",
    "ApiToken",
    "AuditEvent",
    "Checkpoint",
    "CodeVersion",
    "LogLine",
    "Metric",
    "Plan",
    "Project",
    "ProjectMember",
    "ResourceGroup",
    "SubTask",
    "Sweep",
    "Task",
    "TaskDependency",
    "TaskEvent",
    "User",
    "WebSession",
]
