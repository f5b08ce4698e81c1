"""Task submission, reads and cancellation."""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC

from sqlalchemy import Select, exists, func, select
from sqlalchemy.orm import Session, aliased

from backend.core.errors import Conflict, Invalid, NotFound
from backend.plans.predict import predicted_finish_s
from backend.projects import code
from backend.projects import service as projects
from backend.projects.models import CodeVersion
from backend.resource_groups.models import ResourceGroup
from backend.tasks import depends_on, lifecycle, requests
from backend.tasks.models import (
    RESOURCE_METRICS,
    STEP_SERIES,
    Allocation,
    Checkpoint,
    LogLine,
    Metric,
    SubTask,
    SubTaskStatus,
    Task,
    TaskEvent,
    TaskStatus,
    TaskTag,
)
from backend.tasks.schemas import (
    AllocationRead,
    GroupRequest,
    GroupThroughput,
    SubTaskRead,
    TaskCreate,
    TaskUpdate,
    ThroughputRead,
    WorkerThroughput,
)
from backend.tasks.spec import read_spec, write_spec
from contracts.plan import GroupPlan
from contracts.task_spec import RequestItem, TaskSpec
from contracts.trial import TrialOptions


def submit(
    session: Session,
    *,
    data: TaskCreate,
    trial: TrialOptions | None = None,
    commit: bool = True,
) -> Task:
    """Validate and queue a task; nothing is stored if any check fails. ``trial``: a plan's
    trial task (``backend.plans.service``); ``commit=False`` leaves the commit to the caller.

    Raises:
        NotFound: the project or code version does not exist.
        Invalid: the code version belongs to another project, a group is unknown,
            or asks for more workers than the group has, no group has the device
            type, a dependency is missing, another user's, or already failed, or
            `plan_id` is not a fitted plan of the project covering the task's groups.
    """
    project = projects.get(session, project_id=data.project_id)
    version = projects.get_version(session, version_id=data.code_version_id)
    if version.project_id != project.id:
        raise Invalid(
            f"code version {version.id} belongs to another project", field="code_version_id"
        )
    request, groups = requests.resolve(session, data.resource_groups)
    requests.check_loader_workers(session, request, data.data.num_workers)
    _keep_own_settings(request, data.resource_groups)
    spec = TaskSpec.model_validate(
        {
            "epochs": data.epochs,
            "global_batch_size": data.global_batch_size,
            "seed": data.seed,
            "groups": groups,
            "request": request,
            **data.engine_options(),
            "limits": data.limits().model_dump(),
            "on_group_loss": data.group_loss(),
            **({"trial": trial.model_dump()} if trial is not None else {}),
            **_plan_prediction(session, data, project.id),
            **_hyperparameters(version, data.hyperparameters),
        }
    )
    deps = depends_on.check(session, project_id=project.id, depends_on=data.depends_on)
    task = Task(
        project_id=project.id,
        code_version_id=version.id,
        name=data.name or f"{project.name} v{version.version}",
        priority=data.priority,
        max_restarts=data.max_restarts,
    )
    task.set_tags(data.tags)
    write_spec(task, spec)
    session.add(task)
    session.flush()
    depends_on.record(session, task=task, deps=deps)
    lifecycle.record_creation(session, task)
    if commit:
        session.commit()
    return task


def _hyperparameters(version: CodeVersion, values: dict[str, object]) -> dict[str, object]:
    """`hyperparameters` for the task's spec (nothing when it sets none), checked against
    what the code version's source tells of its `HYPERPARAMETERS`
    (`backend.projects.service.declared_hyperparameters`): a module that binds none takes
    none; a literal dict's names are the only ones, each value of its default's kind
    (`backend.projects.code.value_problem`). A dict that is not a literal is checked by the
    engine when it loads the code.

    Raises:
        Invalid (field `hyperparameters.<name>`): the code declares no such name, or none at
            all, or the value is not of its default's kind.
    """
    if not values:
        return {}
    declared = projects.declared_hyperparameters(version)
    for name, value in values.items():
        problem = code.name_problem(declared, name) or code.value_problem(declared, name, value)
        if problem:
            raise Invalid(problem, field=f"hyperparameters.{name}")
    return {"hyperparameters": dict(values)}


