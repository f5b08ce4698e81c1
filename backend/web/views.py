"""What the task and project pages show, gathered through the domain services (no queries here).

Every page shows only what its user may see (the rules: `backend/projects/access.py`,
`backend/tasks/access.py`; the policy: docs/architecture.md, Access).
"""

import math
from typing import Any

from sqlalchemy.orm import Session

from backend.auth.models import User
from backend.core.db import utcnow
from backend.projects import access as project_access
from backend.projects import service as projects
from backend.projects.code import list_examples
from backend.projects.models import Project
from backend.projects.requirements import MAX_REQUIREMENTS_CHARS
from backend.resource_groups import service as groups
from backend.tasks import access as task_access
from backend.tasks import compare, provenance
from backend.tasks import service as tasks
from backend.tasks.models import STEP_SERIES, Task, TaskStatus
from backend.tasks.spec import read_spec
from backend.web.forms import FieldErrors, ProjectForm
from backend.web.spec_display import shown_difference, shown_setting
from backend.web.task_form import TaskForm, has_dependencies, task_fields
from backend.web.task_lists import ListQuery, listing
from backend.web.templating import format_duration
from contracts.agent_api import RESOURCE_SAMPLE_EVERY_S
from contracts.plan import GroupPlan
from contracts.task_spec import RequestItem, TaskSpec

TASK_LIST_LIMIT = 100
PROJECT_LIMIT = 500


def tasks_page(session: Session, user: User, query: ListQuery) -> dict[str, Any]:
    """One page of the tasks the user may see that match `query`, newest first, with the
    name of each one's project (`backend.web.task_lists`)."""
    ids = project_access.visible_project_ids(session, user=user)
    names = {p.id: p.name for p in projects.list_all(session, limit=PROJECT_LIMIT, project_ids=ids)}
    return {
        "listing": listing(session, user, query, action="/", project=None),
        "project_names": names,
    }


def projects_page(
    session: Session,
    user: User,
    form: ProjectForm | None = None,
    errors: FieldErrors | None = None,
    show_archived: bool = False,
) -> dict[str, Any]:
    """The user's projects (archived ones on request), and the create-project form."""
    ids = project_access.visible_project_ids(session, user=user)
    return {
        "projects": projects.list_all(
            session, limit=PROJECT_LIMIT, project_ids=ids, include_archived=show_archived
        ),
        "archived_count": projects.count(session, project_ids=ids)
        - projects.count(session, project_ids=ids, include_archived=False),
        "show_archived": show_archived,
        "form": form or ProjectForm(),
        "errors": errors or {},
    }


def group_rows(session: Session, form: TaskForm) -> list[dict[str, Any]]:
    """One submission-form row per resource group: capacity, free and online workers, state."""
    return [
        {
            "name": g.name,
            "device_type": g.device_type,
            "capacity": g.capacity,
            "free": g.free_workers,
            "online_workers": g.online_workers,
            "agents_online": g.agents_online,
            "state": g.state.value,
            "workers": form.workers_of(g.name),
            "sharding": form.sharding_of(g.name),
            "cap": form.cap_of(g.name),
        }
        for g in groups.list_all(session)
    ]


