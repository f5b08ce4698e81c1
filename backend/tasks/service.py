"""Task submission, reads and cancellation."""

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.core.errors import Invalid, NotFound
from backend.projects import service as projects
from backend.resource_groups.models import ResourceGroup
from backend.tasks import lifecycle
from backend.tasks.models import (
    Allocation,
    Checkpoint,
    LogLine,
    Metric,
    SubTask,
    Task,
    TaskEvent,
    TaskStatus,
)
from backend.tasks.schemas import AllocationRead, SubTaskRead, TaskCreate


def _resolve_groups(session: Session, data: TaskCreate) -> list[dict]:
    """Check every requested group exists and has room; return the spec's group plans."""
    plans = []
    for index, request in enumerate(data.resource_groups):
        field = f"resource_groups.{index}"
        group = session.scalar(select(ResourceGroup).where(ResourceGroup.name == request.name))
        if group is None:
            raise Invalid(f"resource group '{request.name}' does not exist", field=f"{field}.name")
        if request.workers > group.capacity:
            raise Invalid(
                f"resource group '{group.name}' has {group.capacity} worker(s); "
                f"{request.workers} requested", field=f"{field}.workers",
            )
        plans.append({"name": group.name, "device_type": group.device_type,
                      "workers": request.workers})
    return plans


def submit(session: Session, *, data: TaskCreate) -> Task:
    """Validate and queue a task; nothing is stored if any check fails.

    Raises:
        NotFound: the project or code version does not exist.
        Invalid: the code version belongs to another project, a group is unknown,
            or asks for more workers than the group has.
    """
    project = projects.get(session, project_id=data.project_id)
    version = projects.get_version(session, version_id=data.code_version_id)
    if version.project_id != project.id:
        raise Invalid(f"code version {version.id} belongs to another project",
                      field="code_version_id")
    spec = {
        "epochs": data.epochs, "global_batch_size": data.global_batch_size,
        "split_policy": data.split_policy, "seed": data.seed,
        "groups": _resolve_groups(session, data),
    }
    task = Task(project_id=project.id, code_version_id=version.id, spec=spec,
                name=data.name or f"{project.name} v{version.version}", priority=data.priority)
    session.add(task)
    session.flush()
    lifecycle.record_creation(session, task)
    session.commit()
    return task


def get(session: Session, *, task_id: int) -> Task:
    task = session.get(Task, task_id)
    if task is None:
        raise NotFound(f"task {task_id} does not exist", field="task_id")
    return task


def list_tasks(
    session: Session, *, project_id: int | None = None, status: TaskStatus | None = None,
    offset: int = 0, limit: int = 50,
) -> Sequence[Task]:
    query = select(Task).order_by(Task.id.desc()).offset(offset).limit(limit)
    if project_id is not None:
        query = query.where(Task.project_id == project_id)
    if status is not None:
        query = query.where(Task.status == status)
    return session.scalars(query).all()


def cancel(session: Session, *, task: Task, reason: str = "cancelled by user") -> Task:
    """Cancel a task that has not ended; its agents stop its processes within seconds."""
    lifecycle.transition(session, task, TaskStatus.CANCELLED, reason)
    session.commit()
    return task


def events(session: Session, *, task_id: int) -> Sequence[TaskEvent]:
    query = select(TaskEvent).where(TaskEvent.task_id == task_id).order_by(TaskEvent.id)
    return session.scalars(query).all()


def allocations(session: Session, *, task_id: int) -> list[AllocationRead]:
    rows = session.execute(
        select(Allocation, ResourceGroup.name)
        .join(ResourceGroup, ResourceGroup.id == Allocation.resource_group_id)
        .where(Allocation.task_id == task_id).order_by(Allocation.id)
    )
    return [
        AllocationRead.model_validate({**_columns(a), "resource_group": name}) for a, name in rows
    ]


def sub_tasks(session: Session, *, task_id: int) -> list[SubTaskRead]:
    rows = session.execute(
        select(SubTask, ResourceGroup.name)
        .join(ResourceGroup, ResourceGroup.id == SubTask.resource_group_id)
        .where(SubTask.task_id == task_id).order_by(SubTask.group_index)
    )
    return [SubTaskRead.model_validate({**_columns(s), "resource_group": name}) for s, name in rows]


def _columns(row: object) -> dict:
    return {c.key: getattr(row, c.key) for c in row.__table__.columns}  # type: ignore[attr-defined]


def logs(
    session: Session, *, task_id: int, after_id: int = 0, node: str | None = None,
    limit: int = 1000,
) -> Sequence[LogLine]:
    """Log lines with id > `after_id` in arrival order (the id is the stream cursor)."""
    query = select(LogLine).where(LogLine.task_id == task_id, LogLine.id > after_id)
    if node:
        query = query.where(LogLine.node == node)
    return session.scalars(query.order_by(LogLine.id).limit(limit)).all()


def metrics(session: Session, *, task_id: int, name: str | None = None) -> Sequence[Metric]:
    query = select(Metric).where(Metric.task_id == task_id)
    if name:
        query = query.where(Metric.name == name)
    return session.scalars(query.order_by(Metric.id)).all()


def checkpoints(session: Session, *, task_id: int) -> Sequence[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.task_id == task_id).order_by(Checkpoint.id)
    return session.scalars(query).all()


def get_checkpoint(session: Session, *, task_id: int, checkpoint_id: int) -> Checkpoint:
    checkpoint = session.get(Checkpoint, checkpoint_id)
    if checkpoint is None or checkpoint.task_id != task_id:
        raise NotFound(f"checkpoint {checkpoint_id} of task {task_id} does not exist")
    return checkpoint


def summary(session: Session, *, task: Task) -> dict:
    """The latest value of each epoch metric, e.g. {"val_accuracy": 0.97, ...}."""
    latest: dict[str, float] = {}
    for metric in metrics(session, task_id=task.id):
        if metric.rank is None:
            latest[metric.name] = metric.value
    return latest
