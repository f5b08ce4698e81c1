"""Tasks side by side (`GET /tasks/compare`, the portal's comparison page): the settings
that differ, each task's final metrics, and curves of one metric to overlay by step, epoch
or seconds since each task's start."""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.core.errors import Invalid
from backend.tasks.models import RESOURCE_METRICS, STEP_SERIES, Metric, Task
from backend.tasks.schemas import (
    ComparedTask,
    Curve,
    CurvePoint,
    SpecDifference,
    TaskComparison,
)
from backend.tasks.spec import read_spec
from contracts.task_spec import TaskSpec

MAX_COMPARED = 10
MAX_CURVE_POINTS = 2000
# Spec entries that are not settings: what was asked before placement (`groups` holds the
# outcome), and a plan's trial options.
NOT_SETTINGS = ("request", "trial")


def flat_settings(spec: TaskSpec) -> dict[str, Any]:
    """The spec's settings as `{dotted path: scalar or list}`: nested models become
    `data.num_workers`, the groups one `name × workers` string each (`groups`)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat[prefix] = value

    stored = {k: v for k, v in spec.stored().items() if k not in NOT_SETTINGS}
    stored["groups"] = [f"{g.name} × {g.workers}" for g in spec.groups]
    walk("", stored)
    return flat


def differences(tasks: Sequence[Task]) -> list[SpecDifference]:
    """The settings (and the code version) whose values are not all equal, sorted by path."""
    flats = [
        {"code_version_id": task.code_version_id, **flat_settings(read_spec(task))}
        for task in tasks
    ]
    found = []
    for path in sorted(set().union(*flats)):
        values = [flat.get(path) for flat in flats]
        if len({repr(value) for value in values}) > 1:
            found.append(SpecDifference(field=path, values=values))
    return found


def _task_wide(query):  # type: ignore[no-untyped-def]
    """Metrics of the whole task (no rank), the ranks' resource samples left out."""
    return query.where(Metric.rank.is_(None), Metric.name.not_in(RESOURCE_METRICS))


def thinned(points: list[CurvePoint], most: int = MAX_CURVE_POINTS) -> list[CurvePoint]:
    """At most `most` of `points`, evenly spaced, the first and the last kept."""
    if len(points) <= most:
        return points
    stride = (len(points) - 1) / (most - 1)
    return [points[round(i * stride)] for i in range(most)]


def compared_ids(ids: Sequence[int]) -> list[int]:
    """`ids` once each, in order: checked before any task is read, so that too many ids
    are refused as such rather than as the first one that does not exist.

    Raises:
        Invalid: fewer than two distinct ids, or more than `MAX_COMPARED`.
    """
    unique = list(dict.fromkeys(ids))
    if not 2 <= len(unique) <= MAX_COMPARED:
        raise Invalid(
            f"compare 2 to {MAX_COMPARED} different tasks ({len(unique)} given)", field="ids"
        )
    return unique


def compare(session: Session, *, tasks: Sequence[Task], metric: str | None) -> TaskComparison:
    """`tasks` (each readable by the caller, checked by the route) side by side.

    Raises:
        Invalid: fewer than two distinct tasks, or more than `MAX_COMPARED`.
    """
    unique = list({task.id: task for task in tasks}.values())
    ids = compared_ids([task.id for task in unique])
    in_tasks = select(Metric).where(Metric.task_id.in_(ids))
    epoch_rows = session.scalars(
        _task_wide(in_tasks).where(~Metric.name.startswith(STEP_SERIES)).order_by(Metric.id)
    ).all()
    final: dict[int, dict[str, float | None]] = {task_id: {} for task_id in ids}
    for row in epoch_rows:
        final[row.task_id][row.name] = row.value  # the latest report wins
    names = _task_wide(select(Metric.name).where(Metric.task_id.in_(ids))).distinct()
    curves = []
    if metric:
        by_task: dict[int, list[CurvePoint]] = {task_id: [] for task_id in ids}
        started = {task.id: task.started_at for task in unique}
        points = _task_wide(in_tasks.where(Metric.name == metric)).order_by(Metric.id)
        for row in session.scalars(points):
            start = started[row.task_id]
            seconds = None if start is None else (row.created_at - start).total_seconds()
            by_task[row.task_id].append(
                CurvePoint(step=row.step, epoch=row.epoch, value=row.value, seconds=seconds)
            )
        curves = [Curve(task_id=task_id, points=thinned(by_task[task_id])) for task_id in ids]
    return TaskComparison(
        tasks=[_compared(task, final[task.id]) for task in unique],
        differences=differences(unique),
        metrics=sorted(session.scalars(names)),
        metric=metric,
        curves=curves,
    )


def _compared(task: Task, final_metrics: dict[str, float | None]) -> ComparedTask:
    duration = None
    if task.started_at is not None and task.finished_at is not None:
        duration = (task.finished_at - task.started_at).total_seconds()
    return ComparedTask(
        id=task.id,
        project_id=task.project_id,
        code_version_id=task.code_version_id,
        name=task.name,
        tags=task.tags,
        status=task.status,
        created_at=task.created_at,
        started_at=task.started_at,
        finished_at=task.finished_at,
        duration_s=duration,
        final_metrics=final_metrics,
    )
