"""First-level dispatch: one Celery message per sub-task (a group's part on one agent), on
that agent's queue.

The only place that publishes to a group's queues. Each scheduler pass first books the
parts no agent holds (:func:`rebook_parts`), then publishes every current-attempt sub-task
not yet published, or unclaimed for too long (a message lost with a broker restart), after
making the pass's decisions durable (:func:`make_durable`).
"""

import logging
from datetime import timedelta
from functools import lru_cache
from typing import Protocol

from celery import Celery
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import SERVING, Agent
from backend.core.config import get_settings
from backend.core.db import utcnow
from backend.projects.models import CodeVersion
from backend.scheduler import capacity, regrow
from backend.tasks import lifecycle
from backend.tasks.models import ACTIVE, Checkpoint, SubTask, SubTaskStatus, Task
from backend.tasks.spec import read_spec
from contracts.messaging import RUN_SUBTASK, broker_options, queue_name
from contracts.packages import Environment
from contracts.payload import SubTaskPayload, TaskLimits

log = logging.getLogger(__name__)


class Dispatcher(Protocol):
    def send(self, payload: SubTaskPayload) -> None: ...


@lru_cache
def producer_app() -> Celery:
    """A Celery app used only to publish (the agents define the consumer side)."""
    broker = get_settings().resolved_broker_url()
    app = Celery("polytrain-api", broker=broker)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_transport_options=broker_options(broker),
    )
    return app


class CeleryDispatcher:
    """Publishes sub-task messages; the Celery task id is the sub-task's database id.

    Raises whatever kombu raises when the broker stays unreachable (after a few
    quick retries): the sub-task then stays undispatched and is sent again.
    """

    def send(self, payload: SubTaskPayload) -> None:
        if payload.agent_id is None:
            raise ValueError(f"sub-task {payload.sub_task_id} is booked for no agent")
        producer_app().send_task(
            RUN_SUBTASK,
            args=[payload.model_dump(mode="json")],
            queue=queue_name(payload.group.name, payload.agent_id),
            task_id=str(payload.sub_task_id),
            retry=True,
            retry_policy={
                "max_retries": 2,
                "interval_start": 0.2,
                "interval_step": 0.5,
                "interval_max": 1.0,
            },
        )


def payload_for(
    task: Task,
    sub: SubTask,
    *,
    resume_checkpoint_id: int | None = None,
    environment: Environment | None = None,
) -> SubTaskPayload:
    """The message for one sub-task of the task's current attempt: the placed groups (with
    their speed factors, own sharding and max_local_batch), the part's ranks and agent, the
    engine options, the checkpoint to resume from and the code version's environment
    (:func:`environment_of`).

    Raises:
        ValueError: the stored spec has no epochs or global batch size.
    """
    spec = read_spec(task)
    if spec.epochs is None or spec.global_batch_size is None:
        raise ValueError(f"task {task.id}'s spec has no epochs or global batch size")
    groups = [
        g.model_copy(
            update={
                "speed_factor": spec.speed_factor(g),
                "sharding": spec.sharding_of(g),
                "max_local_batch": spec.max_local_batch_of(g),
            }
        )
        for g in spec.groups
    ]
    return SubTaskPayload(
        task_id=task.id,
        sub_task_id=sub.id,
        group_index=sub.group_index,
        part=sub.part,
        agent_id=sub.agent_id,
        first_rank=sub.first_rank,
        part_workers=sub.workers,
        hosts_parameter_server=sub.hosts_parameter_server,
        epochs=spec.epochs,
        global_batch_size=spec.global_batch_size,
        seed=spec.seed,
        split_policy=spec.split_policy,
        groups=groups,
        engine=spec.engine_options(),
        attempt=sub.attempt,
        resume_checkpoint_id=resume_checkpoint_id,
        limits=spec.limits or TaskLimits(),
        environment=environment,
    )


def environment_of(session: Session, task: Task) -> Environment | None:
    """The task's code version's own packages (its lock), or None when it has none."""
    version = session.get_one(CodeVersion, task.code_version_id)
    if version.lock is None or version.lock_hash is None:
        return None
    return Environment(lock_hash=version.lock_hash, lock=version.lock)


def last_checkpoint(session: Session, *, task_id: int) -> Checkpoint | None:
    """The task's newest whole checkpoint (most steps), from any attempt: one whose sharded
    state's files are not all stored yet (their workers upload them beside it) is passed over."""
    newest = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.task_id == task_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
    )
    return next((c for c in newest if not c.missing_parts()), None)


def resume_checkpoint(session: Session, task: Task) -> Checkpoint | None:
    """The checkpoint the task's current attempt resumes from: none for the first; after a
    planned restart (a shrunk task taken in again at an epoch end:
    :mod:`backend.scheduler.regrow`) the newest epoch-end checkpoint, so the attempt starts
    the next epoch on its whole request even when the shrunk attempt uploaded a step
    checkpoint of that epoch before it stopped; else the newest checkpoint
    (:func:`last_checkpoint`)."""
    if task.attempt == 1:
        return None
    if lifecycle.attempt_planned(session, task):
        ends = session.scalars(
            select(Checkpoint)
            .where(Checkpoint.task_id == task.id, Checkpoint.path.like("%epoch-%.pt"))
            .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        )
        for checkpoint in ends:
            if regrow.epoch_end(checkpoint) and not checkpoint.missing_parts():
                return checkpoint
    return last_checkpoint(session, task_id=task.id)