def _keep_own_settings(request: list[dict], asked: list[GroupRequest]) -> None:
    """Copy each asked item's own settings into its resolved request item: its speed factor
    when not 1 (emulation; see worker.engine.emulation), its sharding and its max_local_batch
    when it sets them (the placed groups take them from there: `TaskSpec.speed_factor`,
    `TaskSpec.sharding_of`, `TaskSpec.max_local_batch_of`)."""
    for item, own in zip(request, asked, strict=True):
        if own.speed_factor != 1.0:
            item["speed_factor"] = own.speed_factor
        if own.sharding is not None:
            item["sharding"] = own.sharding
        if own.max_local_batch is not None:
            item["max_local_batch"] = own.max_local_batch


def _plan_prediction(session: Session, data: TaskCreate, project_id: int) -> dict[str, object]:
    """`plan_id` and the plan model's `predicted_s` for the task's spec (empty without a plan).

    Raises:
        Invalid (field `plan_id`): see `backend.plans.predict.predicted_finish_s`, or the
            task asks for a device type instead of naming its groups.
    """
    if data.plan_id is None:
        return {}
    if any(g.name is None for g in data.resource_groups):
        raise Invalid("a task from a plan names its groups", field="plan_id")
    seconds = predicted_finish_s(
        session,
        plan_id=data.plan_id,
        project_id=project_id,
        workers={g.name: g.workers for g in data.resource_groups if g.name},
        global_batch_size=data.global_batch_size,
        epochs=data.epochs,
        split_policy=data.split_policy,
        sync_strategy=data.sync_strategy,
        sync_period=data.sync_period,
        guard=data.guard,
        sharding={g.name: g.sharding or data.sharding for g in data.resource_groups if g.name},
        caps={g.name: g.max_local_batch for g in data.resource_groups if g.name},
        memory_limit_mb=data.memory_limit_mb,
    )
    return {"plan_id": data.plan_id, "predicted_s": seconds}


def get(session: Session, *, task_id: int) -> Task:
    task = session.get(Task, task_id)
    if task is None:
        raise NotFound(f"task {task_id} does not exist", field="task_id")
    return task


@dataclass(frozen=True)
class TaskFilter:
    """Which tasks a list shows: of one project, one status, carrying every tag of `tags`,
    with `name` in their name (case-insensitive), only of `project_ids` if given."""

    project_id: int | None = None
    status: TaskStatus | None = None
    tags: tuple[str, ...] = ()
    name: str = ""
    project_ids: list[int] | None = None

    def apply(self, query: Select) -> Select:
        if self.project_id is not None:
            query = query.where(Task.project_id == self.project_id)
        if self.status is not None:
            query = query.where(Task.status == self.status)
        for tag in self.tags:
            query = query.where(exists().where(TaskTag.task_id == Task.id, TaskTag.name == tag))
        if self.name:
            pattern = "%" + re.sub(r"([%_\\])", r"\\\1", self.name.lower()) + "%"
            query = query.where(func.lower(Task.name).like(pattern, escape="\\"))
        if self.project_ids is not None:
            query = query.where(Task.project_id.in_(self.project_ids))
        return query


def list_tasks(
    session: Session,
    *,
    project_id: int | None = None,
    status: TaskStatus | None = None,
    offset: int = 0,
    limit: int = 50,
    project_ids: list[int] | None = None,
    where: TaskFilter | None = None,
) -> Sequence[Task]:
    """Tasks, newest first; of one project, one status, or only `project_ids` if given
    (or as `where` says)."""
    where = where or TaskFilter(project_id=project_id, status=status, project_ids=project_ids)
    query = where.apply(select(Task))
    return session.scalars(query.order_by(Task.id.desc()).offset(offset).limit(limit)).all()