def project_page(
    session: Session,
    user: User,
    project: Project,
    *,
    form: TaskForm | None = None,
    errors: FieldErrors | None = None,
    example: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """A project's code versions, members and tasks; the submission, upload and edit forms."""
    form = form or TaskForm()
    versions = projects.list_versions(session, project_id=project.id)
    if not form.code_version_id:
        first = str(versions[0].id) if versions else f"example:{(list_examples() or [''])[0]}"
        form = form.model_copy(update={"code_version_id": first})
    project_tasks = tasks.list_tasks(session, project_id=project.id, limit=TASK_LIST_LIMIT)
    query = extra.pop("list_query", None) or ListQuery()
    context = {
        "project": project,
        "versions": versions,
        "examples": list_examples(),
        "example": example,
        "requirements": "",
        "max_requirements": MAX_REQUIREMENTS_CHARS,
        "tasks": project_tasks,  # the choices of "Starts after"
        "listing": listing(session, user, query, action=f"/projects/{project.id}", project=project),
        "groups": group_rows(session, form),
        "form": form,
        "errors": errors or {},
        "fields": task_fields(),
        "dependencies": has_dependencies(),
        "can_manage": project_access.can_manage(user, project),
        "archived": project.archived_at is not None,
        "members": projects.member_rows(session, project=project),
        "edit_form": ProjectForm(name=project.name, description=project.description),
        "edit_errors": {},
        "member_errors": {},
        "from_task": None,  # the task "Run again" filled the form from
        "not_in_form": [],  # what that task has that the form leaves out
    }
    return {**context, **extra}


def _plans(spec: TaskSpec) -> list[GroupPlan] | list[RequestItem]:
    """The placed groups, else (not placed yet) the request items."""
    return spec.groups or spec.request


def _own_settings(spec: TaskSpec, plan: GroupPlan | RequestItem) -> str:
    """What follows a group or request item that sets its own settings: ` (fsdp)` for its
    sharding, ` (max local batch 16)` for its max_local_batch; `` for none."""
    if isinstance(plan, GroupPlan):
        own, cap = spec.sharding_of(plan), spec.max_local_batch_of(plan)
    else:
        own, cap = plan.sharding, plan.max_local_batch
    return (f" ({own})" if own else "") + (f" (max local batch {cap})" if cap else "")


def spec_summary(spec: TaskSpec) -> dict[str, Any]:
    """The task spec for display: `groups` as `name × workers` strings (with a group's own
    sharding and max_local_batch), total workers, and the other settings (scalars and lists
    of names) as `{"key", "label", "value"}` rows in words and units
    (`backend.web.spec_display`)."""
    plans = _plans(spec)
    shown = {"groups", "request", "epochs", "global_batch_size", "split_policy", "seed"}
    return {
        "groups": [
            f"{g.name or (g.device_type or '?') + ' (any group)'} × {g.workers}"
            f"{_own_settings(spec, g)}"
            for g in plans
        ],
        "workers": sum(g.workers for g in plans),
        "epochs": spec.epochs,
        "global_batch_size": spec.global_batch_size,
        "split_policy": spec.split_policy,
        "seed": spec.seed,
        "settings": [
            row
            for key, value in spec.stored().items()
            if key not in shown and (row := shown_setting(key, value)) is not None
        ],
    }


def group_shares(spec: TaskSpec) -> list[dict[str, Any]]:
    """Each group's workers and planned share of the global batch (workers / all workers,
    as the `even` split gives; the page replaces it with measured shares when reported)."""
    total = sum(g.workers for g in spec.groups) or 1
    return [{"name": g.name, "workers": g.workers, "share": g.workers / total} for g in spec.groups]


def epochs_done(task: Task) -> int:
    """Whole epochs finished, from the task's 0..1 progress."""
    return math.floor(task.progress * (read_spec(task).epochs or 0) + 1e-9)


def timing(task: Task) -> dict[str, float | None]:
    """Seconds running so far and the estimated seconds to finish (`Task.finish_estimate`,
    as the REST API gives it); None when not yet known."""
    if task.started_at is None:
        return {"elapsed_s": None, "eta_s": None}
    end = task.finished_at or utcnow()
    elapsed = max(0.0, (end - task.started_at).total_seconds())
    return {"elapsed_s": elapsed, "eta_s": task.finish_estimate(utcnow())[0]}


def measured_time(task: Task, elapsed_s: float | None) -> str:
    """What the task took, beside its plan's predicted time: `(took 27 s)` once it
    succeeded, `(ran 9 s)` once it failed or was cancelled; empty before it ended."""
    if not task.status.terminal or elapsed_s is None:
        return ""
    word = "took" if task.status is TaskStatus.SUCCEEDED else "ran"
    return f"({word} {format_duration(elapsed_s)})"


PROVENANCE_EPOCHS = 50
"""The task page lists the latest this many epochs of "Where the data went" (the REST answer
lists every one): a long task's page, and its refresh after each checkpoint, stay small."""


def provenance_section(session: Session, task: Task) -> dict[str, Any]:
    """The task page's "Where the data went", alone: what the page fetches again as
    checkpoints bring their records."""
    return {
        "task": task,
        "provenance": provenance.read(session, task=task, last_epochs=PROVENANCE_EPOCHS),
    }


def task_page(session: Session, user: User, task: Task) -> dict[str, Any]:
    """A task with its project, code version, timeline, nodes, shares, checkpoints, shard
    provenance and the metric values that were not finite."""
    project = projects.get(session, project_id=task.project_id)
    spec = read_spec(task)
    times = timing(task)
    return {
        "task": task,
        "terminal": task.status.terminal,
        "project": project,
        "can_write": project.archived_at is None,
        "trial": spec.trial is not None,
        "version": projects.get_version(session, version_id=task.code_version_id),
        "events": tasks.events(session, task_id=task.id),
        "sub_tasks": tasks.sub_tasks(session, task_id=task.id),
        "allocations": tasks.allocations(session, task_id=task.id),
        "checkpoints": tasks.checkpoints(session, task_id=task.id),
        **provenance_section(session, task),
        "nonfinite": tasks.nonfinite_metrics(session, task_id=task.id),
        "spec": spec_summary(spec),
        "shares": group_shares(spec),
        "nodes": tasks.rank_nodes(spec),
        "epochs_done": epochs_done(task),
        "measured": measured_time(task, times["elapsed_s"]),
        "sample_every_s": RESOURCE_SAMPLE_EVERY_S,
        **times,
    }


def _best(name: str, values: list[float | None]) -> float | None:
    """The best of a metric's final values: the lowest of a loss or error, the highest of
    an accuracy or score; None for another metric (no best is claimed) or no value."""
    known = [v for v in values if v is not None]
    lower = any(word in name for word in ("loss", "error", "perplexity"))
    higher = any(word in name for word in ("accuracy", "acc", "f1", "score", "auc"))
    if not known or lower == higher:
        return None
    return min(known) if lower else max(known)


DEFAULT_COMPARED = ("val_loss", "train_loss", "val_accuracy")


def compare_page(session: Session, user: User, ids: list[int]) -> dict[str, Any]:
    """Tasks side by side (`backend.tasks.compare`), each readable by `user`, with the
    settings that differ in words and units (`spec_display.shown_difference`), their final
    metrics as rows (the best marked) and the metric the chart opens with.

    Raises:
        NotFound: a task `user` may not see. Invalid: fewer than 2 or more than 10 tasks.
    """
    found = [
        task_access.readable_task(session, user=user, task_id=task_id)
        for task_id in compare.compared_ids(ids)
    ]
    comparison = compare.compare(session, tasks=found, metric=None)
    rows = []
    for name in comparison.metrics:
        if name.startswith(STEP_SERIES):
            continue  # a per-step series: a curve, no final value
        values = [task.final_metrics.get(name) for task in comparison.tasks]
        best = _best(name, values) if len(comparison.tasks) > 1 else None
        cells = [
            {"text": "—" if v is None else f"{v:.4g}", "best": v is not None and v == best}
            for v in values
        ]
        rows.append({"name": name, "cells": cells})
    ids_seen = project_access.visible_project_ids(session, user=user)
    names = {
        p.id: p.name for p in projects.list_all(session, limit=PROJECT_LIMIT, project_ids=ids_seen)
    }
    default = next((m for m in DEFAULT_COMPARED if m in comparison.metrics), None)
    return {
        "comparison": comparison,
        "differences": [shown_difference(d.field, d.values) for d in comparison.differences],
        "final_rows": rows,
        "project_names": names,
        "default_metric": default or next(iter(comparison.metrics), None),
    }
