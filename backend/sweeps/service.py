"""Hyperparameter sweeps: create one, advance it (trials submitted K at a time, the median
stopping rule), cancel it, read it (docs/architecture.md, "Sweeps").

A sweep moves on in `advance`, which the scheduler's pass calls for every running sweep
(`backend.scheduler.service.schedule_once`, so after a trial ends, since a release wakes
the pass) and `create` calls once: first the median stopping rule over its running trials,
then new trials while fewer than `parallel` are unfinished, then FINISHED once every
planned trial has been submitted and has ended.
"""

import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from backend.core.db import utcnow
from backend.core.errors import Conflict, Invalid, NotFound, ServiceError
from backend.plans import performance
from backend.plans.models import Plan
from backend.plans.service import group_item
from backend.projects import code
from backend.projects import service as projects
from backend.projects.code import Declared
from backend.sweeps import placement, space, stopping
from backend.sweeps.models import Sweep, SweepStatus
from backend.sweeps.schemas import SweepCreate
from backend.tasks import lifecycle
from backend.tasks import service as tasks
from backend.tasks.models import (
    RESOURCE_METRICS,
    STEP_SERIES,
    TERMINAL,
    Metric,
    Task,
    TaskStatus,
)
from backend.tasks.schemas import TaskCreate
from backend.tasks.spec import read_spec

log = logging.getLogger(__name__)

STOP_PREFIX = "stopped early by the median stopping rule"
OWN_KEYS = ("project_id", "code_version_id")


# --- create -------------------------------------------------------------------------------


def base_task(data: SweepCreate) -> TaskCreate:
    """The task every trial runs, validated as a submission; errors name `task.<field>`."""
    for key in OWN_KEYS:
        if key in data.task:
            raise Invalid(
                f"give {key} at the sweep's top level, not in its task", field=f"task.{key}"
            )
    try:
        return TaskCreate.model_validate(
            {**data.task, "project_id": data.project_id, "code_version_id": data.code_version_id}
        )
    except ValidationError as exc:
        raise _task_error(exc) from None


