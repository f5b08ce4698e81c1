"""What each portal page shows, gathered through the domain services (no queries here)."""

import math
from collections import Counter
from typing import Any

from sqlalchemy.orm import Session

from backend.agents import service as agents
from backend.agents.models import Agent
from backend.core.db import utcnow
from backend.projects import service as projects
from backend.projects.code import list_examples
from backend.projects.models import Project
from backend.resource_groups import service as groups
from backend.tasks import service as tasks
from backend.tasks.models import Task
from backend.web.forms import SPLIT_POLICIES, FieldErrors, ProjectForm, TaskForm

TASK_LIST_LIMIT = 100
PROJECT_NAME_LIMIT = 500


def tasks_page(session: Session) -> dict[str, Any]:
    """The newest tasks with the name of each one's project."""
    names = {p.id: p.name for p in projects.list_all(session, limit=PROJECT_NAME_LIMIT)}
    return {
        "tasks": tasks.list_tasks(session, limit=TASK_LIST_LIMIT),
        "project_names": names,
        "task_limit": TASK_LIST_LIMIT,
    }


def projects_page(
    session: Session, form: ProjectForm | None = None, errors: FieldErrors | None = None
) -> dict[str, Any]:
    """Every project, and the create-project form as entered."""
    return {
        "projects": projects.list_all(session, limit=PROJECT_NAME_LIMIT),
        "form": form or ProjectForm(),
        "errors": errors or {},
    }


def group_rows(session: Session, form: TaskForm) -> list[dict[str, Any]]:
    """One submission-form row per resource group: its capacity, free and online workers."""
    return [
        {
            "name": g.name,
            "device_type": g.device_type,
            "capacity": g.capacity,
            "free": max(0, g.capacity - g.allocated_workers),
            "online_workers": g.online_workers,
            "agents_online": g.agents_online,
            "workers": form.workers_of(g.name),
        }
        for g in groups.list_all(session)
    ]


def project_page(
    session: Session,
    project: Project,
    *,
    form: TaskForm | None = None,
    errors: FieldErrors | None = None,
    example: str = "",
) -> dict[str, Any]:
    """A project's code versions and tasks, and the task submission form as entered."""
    form = form or TaskForm()
    versions = projects.list_versions(session, project_id=project.id)
    if not form.code_version_id and versions:
        form = form.model_copy(update={"code_version_id": str(versions[0].id)})
    return {
        "project": project,
        "versions": versions,
        "examples": list_examples(),
        "example": example,
        "tasks": tasks.list_tasks(session, project_id=project.id),
        "groups": group_rows(session, form),
        "form": form,
        "errors": errors or {},
        "split_policies": SPLIT_POLICIES,
    }


def spec_summary(spec: dict[str, Any]) -> dict[str, Any]:
    """The task spec for display: `groups` as `name × workers` strings, total workers."""
    plans = spec.get("groups", [])
    return {
        "groups": [f"{g['name']} × {g['workers']}" for g in plans],
        "workers": sum(g["workers"] for g in plans),
        "epochs": spec.get("epochs"),
        "global_batch_size": spec.get("global_batch_size"),
        "split_policy": spec.get("split_policy", "even"),
        "seed": spec.get("seed", 0),
    }


def log_nodes(spec: dict[str, Any]) -> list[str]:
    """Node labels of the task's logs: `ps` (rank 0), then `rank-1` … `rank-W`."""
    workers = sum(g["workers"] for g in spec.get("groups", []))
    return ["ps", *(f"rank-{rank}" for rank in range(1, workers + 1))]


def epochs_done(task: Task) -> int:
    """Whole epochs finished, from the task's 0..1 progress."""
    return math.floor(task.progress * task.spec.get("epochs", 0) + 1e-9)


def task_page(session: Session, task: Task) -> dict[str, Any]:
    """A task with its project, code version, timeline, sub-tasks, nodes and checkpoints."""
    return {
        "task": task,
        "terminal": task.status.terminal,
        "project": projects.get(session, project_id=task.project_id),
        "version": projects.get_version(session, version_id=task.code_version_id),
        "events": tasks.events(session, task_id=task.id),
        "sub_tasks": tasks.sub_tasks(session, task_id=task.id),
        "allocations": tasks.allocations(session, task_id=task.id),
        "checkpoints": tasks.checkpoints(session, task_id=task.id),
        "spec": spec_summary(task.spec),
        "nodes": log_nodes(task.spec),
        "epochs_done": epochs_done(task),
    }


def hardware_summary(hardware: dict[str, Any]) -> str:
    """An agent's reported hardware in a few words, e.g. `8 cores · 15.5 GiB · 2× A100`."""
    parts = []
    if hardware.get("cpu_cores"):
        parts.append(f"{hardware['cpu_cores']} cores")
    if hardware.get("memory_bytes"):
        parts.append(f"{hardware['memory_bytes'] / 2**30:.1f} GiB")
    devices = Counter(hardware.get("cuda_devices") or [])
    parts.extend(f"{count}× {name}" for name, count in devices.items())
    if hardware.get("torch"):
        parts.append(f"torch {hardware['torch']}")
    return " · ".join(parts) or "—"


def _agent_row(agent: Agent, group_names: dict[int, str]) -> dict[str, Any]:
    return {
        "name": agent.name,
        "host": agent.host,
        "workers": agent.workers,
        "group": group_names.get(agent.resource_group_id, "?"),
        "online": agent.online,
        "hardware": hardware_summary(agent.hardware or {}),
        "hardware_raw": agent.hardware,
        "heartbeat_age_s": max(0.0, (utcnow() - agent.last_heartbeat_at).total_seconds()),
    }


def resource_groups_page(session: Session) -> dict[str, Any]:
    """Every resource group with its live use, and every registered agent."""
    group_list = groups.list_all(session)
    names = {g.id: g.name for g in group_list}
    return {
        "groups": group_list,
        "agents": [_agent_row(a, names) for a in agents.list_all(session)],
    }
