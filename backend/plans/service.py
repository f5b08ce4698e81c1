"""Plans: start the trial task, keep its timings, fit and read the performance model.

A plan's trial is a real task (scheduled, visible in the task list, cancellable, its workers
released when it ends) on every candidate group at once, with the engine option `trial`
(`contracts.trial.TrialOptions`): its ranks time the task's own step at three local batch
sizes (under `diloco` also at each group's share of the global batch, `trial_batch_sizes`)
and its exchanges at two sizes, and its parameter server reports the timings, which
`store_trial` keeps and fits (`backend.plans.performance`).
"""

import math
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.agents.models import SERVING, Agent
from backend.core.db import utcnow
from backend.core.errors import Conflict, NotFound
from backend.plans import performance
from backend.plans.models import Plan
from backend.plans.schemas import PlanCreate, PlanRead, PlanStatus, PredictionRead
from backend.resource_groups.models import LIVE, ResourceGroup
from backend.tasks import service as tasks
from backend.tasks.models import Task, TaskStatus
from backend.tasks.schemas import GroupRequest, TaskCreate
from backend.tasks.spec import read_spec
from contracts.payload import DEFAULT_MEMORY_LIMIT_MB
from contracts.plan import ROUND_STRATEGIES
from contracts.trial import TrialOptions, TrialResult