def make_durable(session: Session) -> None:
    """Wait until every transaction committed so far is on disk, then end the transaction.

    Scheduling decisions commit on PostgreSQL without waiting for the WAL flush
    (`service.schedule_next`); a transaction with a transaction id commits with
    the flush, which covers all earlier WAL. Called before a message leaves
    for the broker, so no agent ever acts on a decision a crash could undo;
    one flush per pass instead of one per decision. SQLite commits are durable.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_current_xact_id()))
        session.commit()


_UNCLAIMED = (
    Task.status.in_(ACTIVE),
    SubTask.attempt == Task.attempt,
    SubTask.status == SubTaskStatus.PENDING,
)


def rebook_parts(session: Session) -> int:
    """Book each unclaimed part whose agent cannot take it (no agent, or one no longer
    serving: offline, drained, disabled) for a serving agent of its group with enough free
    workers, the one with the most first; commits. A part no agent has room for stays
    unbound (tried again next pass; the monitor restarts its task once it waited a full
    heartbeat timeout). Returns the parts booked.
    """
    serving = select(Agent.id).where(Agent.id == SubTask.agent_id, SERVING).exists()
    unbound = (
        select(SubTask)
        .join(Task, Task.id == SubTask.task_id)
        .where(*_UNCLAIMED, SubTask.agent_id.is_(None) | ~serving)
        .order_by(SubTask.id)
    )
    if not session.scalars(unbound.limit(1)).first():
        return 0
    capacity.lock_allocation(session)
    # Read again under the lock: another scheduler (API process) may have booked them since.
    parts = session.scalars(unbound.execution_options(populate_existing=True)).all()
    if not parts:
        session.commit()
        return 0
    for part in parts:
        part.agent_id = None
    session.flush()  # their workers leave their former agents' free workers
    free = {
        g.id: {a.id: a.free for a in g.agents or []}
        for g in capacity.free_capacity(session, {p.resource_group_id for p in parts}).values()
    }
    # An agent runs at most one part of a task's attempt (its ranks are one process set).
    siblings = session.execute(
        select(SubTask.task_id, SubTask.agent_id)
        .join(Task, Task.id == SubTask.task_id)
        .where(
            SubTask.task_id.in_({p.task_id for p in parts}),
            SubTask.attempt == Task.attempt,
            SubTask.agent_id.is_not(None),
        )
    ).all()
    taken = {(task_id, agent_id) for task_id, agent_id in siblings}
    booked = 0
    for part in parts:
        room = free.get(part.resource_group_id, {})
        roomy = sorted(
            (a for a, n in room.items() if n >= part.workers and (part.task_id, a) not in taken),
            key=lambda a: -room[a],
        )
        if roomy:
            part.agent_id, part.dispatched_at = roomy[0], None
            room[roomy[0]] -= part.workers
            taken.add((part.task_id, roomy[0]))
            booked += 1
    session.commit()
    return booked


def dispatch_pending(session: Session, dispatcher: Dispatcher, *, redispatch_after_s: float) -> int:
    """Book the parts no agent holds (:func:`rebook_parts`), then publish each current-attempt
    sub-task booked for an agent and never published, or unclaimed for too long.

    A message lost with a broker restart is sent again; a duplicate is
    harmless (the agent's claim refuses a taken sub-task). Returns messages sent.
    """
    rebook_parts(session)
    stale = utcnow() - timedelta(seconds=redispatch_after_s)
    rows = session.execute(
        select(Task, SubTask)
        .join(SubTask, SubTask.task_id == Task.id)
        .where(
            *_UNCLAIMED,
            SubTask.agent_id.is_not(None),
            (SubTask.dispatched_at.is_(None)) | (SubTask.dispatched_at < stale),
        )
        .order_by(SubTask.id)
    ).all()
    if rows:
        make_durable(session)
    sent = 0
    resumes: dict[int, Checkpoint | None] = {}
    environments: dict[int, Environment | None] = {}
    for task, sub in rows:
        if task.id not in resumes:
            resumes[task.id] = resume_checkpoint(session, task)
            environments[task.id] = environment_of(session, task)
        resume = resumes[task.id]
        try:
            dispatcher.send(
                payload_for(
                    task,
                    sub,
                    resume_checkpoint_id=resume.id if resume else None,
                    environment=environments[task.id],
                )
            )
        except Exception:  # broker down: stays undispatched, sent again next pass
            log.warning("publishing sub-task %s failed; retrying next pass", sub.id, exc_info=True)
            session.rollback()
            return sent
        sub.dispatched_at = utcnow()
        session.commit()
        sent += 1
    return sent