def count_tasks(
    session: Session,
    *,
    project_id: int | None = None,
    status: TaskStatus | None = None,
    project_ids: list[int] | None = None,
    where: TaskFilter | None = None,
) -> int:
    where = where or TaskFilter(project_id=project_id, status=status, project_ids=project_ids)
    return session.scalar(where.apply(select(func.count(Task.id)))) or 0


def retry(session: Session, *, task: Task) -> Task:
    """Queue a new task with the same code version, request and settings as the ended
    `task` (not its dependencies); placement is decided afresh.

    Raises:
        Conflict: `task` has not ended, or is a plan's trial (plan again instead).
        Invalid: a group it named is gone, draining, disabled or now too small.
    """
    if not task.status.terminal:
        raise Conflict(
            f"task {task.id} is {task.status.value}; only an ended task is retried", field="status"
        )
    spec = read_spec(task)
    refuse_trial(task, spec, "start a new plan (POST /api/v1/plans) instead")
    asked = [
        GroupRequest.model_validate(
            item.model_dump(
                include=set(GroupRequest.model_fields),
                exclude_unset=True,
                exclude_none=True,
                exclude={"device_type"} if item.name else None,
            )
        )
        for item in spec.requested()
    ]
    request, groups = requests.resolve(session, asked)
    _keep_own_settings(request, asked)
    copy = Task(
        project_id=task.project_id,
        code_version_id=task.code_version_id,
        name=f"{task.name} (retry of {task.id})"[-200:],
        priority=task.priority,
        max_restarts=task.max_restarts,
    )
    copy.set_tags(task.tags)
    write_spec(
        copy,
        spec.model_copy(
            update={
                "request": [RequestItem.model_validate(r) for r in request],
                "groups": [GroupPlan.model_validate(g) for g in groups],
            }
        ),
    )
    session.add(copy)
    session.flush()
    lifecycle.record_creation(session, copy)
    session.commit()
    return copy


def update(session: Session, *, task: Task, data: TaskUpdate) -> Task:
    """Change a task's tags (at any time), or a queued task's priority or dependencies.

    Raises:
        Conflict: priority or dependencies asked of a task that is no longer queued.
        Invalid: a dependency is missing, another user's, failed, or makes a cycle.
    """
    queued_only = data.priority is not None or data.depends_on is not None
    if queued_only and task.status is not TaskStatus.QUEUED:
        raise Conflict(
            f"task {task.id} is {task.status.value}; only a queued task changes its priority "
            "or dependencies (tags change at any time)",
            field="status",
        )
    if data.tags is not None:
        task.set_tags(data.tags)
    if data.priority is not None:
        task.priority = data.priority
    if data.depends_on is not None:
        deps = depends_on.check(
            session, project_id=task.project_id, depends_on=data.depends_on, task_id=task.id
        )
        depends_on.record(session, task=task, deps=deps)
    session.commit()
    return task


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
        .where(Allocation.task_id == task_id)
        .order_by(Allocation.id)
    )
    return [
        AllocationRead.model_validate({**_columns(a), "resource_group": name}) for a, name in rows
    ]


def sub_tasks(session: Session, *, task_id: int) -> list[SubTaskRead]:
    rows = session.execute(
        select(SubTask, ResourceGroup.name)
        .join(ResourceGroup, ResourceGroup.id == SubTask.resource_group_id)
        .where(SubTask.task_id == task_id)
        .order_by(SubTask.attempt, SubTask.group_index, SubTask.part)
    )
    return [SubTaskRead.model_validate({**_columns(s), "resource_group": name}) for s, name in rows]


def _columns(row: object) -> dict:
    return {c.key: getattr(row, c.key) for c in row.__table__.columns}  # type: ignore[attr-defined]


def logs(
    session: Session,
    *,
    task_id: int,
    after_id: int = 0,
    node: str | None = None,
    limit: int = 1000,
) -> Sequence[LogLine]:
    """Log lines with id > `after_id` in arrival order (the id is the stream cursor)."""
    query = select(LogLine).where(LogLine.task_id == task_id, LogLine.id > after_id)
    if node:
        query = query.where(LogLine.node == node)
    return session.scalars(query.order_by(LogLine.id).limit(limit)).all()


