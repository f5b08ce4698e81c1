"""A task's predicted time from its plan's model, for its ETA before the first step
(`Task.finish_estimate`). Imports no other domain's service, so `backend.tasks` may use it."""

import dataclasses

from sqlalchemy.orm import Session

from backend.core.errors import Invalid
from backend.plans import performance
from backend.plans.models import Plan


def predicted_finish_s(
    session: Session,
    *,
    plan_id: int,
    project_id: int,
    workers: dict[str, int],
    global_batch_size: int,
    epochs: int,
    split_policy: str,
    sync_strategy: str,
    sync_period: int = 1,
    guard: bool = True,
    sharding: dict[str, str] | None = None,
    caps: dict[str, int | None] | None = None,
    memory_limit_mb: float | None = None,
) -> float:
    """Seconds a task of ``project_id`` on ``workers`` (group -> workers) is predicted to take
    from its start, by plan ``plan_id``'s model (with the guard's parking when ``guard``).

    Raises:
        Invalid (field `plan_id`): no such plan in the project, its model is not fitted yet,
            or a group of the task was not one of its candidates, or the task's sync
            strategy is not the one the plan timed.
        Invalid (field `memory_limit_mb`): with ``memory_limit_mb``, a group (held as
            ``sharding`` says, its share capped by ``caps``) is predicted to need more
            memory than it may hold (:func:`backend.plans.performance.memory_shortfall`).
    """
    plan = session.get(Plan, plan_id)
    if plan is None or plan.project_id != project_id:
        raise Invalid(f"plan {plan_id} is not a plan of this project", field="plan_id")
    if plan.model is None:
        raise Invalid(
            f"plan {plan_id} has no fitted model yet (its trial has not reported)", field="plan_id"
        )
    model = performance.PerformanceModel.from_json(plan.model)
    if sync_strategy != model.sync_strategy:
        raise Invalid(
            f"plan {plan_id} timed the exchange of sync_strategy {model.sync_strategy!r}, not "
            f"{sync_strategy!r}: plan again with this strategy",
            field="plan_id",
        )
    model = dataclasses.replace(
        model, sync_period=sync_period, memory_limit_mb=memory_limit_mb or model.memory_limit_mb
    )
    try:
        if memory_limit_mb is not None:
            short = performance.memory_shortfall(
                model,
                workers,
                sharding=sharding or {},
                caps=caps or {},
                memory_limit_mb=memory_limit_mb,
                global_batch_size=global_batch_size,
                split_policy=split_policy,
            )
            if short is not None:
                raise Invalid(f"plan {plan_id}: {short[1]}", field="memory_limit_mb")
        return performance.predict(
            model,
            workers,
            global_batch_size=global_batch_size,
            epochs=epochs,
            split_policy=split_policy,
            guard=guard,
        ).finish_s
    except KeyError as exc:
        raise Invalid(f"plan {plan_id}: {exc.args[0]}", field="plan_id") from None
    except performance.DoesNotFit as exc:  # e.g. caps or sharding the plan would not choose
        raise Invalid(f"plan {plan_id}: {exc}", field="memory_limit_mb") from None
    except ValueError as exc:
        raise Invalid(f"plan {plan_id} cannot predict this task: {exc}", field="plan_id") from None