def _task_error(exc: ValidationError) -> Invalid:
    """A task body's first validation error, its field under `task.`."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return Invalid(f"task: {message}", field=f"task.{where}" if where else "task")


def _check_names(declared: Declared, data: SweepCreate) -> None:
    """A grid lists values for each name, and every searched name and value is one the
    code's `HYPERPARAMETERS` takes, as far as its source tells
    (`backend.projects.code.name_problem`, `value_problem`: a range is a number)."""
    if data.algorithm == "grid":
        for name, item in data.space.items():
            if item.values is None:
                raise Invalid(
                    "grid search takes a list of values; a range (min, max) is for random search",
                    field=f"space.{name}",
                )
    for name, item in data.space.items():
        problem = code.name_problem(declared, name)
        if problem:
            raise Invalid(problem, field=f"space.{name}")
        if item.values is None:
            problem = code.value_problem(declared, name, item.min)
            if problem:
                raise Invalid(problem, field=f"space.{name}")
            continue
        for index, value in enumerate(item.values):
            problem = code.value_problem(declared, name, value)
            if problem:
                raise Invalid(problem, field=f"space.{name}.values.{index}")


def usable_plan(session: Session, *, sweep_plan_id: int | None, data: TaskCreate) -> Plan | None:
    """The plan whose model places the trials: the sweep's `plan_id`, which must be a
    fitted plan of the project timing the task's sync strategy; None without one (the
    trials run on the task's own groups, whatever plans the code version has).

    Raises:
        Invalid (field `plan_id`): the given plan is not usable.
    """
    if sweep_plan_id is None:
        return None
    plan = session.get(Plan, sweep_plan_id)
    if plan is None or plan.project_id != data.project_id:
        raise Invalid(f"plan {sweep_plan_id} is not a plan of this project", field="plan_id")
    if plan.model is None:
        raise Invalid(f"plan {sweep_plan_id} has no fitted model yet", field="plan_id")
    if plan.model.get("sync_strategy") != data.sync_strategy:
        raise Invalid(
            f"plan {sweep_plan_id} timed sync_strategy {plan.model.get('sync_strategy')!r}, "
            f"not the task's {data.sync_strategy!r}",
            field="plan_id",
        )
    return plan


def create(session: Session, *, data: SweepCreate, user_id: int | None = None) -> Sweep:
    """Store the sweep with its planned trials and submit its first `parallel` of them.

    Raises:
        NotFound: the project or code version does not exist.
        Invalid: the code version is another project's, the task is not a valid
            submission (field `task.<name>`), a searched name or value is not one the
            code's `HYPERPARAMETERS` takes (field `space.<name>`, `space.<name>.values.<i>`),
            the plan is not usable (`plan_id`), or a trial cannot be submitted (its
            refusal, its field prefixed `task.`: the trial is the sweep's task).
    """
    project = projects.get(session, project_id=data.project_id)
    version = projects.get_version(session, version_id=data.code_version_id)
    if version.project_id != project.id:
        raise Invalid(
            f"code version {version.id} belongs to another project", field="code_version_id"
        )
    base = base_task(data)
    _check_names(projects.declared_hyperparameters(version), data)
    stored_space = {name: item.stored() for name, item in data.space.items()}
    trials = space.expand(data.algorithm, stored_space, data.trials, data.seed)
    plan = usable_plan(session, sweep_plan_id=data.plan_id, data=base)
    sweep = Sweep(
        project_id=project.id,
        code_version_id=version.id,
        name=data.name or f"sweep of {project.name} v{version.version}",
        algorithm=data.algorithm,
        space=stored_space,
        base=base.model_dump(mode="json", exclude={"project_id", "code_version_id"}),
        trials=trials,
        parallel=data.parallel,
        metric=data.metric,
        goal=data.goal,
        seed=data.seed,
        stopping={
            "rule": data.early_stopping,
            "min_trials": data.min_trials,
            "min_epochs": data.min_epochs,
        },
        plan_id=plan.id if plan else None,
        created_by_id=user_id,
    )
    session.add(sweep)
    session.flush()
    # The first trials are submitted in the same transaction: a sweep whose trials would be
    # refused (a group too small, a dependency) is refused whole, nothing stored. Their
    # errors name the task's field (`task.resource_groups.0.name`), beside the form's.
    try:
        _submit_next(session, sweep, now=utcnow())
    except ServiceError as exc:
        exc.field = f"task.{exc.field}" if exc.field else "task"
        raise
    except ValidationError as exc:
        raise _task_error(exc) from None
    session.commit()
    return sweep


# --- advance ------------------------------------------------------------------------------


def trial_tasks(session: Session, sweep_id: int) -> list[Task]:
    """The sweep's trials, in submission order."""
    return list(session.scalars(select(Task).where(Task.sweep_id == sweep_id).order_by(Task.id)))


def curves(session: Session, task_ids: Sequence[int], metric: str) -> dict[int, stopping.Curve]:
    """Each task's `metric` at each epoch (the epoch's last report; task-level rows only:
    no rank, or rank 0, the parameter server's), finite values only."""
    found: dict[int, stopping.Curve] = {task_id: {} for task_id in task_ids}
    if not task_ids:
        return found
    rows = session.execute(
        select(Metric.task_id, Metric.epoch, Metric.value)
        .where(
            Metric.task_id.in_(task_ids),
            Metric.name == metric,
            Metric.value.is_not(None),
            or_(Metric.rank.is_(None), Metric.rank == 0),
        )
        .order_by(Metric.step, Metric.id)
    )
    for task_id, epoch, value in rows:
        if value is not None:
            found[task_id][int(epoch)] = float(value)
    return found


def _stop_bad_trials(session: Session, sweep: Sweep, trials: list[Task]) -> list[int]:
    """Cancel each running trial the median stopping rule stops; returns their ids."""
    rule = sweep.stopping or {}
    if rule.get("rule", "median") != "median":
        return []
    by_task = curves(session, [t.id for t in trials], sweep.metric)
    stopped = []
    for task in trials:
        if task.status != TaskStatus.RUNNING or not by_task[task.id]:
            continue
        others = [by_task[t.id] for t in trials if t.id != task.id and by_task[t.id]]
        verdict = stopping.should_stop(
            by_task[task.id],
            others,
            goal=sweep.goal,
            min_trials=int(rule.get("min_trials", stopping.DEFAULT_MIN_TRIALS)),
            min_epochs=int(rule.get("min_epochs", stopping.DEFAULT_MIN_EPOCHS)),
        )
        if verdict is not None:
            lifecycle.transition(
                session, task, TaskStatus.CANCELLED, verdict.reason(sweep.metric, sweep.goal)
            )
            stopped.append(task.id)
    return stopped


def _busy_s(session: Session, trials: list[Task], now: datetime) -> dict[str, float]:
    """How many more seconds each group is busy with the sweep's unfinished trials: a
    started trial until its predicted end, one not started yet from when its groups are
    free (in submission order); a trial without a prediction holds its groups for ever."""
    busy: dict[str, float] = {}
    for task in trials:
        if task.status in TERMINAL:
            continue
        spec = read_spec(task)
        names = [g.name for g in spec.groups] or [i.name for i in spec.requested() if i.name]
        if spec.predicted_s is None:
            remaining = float("inf")
        elif task.started_at is not None:
            remaining = max(spec.predicted_s - (now - task.started_at).total_seconds(), 0.0)
        else:
            remaining = max((busy.get(n, 0.0) for n in names), default=0.0) + spec.predicted_s
        for name in names:
            busy[name] = max(busy.get(name, 0.0), remaining)
    return busy


def _trial_request(
    session: Session, sweep: Sweep, index: int, trials: list[Task], now: datetime
) -> TaskCreate:
    """Trial `index`'s submission: the base task with its hyperparameters set, placed by
    the plan's model when the sweep has one (`placement.place_trial`)."""
    base = dict(sweep.base)
    body: dict[str, Any] = {
        **base,
        "project_id": sweep.project_id,
        "code_version_id": sweep.code_version_id,
        "name": f"{sweep.name} · trial {index + 1}"[:200],
        "hyperparameters": {**(base.get("hyperparameters") or {}), **sweep.trials[index]},
    }
    plan = session.get(Plan, sweep.plan_id) if sweep.plan_id is not None else None
    if plan is not None and plan.model is not None:
        model = dataclasses.replace(
            performance.PerformanceModel.from_json(plan.model),
            sync_period=int(base.get("sync_period") or 1),
        )
        try:
            chosen = placement.place_trial(
                model,
                _busy_s(session, trials, now),
                global_batch_size=int(base["global_batch_size"]),
                epochs=int(base["epochs"]),
                split_policy=str(base.get("split_policy", "even")),
                guard=bool(base.get("guard", True)),
            )
        except ValueError:
            log.warning("sweep %s: the plan places no trial; the task's own groups", sweep.id)
        else:
            prediction = chosen.prediction
            body["resource_groups"] = [
                group_item(prediction, name, workers)
                for name, workers in prediction.workers.items()
            ]
            body["plan_id"] = plan.id
            if len(prediction.workers) < 2:
                body.pop("quorum", None)  # one group: no quorum to wait for
    return TaskCreate.model_validate(body)


def _submit_next(session: Session, sweep: Sweep, *, now: datetime) -> list[Task]:
    """Submit trials while fewer than `parallel` are unfinished and some are still to go;
    the caller commits. Raises ServiceError when a trial is refused."""
    trials = trial_tasks(session, sweep.id)
    running = sum(1 for t in trials if t.status not in TERMINAL)
    added = []
    while running < sweep.parallel and sweep.submitted < len(sweep.trials):
        request = _trial_request(session, sweep, sweep.submitted, trials, now)
        task = tasks.submit(session, data=request, commit=False)
        task.sweep_id = sweep.id
        session.flush()
        sweep.submitted += 1
        trials.append(task)
        added.append(task)
        running += 1
    return added


def locked(session: Session, sweep_id: int) -> Sweep:
    """The sweep re-read with its row locked until the transaction ends (`FOR UPDATE` on
    PostgreSQL; SQLite runs one writer at a time), so that `advance` and `cancel`, which may
    run in different processes, take turns: whichever comes second sees what the first
    committed."""
    return session.get_one(Sweep, sweep_id, with_for_update=True, populate_existing=True)


def _reported_names(session: Session, task_ids: Sequence[int]) -> dict[int, set[str]]:
    """The epoch metrics each task reported (neither per-step series nor resource samples)."""
    found: dict[int, set[str]] = {task_id: set() for task_id in task_ids}
    if not task_ids:
        return found
    rows = session.execute(
        select(Metric.task_id, Metric.name)
        .where(Metric.task_id.in_(task_ids), Metric.name.not_in(RESOURCE_METRICS))
        .distinct()
    )
    for task_id, name in rows:
        if not name.startswith(STEP_SERIES):
            found[task_id].add(name)
    return found


def _metric_missing(session: Session, sweep: Sweep, trials: list[Task]) -> str | None:
    """Why the sweep cannot be judged: a trial SUCCEEDED without ever reporting its metric
    (a typo in `metric`, or code that reports another name); None if none did."""
    done = [t for t in trials if t.status == TaskStatus.SUCCEEDED]
    names = _reported_names(session, [t.id for t in done])
    for task in done:
        if sweep.metric not in names[task.id]:
            index = trials.index(task) + 1
            seen = ", ".join(sorted(names[task.id])) or "none"
            return (
                f"trial {index} (task {task.id}) succeeded without reporting the metric "
                f"{sweep.metric!r}; it reported: {seen}"
            )
    return None


def advance(session: Session, sweep: Sweep, *, now: datetime | None = None) -> dict[str, list[int]]:
    """One step of a running sweep, committed: stop the trials the median rule stops, submit
    the next trials up to `parallel` unfinished, and finish the sweep once every planned
    trial has ended. A trial refused at submission fails the sweep, with the reason (the
    trials stopped in the same step stay stopped); so does a trial that succeeded without
    reporting the sweep's metric (its unfinished trials are cancelled: none could be judged).
    The sweep's row is locked first (`locked`), so a `cancel` in another process waits, or
    has happened and nothing is done. Returns the ids of the trials `stopped` and
    `submitted`."""
    sweep = locked(session, sweep.id)
    if sweep.status != SweepStatus.RUNNING:
        session.commit()
        return {"stopped": [], "submitted": []}
    now = now or utcnow()
    trials = trial_tasks(session, sweep.id)
    missing = _metric_missing(session, sweep, trials)
    if missing is not None:
        _end(session, sweep, trials, SweepStatus.FAILED, missing)
        session.commit()
        return {"stopped": [], "submitted": []}
    stopped = _stop_bad_trials(session, sweep, trials)
    session.flush()
    try:
        with session.begin_nested():  # a refusal undoes the submission, not the stops
            added = _submit_next(session, sweep, now=now)
    except (ServiceError, ValidationError) as exc:
        message = exc.message if isinstance(exc, ServiceError) else str(exc)
        _finish(sweep, SweepStatus.FAILED, f"trial {sweep.submitted + 1} refused: {message}")
        session.commit()
        return {"stopped": stopped, "submitted": []}
    trials = trial_tasks(session, sweep.id)
    if sweep.submitted >= len(sweep.trials) and all(t.status in TERMINAL for t in trials):
        _finish(sweep, SweepStatus.FINISHED, f"{len(trials)} trials ended")
    session.commit()
    return {"stopped": stopped, "submitted": [t.id for t in added]}


def advance_all(session: Session) -> int:
    """`advance` every running sweep (the scheduler's pass); one that fails is logged and
    left for the next pass. Returns how many trials were submitted or stopped."""
    ids = list(session.scalars(select(Sweep.id).where(Sweep.status == SweepStatus.RUNNING)))
    moved = 0
    for sweep_id in ids:
        try:
            sweep = session.get(Sweep, sweep_id)
            if sweep is not None:
                done = advance(session, sweep)
                moved += len(done["stopped"]) + len(done["submitted"])
        except Exception:  # one sweep's trouble must not stop the scheduler
            session.rollback()
            log.exception("sweep %s: advancing failed", sweep_id)
    return moved


def _finish(sweep: Sweep, status: SweepStatus, reason: str) -> None:
    sweep.status = status
    sweep.reason = reason
    sweep.finished_at = utcnow()


def _end(
    session: Session, sweep: Sweep, trials: list[Task], status: SweepStatus, reason: str
) -> None:
    """End the sweep with `reason` and cancel its unfinished trials; the caller commits."""
    why = f"sweep {sweep.id} {'cancelled' if status == SweepStatus.CANCELLED else 'failed'}"
    for task in trials:
        if task.status not in TERMINAL:
            lifecycle.transition(session, task, TaskStatus.CANCELLED, why)
    _finish(sweep, status, reason)


# --- cancel and read ----------------------------------------------------------------------


def cancel(session: Session, *, sweep: Sweep) -> Sweep:
    """Cancel a running sweep and every unfinished trial of it; none more is submitted.
    The sweep's row is locked first (`locked`): an `advance` under way in the scheduler
    commits its trials before, and they are cancelled too.

    Raises:
        Conflict: the sweep has already ended.
    """
    sweep = locked(session, sweep.id)
    if sweep.status != SweepStatus.RUNNING:
        session.rollback()
        raise Conflict(
            f"sweep {sweep.id} is {sweep.status}; it cannot be cancelled", field="status"
        )
    _end(session, sweep, trial_tasks(session, sweep.id), SweepStatus.CANCELLED, "cancelled by user")
    session.commit()
    return sweep


def get(session: Session, *, sweep_id: int) -> Sweep:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise NotFound(f"sweep {sweep_id} does not exist", field="sweep_id")
    return sweep


def _listing(project_id: int | None, project_ids: list[int] | None, status: str | None):  # type: ignore[no-untyped-def]
    query = select(Sweep)
    if project_id is not None:
        query = query.where(Sweep.project_id == project_id)
    if project_ids is not None:
        query = query.where(Sweep.project_id.in_(project_ids))
    if status is not None:
        query = query.where(Sweep.status == status)
    return query


def list_sweeps(
    session: Session,
    *,
    project_id: int | None = None,
    project_ids: list[int] | None = None,
    status: str | None = None,
    offset: int = 0,
    limit: int = 100,
) -> tuple[list[Sweep], int]:
    """Sweeps (newest first) of one project, or of `project_ids` (None: every one), and
    how many there are."""
    query = _listing(project_id, project_ids, status)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(query.order_by(Sweep.id.desc()).offset(offset).limit(limit))
    return list(rows), int(total)


def summary(sweep: Sweep) -> dict[str, Any]:
    """The sweep as `SweepRead`."""
    return {
        "id": sweep.id,
        "project_id": sweep.project_id,
        "code_version_id": sweep.code_version_id,
        "name": sweep.name,
        "status": sweep.status,
        "reason": sweep.reason,
        "algorithm": sweep.algorithm,
        "space": sweep.space,
        "task": sweep.base,
        "planned": len(sweep.trials),
        "submitted": sweep.submitted,
        "parallel": sweep.parallel,
        "metric": sweep.metric,
        "goal": sweep.goal,
        "seed": sweep.seed,
        "stopping": sweep.stopping,
        "plan_id": sweep.plan_id,
        "created_at": sweep.created_at,
        "finished_at": sweep.finished_at,
    }


def _trial_row(sweep: Sweep, index: int, task: Task, curve: stopping.Curve) -> dict[str, Any]:
    spec = read_spec(task)
    values = spec.hyperparameters or {}
    searched = {name: values[name] for name in sweep.space if name in values}
    return {
        "index": index + 1,
        "task_id": task.id,
        "name": task.name,
        "status": str(task.status),
        "status_reason": task.status_reason,
        "hyperparameters": searched,
        "groups": [g.name for g in spec.groups] or [i.name or "" for i in spec.requested()],
        "objective": stopping.objective(curve, sweep.goal),
        "epochs": len(curve),
        "curve": dict(sorted(curve.items())),
        "stopped_early": task.status == TaskStatus.CANCELLED
        and task.status_reason.startswith(STOP_PREFIX),
    }


def detail(session: Session, sweep: Sweep) -> dict[str, Any]:
    """The sweep as `SweepDetail`: its trials, the best (the best objective; ties: the
    earlier trial) and the hyperparameters still to submit."""
    trials = trial_tasks(session, sweep.id)
    by_task = curves(session, [t.id for t in trials], sweep.metric)
    rows = [_trial_row(sweep, i, t, by_task[t.id]) for i, t in enumerate(trials)]
    scored = [r for r in rows if r["objective"] is not None]
    sign = 1 if sweep.goal == "min" else -1
    best = min(scored, key=lambda r: (sign * r["objective"], r["index"])) if scored else None
    return {
        **summary(sweep),
        "trials": rows,
        "best": best,
        "pending": list(sweep.trials[sweep.submitted :]),
    }