def rank_nodes(spec: TaskSpec) -> list[str]:
    """The log nodes of the task's ranks: `ps` (rank 0), then `rank-1` … `rank-W` over its
    placed groups (else, not placed yet, its request items), then the ranks that own the
    parameter server's other shards (`ps_shards`)."""
    workers = sum(plan.workers for plan in spec.groups or spec.request)
    ranks = workers + (spec.ps_shards or 1) - 1
    return ["ps", *(f"rank-{rank}" for rank in range(1, ranks + 1))]


def log_nodes(task: Task) -> list[str]:
    """The nodes the task's spec gives logs: its ranks' (`rank_nodes`) and `agent-<group>`
    for each named group (its agents' own lines), read from the spec only."""
    spec = read_spec(task)
    plans: list[GroupPlan] | list[RequestItem] = spec.groups or spec.request
    return [*rank_nodes(spec), *(f"agent-{plan.name}" for plan in plans if plan.name)]


def refuse_trial(task: Task, spec: TaskSpec, instead: str) -> None:
    """Refuse to submit a plan's trial again (its timings belong to that plan).

    Raises:
        Conflict: `spec` is a trial's; the message ends with `instead`, what to do.
    """
    if spec.trial is not None:
        raise Conflict(
            f"task {task.id} is a plan's trial: its timings belong to that plan; {instead}",
            field="task_id",
        )


def check_log_node(session: Session, *, task: Task, node: str) -> None:
    """`node` is one of the task's log nodes: one its spec gives (`log_nodes`, a node that
    has logged nothing yet included) or one that has a line (a node of an earlier attempt).

    Raises:
        NotFound: neither; the message names the node and the spec's nodes.
    """
    if node in log_nodes(task):
        return
    logged = select(LogLine.id).where(LogLine.task_id == task.id, LogLine.node == node).limit(1)
    if session.scalar(logged) is None:
        nodes = ", ".join(log_nodes(task))
        raise NotFound(f"task {task.id} has no node {node!r} (its nodes: {nodes})", field="node")


def log_text(line: LogLine) -> str:
    """One line of a log download: UTC time to the millisecond, node, text, newline, e.g.
    `2026-11-22T06:00:00.500Z rank-1   epoch 1 ...`."""
    at = line.time if line.time.tzinfo is None else line.time.astimezone(UTC).replace(tzinfo=None)
    return f"{at.isoformat(timespec='milliseconds')}Z {line.node:<8} {line.text}\n"


def metrics(
    session: Session,
    *,
    task_id: int,
    name: str | None = None,
    resources: bool | None = None,
    scale: str | None = None,
    max_points: int | None = None,
    after_id: int | None = None,
    limit: int | None = None,
) -> Sequence[Metric]:
    """The task's metrics, oldest first; `resources` True: only the ranks' resource use
    (`RESOURCE_METRICS`), False: all but those, None: all; `scale` "step": only the per-step
    series (names starting `STEP_SERIES`), "epoch": all but those, None: all; `after_id`:
    only those stored after the metric of that id (a chart's cursor), at most `limit`.

    `max_points`: at most that many points of each series (a name and rank): a longer one
    keeps every k-th point, k = ceil(points / max_points), counted back from its latest
    (always kept), in step order; a series of at most `max_points` comes whole."""
    query = select(Metric).where(Metric.task_id == task_id)
    if after_id is not None:
        query = query.where(Metric.id > after_id)
    if name:
        query = query.where(Metric.name == name)
    if resources is not None:
        listed = Metric.name.in_(RESOURCE_METRICS)
        query = query.where(listed if resources else ~listed)
    if scale is not None:
        per_step = Metric.name.startswith(STEP_SERIES)
        query = query.where(per_step if scale == "step" else ~per_step)
    if max_points is not None:
        return _every_kth(session, query, max_points)
    return session.scalars(query.order_by(Metric.id).limit(limit)).all()


