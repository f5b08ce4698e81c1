"""Every table, imported in one place for Alembic and the app."""

from backend.agents.models import Agent
from backend.audit.models import AuditEvent
from backend.auth.models import ApiToken, User, WebSession
from backend.projects.models import CodeVersion, Project, ProjectMember
from backend.resource_groups.models import ResourceGroup
from backend.scheduler.models import TaskDependency
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
    "Agent", "Allocation", "ApiToken", "AuditEvent", "Checkpoint", "CodeVersion", "LogLine",
    "Metric", "Project", "ProjectMember", "ResourceGroup", "SubTask", "Task", "TaskDependency",
    "TaskEvent", "User", "WebSession",
]