def trial_batch_sizes(
    global_batch_size: int, workers: int, *, round_workers: Sequence[int] = ()
) -> list[int]:
    """The local batch sizes a trial times: half, once and twice the even share
    ``ceil(G / W)``, distinct (at least two), and ``ceil(G / w)`` for each group size ``w``
    in ``round_workers``: the local batch of a ``diloco`` group of ``w`` workers, which
    steps at the global batch (worker/engine/strategy_diloco.py), outside the even share's
    range, where a step's cost per sample is not the line's (backend/plans/performance.py,
    ``GroupModel.step_s``). At most 8 sizes (``TrialOptions``): beyond, the smallest and
    largest ``diloco`` batch are kept, the ones between interpolated."""
    even = math.ceil(global_batch_size / workers)
    sizes = {max(1, even // 2), even, 2 * even}
    rounds = sorted({math.ceil(global_batch_size / w) for w in round_workers} - sizes)
    if len(sizes) + len(rounds) > 8:
        rounds = [rounds[0], rounds[-1]]
    return sorted(sizes | set(rounds))


def create(session: Session, *, data: PlanCreate) -> Plan:
    """Queue the plan's trial task and store the plan; nothing is stored if a check fails.

    Raises:
        NotFound: the project or code version does not exist.
        Invalid: a candidate group is unknown, draining, disabled or smaller than asked
            (field `resource_groups.<i>`), or the code version is another project's.
    """
    workers = sum(g.workers for g in data.resource_groups)
    many = len(data.resource_groups) > 1
    trial = TrialOptions(
        batch_sizes=trial_batch_sizes(
            data.global_batch_size,
            workers,
            round_workers=[g.workers for g in data.resource_groups]
            if data.sync_strategy == "diloco"
            else (),
        ),
        steps=data.trial_steps,
    )
    name = data.name or f"plan of code version {data.code_version_id}"
    task = tasks.submit(
        session,
        data=TaskCreate(
            project_id=data.project_id,
            code_version_id=data.code_version_id,
            name=f"trial: {name}"[:200],
            resource_groups=[
                GroupRequest(name=g.name, workers=g.workers) for g in data.resource_groups
            ],
            epochs=1,
            global_batch_size=max(data.global_batch_size, workers),
            sync_strategy=data.sync_strategy,
            sync_period=data.sync_period,
            quorum=min(data.quorum, len(data.resource_groups)) if data.quorum and many else None,
            on_disagreement="off",
            on_group_loss="restart",
            max_restarts=0,
            seed=data.seed,
            # room to measure the whole model where the planned limit will not hold it
            memory_limit_mb=max(data.memory_limit_mb, DEFAULT_MEMORY_LIMIT_MB),
            hyperparameters=data.hyperparameters,
        ),
        trial=trial,
        commit=False,
    )
    plan = Plan(
        project_id=data.project_id,
        name=name,
        request=data.model_dump(mode="json"),
        trial_task_id=task.id,
    )
    session.add(plan)
    session.commit()
    return plan


def get(session: Session, *, plan_id: int) -> Plan:
    plan = session.get(Plan, plan_id)
    if plan is None:
        raise NotFound(f"plan {plan_id} does not exist", field="plan_id")
    return plan


def list_plans(session: Session, *, project_ids: list[int] | None) -> Sequence[Plan]:
    query = select(Plan).order_by(Plan.id.desc())
    if project_ids is not None:
        query = query.where(Plan.project_id.in_(project_ids))
    return session.scalars(query).all()


def cancel(session: Session, *, plan: Plan) -> Plan:
    """Cancel the plan's trial task (its workers are released). Raises Conflict once the
    trial has ended."""
    task = session.get(Task, plan.trial_task_id) if plan.trial_task_id else None
    if task is None or task.status.terminal:
        raise Conflict(f"plan {plan.id}'s trial has ended", field="status")
    tasks.cancel(session, task=task, reason=f"plan {plan.id} cancelled")
    return plan


def store_trial(session: Session, *, task: Task, result: TrialResult) -> Plan:
    """Keep the timings the trial task's parameter server reported and fit the plan's model
    (a model that cannot be fitted fails the plan, with the reason in `error`).

    Raises:
        NotFound: the task is no plan's trial (field `task_id`).
    """
    plan = session.scalar(select(Plan).where(Plan.trial_task_id == task.id))
    if plan is None:
        raise NotFound(f"task {task.id} is not a plan's trial", field="task_id")
    request = PlanCreate.model_construct(**plan.request)
    spec = read_spec(task)
    asked = {g["name"]: g["workers"] for g in request.resource_groups}  # type: ignore[index]
    groups = [(g.name, g.device_type, asked.get(g.name, g.workers)) for g in spec.groups]
    plan.trial = result.model_dump(mode="json")
    try:
        model = performance.fit(
            result,
            groups,
            sync_strategy=request.sync_strategy,
            sync_period=request.sync_period,
            quorum=request.quorum,
            memory_limit_mb=request.memory_limit_mb or DEFAULT_MEMORY_LIMIT_MB,
            group_memory_mb=group_memory(session, groups),
        )
        plan.model, plan.error = model.to_json(), ""
    except ValueError as exc:
        plan.model, plan.error = None, f"the trial's timings cannot be fitted: {exc}"
    session.commit()
    return plan


CUDA_CONTEXT_MB = 512
"""Device memory a CUDA process's context takes, outside what torch's allocator reports (the
trial's device peaks): left out of a device's memory in the fit check."""


def group_memory(session: Session, groups: Sequence[tuple[str, str, int]]) -> dict[str, float]:
    """Each group's hardware memory a worker, in MiB, for the plan's fit check: on a CPU group
    the smallest host memory per worker among its serving agents (host RAM over the workers
    the agent runs); on a device group the smallest device memory its agents report, less a
    CUDA context (:data:`CUDA_CONTEXT_MB`), shared by the workers of an agent that runs more
    workers than it has devices. A group whose agents report none is left out (not known);
    the task's own ``memory_limit_mb`` bounds a CPU group's workers as well
    (``GroupModel.limit_mb``)."""
    found: dict[str, float] = {}
    for name, device_type, _ in groups:
        agents = session.scalars(
            select(Agent)
            .join(ResourceGroup, ResourceGroup.id == Agent.resource_group_id)
            .where(ResourceGroup.name == name, LIVE, SERVING)
        ).all()
        per_worker = []
        for agent in agents:
            hardware, workers = agent.hardware or {}, max(1, agent.workers)
            if device_type == "cpu" and hardware.get("memory_bytes"):
                per_worker.append(hardware["memory_bytes"] / 2**20 / workers)
            elif device_type != "cpu" and hardware.get("device_memory_mb"):
                devices = max(1, len(hardware.get("cuda_devices") or []))
                usable = max(0.0, float(hardware["device_memory_mb"]) - CUDA_CONTEXT_MB)
                per_worker.append(usable * min(1.0, devices / workers))
        if per_worker:
            found[name] = min(per_worker)
    return found


def status(session: Session, plan: Plan) -> tuple[PlanStatus, str]:
    """The plan's status and, when it failed, why."""
    if plan.model is not None:
        return "ready", ""
    if plan.error:
        return "failed", plan.error
    task = session.get(Task, plan.trial_task_id) if plan.trial_task_id else None
    if task is None:
        return "failed", "its trial task was deleted"
    if task.status is TaskStatus.CANCELLED:
        return "cancelled", task.status_reason
    if task.status.terminal:
        return "failed", f"the trial task ended {task.status.value}: {task.status_reason}"
    return "trial", ""


def _prediction(p: performance.Prediction) -> PredictionRead:
    return PredictionRead.model_validate(p, from_attributes=True)


def read(
    session: Session, *, plan: Plan, now: datetime | None = None, detail: bool = True
) -> PlanRead:
    """The plan with, once its model is fitted and with ``detail``, every prediction and the
    recommendation (the deadline counted from ``now``). A model that cannot predict (e.g.
    timings a trial's user code forged) reads as a failed plan saying why."""
    state, error = status(session, plan)
    request = PlanCreate.model_validate({**plan.request, "deadline": None}).model_copy(
        update={"deadline": _deadline(plan)}
    )
    answer = PlanRead(
        id=plan.id,
        project_id=plan.project_id,
        name=plan.name,
        status=state,
        error=error,
        request=plan.request,
        trial_task_id=plan.trial_task_id,
        created_at=plan.created_at,
        deadline=request.deadline,
    )
    if plan.model is None or not detail:
        return answer
    left = None
    if request.deadline is not None:
        left = (request.deadline.replace(tzinfo=None) - (now or utcnow())).total_seconds()
    try:
        found = performance.recommend(
            performance.PerformanceModel.from_json(plan.model),
            global_batch_size=request.global_batch_size,
            epochs=request.epochs,
            split_policies=request.split_policies,
            deadline_s=left,
        )
    except (ValueError, KeyError, TypeError, OverflowError, ZeroDivisionError) as exc:
        answer.status, answer.error = "failed", f"the plan's model cannot predict: {exc}"
        return answer
    answer.options = [_prediction(p) for p in found.options]
    answer.best = _prediction(found.best)
    answer.marginal_gain_s = found.marginal_gain_s
    answer.left_out = found.left_out
    answer.for_deadline = _prediction(found.for_deadline) if found.for_deadline else None
    answer.task_request = task_request(plan, request, found.for_deadline or found.best)
    return answer


def _deadline(plan: Plan) -> datetime | None:
    stored = plan.request.get("deadline")
    return datetime.fromisoformat(stored) if stored else None


def task_request(plan: Plan, request: PlanCreate, chosen: performance.Prediction) -> dict:
    """The task "Use this plan" submits: the chosen groups and workers and split policy,
    the plan's other settings, and `plan_id` (its ETA comes from the plan's model)."""
    body: dict = {
        "project_id": plan.project_id,
        "code_version_id": request.code_version_id,
        "name": request.name,
        "resource_groups": [group_item(chosen, n, w) for n, w in chosen.workers.items()],
        "global_batch_size": request.global_batch_size,
        "epochs": request.epochs,
        "split_policy": chosen.split_policy,
        "sync_strategy": request.sync_strategy,
        "seed": request.seed,
        "plan_id": plan.id,
        "memory_limit_mb": request.memory_limit_mb,
    }
    if request.sync_strategy in ROUND_STRATEGIES:
        body["sync_period"] = request.sync_period
    if request.sync_strategy == "quorum" and request.quorum and len(chosen.workers) > 1:
        body["quorum"] = min(request.quorum, len(chosen.workers))
    return body


def group_item(chosen: performance.Prediction, name: str, workers: int) -> dict[str, object]:
    """One group of the task a plan submits, with the sharding and the cap on a worker's
    share that its memory needs (:func:`backend.plans.performance.placements`)."""
    item: dict[str, object] = {"name": name, "workers": workers}
    if chosen.memory_mb.get(name) is not None:  # placed by its memory: whole or sharded, said
        item["sharding"] = chosen.sharding.get(name, "none")
    if chosen.max_local_batch.get(name) is not None:
        item["max_local_batch"] = chosen.max_local_batch[name]
    return item