def _every_kth(session: Session, query: Select, max_points: int) -> Sequence[Metric]:
    """:func:`metrics`' `max_points` in one query: each series' points numbered in step
    order (window functions, SQLite and PostgreSQL alike), every k-th from the latest kept."""
    series = (Metric.name, Metric.rank)
    numbered = query.add_columns(
        func.row_number()
        .over(partition_by=series, order_by=(Metric.step, Metric.id))
        .label("position"),
        func.count().over(partition_by=series).label("points"),
    ).subquery()
    kept = aliased(Metric, numbered)
    points, position = numbered.c.points, numbered.c.position
    stride = (points + max_points - 1) // max_points  # floor division: integers on both
    chosen = select(kept).where((points - position) % stride == 0).order_by(numbered.c.id)
    return session.scalars(chosen).all()


def nonfinite_metrics(session: Session, *, task_id: int) -> Sequence[Metric]:
    """The task's metric values that were NaN or infinite, oldest first."""
    query = select(Metric).where(Metric.task_id == task_id, Metric.nonfinite.is_not(None))
    return session.scalars(query.order_by(Metric.id)).all()


THROUGHPUT_METRICS = ("samples_per_s", "profiled_samples_per_s", "batch_share")
WORKER_METRICS = (*THROUGHPUT_METRICS, "idle_fraction")


def _group_sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _group_mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def throughput(session: Session, *, task: Task) -> ThroughputRead:
    """Latest per-worker throughput metrics, their per-group sums (idle: mean) and the task's
    samples/s.

    Ranks map to groups as the engine lays them out: compute ranks from 1, each
    group a contiguous block in the order of the spec's groups.
    """
    rows = session.scalars(
        select(Metric)
        .where(Metric.task_id == task.id, Metric.name.in_(WORKER_METRICS))
        .order_by(Metric.id)
    )
    latest: dict[tuple[str, int | None], float | None] = {(m.name, m.rank): m.value for m in rows}
    workers, groups, rank = [], [], 1
    for group in read_spec(task).groups:
        members = [
            WorkerThroughput(
                rank=r, group=group.name, **{name: latest.get((name, r)) for name in WORKER_METRICS}
            )
            for r in range(rank, rank + group.workers)
        ]
        rank += len(members)
        workers.extend(members)
        groups.append(
            GroupThroughput(
                name=group.name,
                device_type=group.device_type,
                workers=len(members),
                idle_fraction=_group_mean([w.idle_fraction for w in members]),
                **{
                    name: _group_sum([getattr(w, name) for w in members])
                    for name in THROUGHPUT_METRICS
                },
            )
        )
    return ThroughputRead(
        samples_per_s=latest.get(("samples_per_s", None)), workers=workers, groups=groups
    )


def checkpoints(session: Session, *, task_id: int) -> Sequence[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.task_id == task_id).order_by(Checkpoint.id)
    return session.scalars(query).all()


def get_checkpoint(session: Session, *, task_id: int, checkpoint_id: int) -> Checkpoint:
    checkpoint = session.get(Checkpoint, checkpoint_id)
    if checkpoint is None or checkpoint.task_id != task_id:
        raise NotFound(f"checkpoint {checkpoint_id} of task {task_id} does not exist")
    return checkpoint


def summary(session: Session, *, task: Task) -> dict:
    """The latest value of each epoch metric, e.g. {"val_accuracy": 0.97, ...}; None when
    it was not finite."""
    latest: dict[str, float | None] = {}
    for metric in metrics(session, task_id=task.id, resources=False, scale="epoch"):
        if metric.rank is None:
            latest[metric.name] = metric.value
    return latest


def busy_workers_by_agent(session: Session) -> dict[int, int]:
    """Workers each agent runs now (its running sub-tasks' workers), by agent id."""
    rows = session.execute(
        select(SubTask.agent_id, func.sum(SubTask.workers))
        .join(Task, Task.id == SubTask.task_id)
        .where(
            SubTask.agent_id.is_not(None),
            SubTask.status == SubTaskStatus.RUNNING,
            Task.status == TaskStatus.RUNNING,
        )
        .group_by(SubTask.agent_id)
    )
    return {int(agent_id or 0): int(total or 0) for agent_id, total in rows}
