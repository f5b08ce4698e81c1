"""A shrunk task takes a group that comes back in again at its next epoch end
(`backend.scheduler.regrow`): a planned restart on its whole request, booked in the same
transaction, resuming from the epoch-end checkpoint, not counted against `max_restarts`."""

import threading
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.config import get_settings
from backend.core.db import get_sessionmaker, utcnow
from backend.resource_groups.models import ResourceGroup
from backend.scheduler import capacity
from backend.scheduler.service import schedule_next, schedule_once
from backend.tasks import fate, lifecycle, reports
from backend.tasks.models import (
    Allocation,
    Checkpoint,
    EventKind,
    NodeRole,
    SubTask,
    SubTaskStatus,
    Task,
    TaskEvent,
)
from backend.tasks.models import TaskStatus as S
from contracts.agent_api import Claim
from tests.backend.scheduling import (
    RecordingDispatcher,
    group,
    held,
    running_task,
    submit,
    version,
)
from tests.conftest import agent_headers

pytestmark = pytest.mark.stack

WHOLE = [("cpu-a", 2), ("cpu-b", 1)]


def _groups(task: Task) -> list[tuple[str, int]]:
    return [(g["name"], g["workers"]) for g in task.spec["groups"]]


def _claim_all(session: Session, task: Task) -> None:
    """The agents claim every part of the task's current attempt: RUNNING."""
    session.refresh(task)
    for sub in session.scalars(
        select(SubTask).where(SubTask.task_id == task.id, SubTask.attempt == task.attempt)
    ).all():
        agent = session.get_one(Agent, sub.agent_id)
        fate.claim(
            session, sub=sub, data=Claim(agent_id=agent.id, host=agent.host, attempt=sub.attempt)
        )
    session.refresh(task)
    assert task.status is S.RUNNING


def _lose(session: Session, agent_name: str) -> None:
    """The agent stops heartbeating; one scheduler pass notices, restarts and places."""
    session.execute(
        update(Agent)
        .where(Agent.name == agent_name)
        .values(last_heartbeat_at=utcnow() - timedelta(seconds=60))
    )
    session.commit()
    schedule_once(session, RecordingDispatcher(), heartbeat_timeout_s=15)


def _back(session: Session, agent_name: str = "agent-cpu-b") -> None:
    """The agent heartbeats again: online, active."""
    session.execute(
        update(Agent)
        .where(Agent.name == agent_name)
        .values(online=True, last_heartbeat_at=utcnow())
    )
    session.commit()


def _shrunk(session: Session, **extra: Any) -> Task:
    """cpu-a ×2 and cpu-b ×1, no spare capacity; cpu-b's agent dies: attempt 2 runs on cpu-a
    alone (`shrink`, the default on several groups)."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session, **{"epochs": 3, **extra})
    _lose(session, "agent-cpu-b")
    _claim_all(session, task)
    assert task.attempt == 2 and _groups(task) == [("cpu-a", 2)]
    return task


def _upload(
    session: Session, task: Task, name: str, *, epoch: int, step: int, attempt: int | None = None
) -> Checkpoint:
    """What the agents' upload route does (`reports.save_checkpoint`)."""
    return reports.save_checkpoint(
        session,
        task=task,
        directory=get_settings().checkpoint_dir,
        name=name,
        epoch=epoch,
        step=step,
        body=f"{task.id}:{attempt or task.attempt}:{name}".encode(),
        attempt=attempt or task.attempt,
    )


def _parts(session: Session, task: Task, attempt: int) -> list[tuple[str, int, int | None]]:
    """The booked parts of one attempt: (group, workers, agent), in rank order."""
    rows = session.execute(
        select(ResourceGroup.name, SubTask.workers, SubTask.agent_id)
        .join(ResourceGroup, ResourceGroup.id == SubTask.resource_group_id)
        .where(SubTask.task_id == task.id, SubTask.attempt == attempt)
        .order_by(SubTask.first_rank)
    )
    return [tuple(row) for row in rows]  # type: ignore[misc]


def _nodes(session: Session, task: Task, attempt: int) -> list[tuple[str, int | None]]:
    """The attempt's compute nodes still held: (group, rank)."""
    rows = session.execute(
        select(ResourceGroup.name, Allocation.rank)
        .join(ResourceGroup, ResourceGroup.id == Allocation.resource_group_id)
        .where(
            Allocation.task_id == task.id,
            Allocation.attempt == attempt,
            Allocation.role == NodeRole.COMPUTE,
            Allocation.released_at.is_(None),
        )
        .order_by(Allocation.rank)
    )
    return [tuple(row) for row in rows]  # type: ignore[misc]


def _events(session: Session, task: Task) -> list[tuple[EventKind, S, str]]:
    rows = session.execute(
        select(TaskEvent.kind, TaskEvent.to_status, TaskEvent.reason)
        .where(TaskEvent.task_id == task.id)
        .order_by(TaskEvent.id)
    )
    return [tuple(row) for row in rows]  # type: ignore[misc]


def _agent_id(session: Session, name: str) -> int:
    return session.scalars(select(Agent.id).where(Agent.name == name)).one()


def test_a_returning_group_is_taken_in_again_at_the_next_epoch_end(
    client: TestClient, session: Session
) -> None:
    task = _shrunk(session)
    _back(session)
    before = _events(session, task)
    # The engine's epoch-end checkpoint of the shrunk attempt, through the agents' route.
    uploaded = client.post(
        f"/internal/v1/tasks/{task.id}/checkpoints",
        headers=agent_headers(),
        params={"name": "epoch-0.pt", "epoch": 0, "step": 40, "attempt": 2},
        content=b"epoch 0 on cpu-a",
    )
    assert uploaded.status_code == 200, uploaded.text
    epoch_end = uploaded.json()["id"]
    session.commit()
    session.refresh(task)

    # A new attempt, booked on the whole request in the same transaction.
    assert task.status is S.SCHEDULED and task.attempt == 3
    assert _groups(task) == WHOLE
    a, b = _agent_id(session, "agent-cpu-a"), _agent_id(session, "agent-cpu-b")
    assert _parts(session, task, 3) == [("cpu-a", 2, a), ("cpu-b", 1, b)]
    assert _nodes(session, task, 3) == [("cpu-a", 1), ("cpu-a", 2), ("cpu-b", 3)]
    assert _nodes(session, task, 2) == [], "the shrunk attempt's nodes are released"
    assert {s.status for s in session.scalars(select(SubTask).filter_by(attempt=2))} == {
        SubTaskStatus.ABORTED
    }
    assert (held(session, "cpu-a"), held(session, "cpu-b")) == (2, 1)

    # Its timeline: no alarm, the reason, and the restart is not counted.
    reason = "group cpu-b is back: taken in again from epoch 1"
    assert _events(session, task)[len(before) :] == [
        (EventKind.STATUS, S.RESTARTING, reason + lifecycle.PLANNED),
        (EventKind.STATUS, S.QUEUED, f"attempt 3 queued: {reason}"),
        (
            EventKind.STATUS,
            S.SCHEDULED,
            "attempt 3: allocated parameter server and 3 workers: cpu-a×2, cpu-b×1",
        ),
    ]
    assert lifecycle.planned_restarts(session, task) == 1
    assert task.attempt - 1 - lifecycle.planned_restarts(session, task) == 1, "the loss only"

    # The shrunk attempt's ranks go on until they notice: a step checkpoint of epoch 1
    # arrives late. The new attempt still resumes from the epoch-end checkpoint.
    late = _upload(session, task, "step-45.pt", epoch=1, step=45, attempt=2)
    session.refresh(task)
    assert task.attempt == 3 and late.step > 40
    dispatcher = RecordingDispatcher()
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    assert [(p.group.name, p.attempt, p.resume_checkpoint_id) for p in dispatcher.sent] == [
        ("cpu-a", 3, epoch_end),
        ("cpu-b", 3, epoch_end),
    ]
    assert [g.name for g in dispatcher.sent[0].groups] == ["cpu-a", "cpu-b"]


def test_a_planned_restart_leaves_the_task_its_restarts(session: Session) -> None:
    task = _shrunk(session)  # max_restarts=2; the loss took one
    _back(session)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.attempt == 3
    _claim_all(session, task)
    assert lifecycle.restart_or_fail(session, task, "a rank was killed")
    session.commit()
    assert task.attempt == 4 and task.status is S.QUEUED
    assert task.status_reason == "attempt 4 of 4 queued after: a rank was killed"
    schedule_once(session, RecordingDispatcher(), heartbeat_timeout_s=15)
    _claim_all(session, task)
    assert not lifecycle.restart_or_fail(session, task, "a rank was killed again")
    session.commit()
    assert task.status is S.FAILED and "no restart left (max_restarts=2)" in task.status_reason


def test_a_failure_restart_after_a_regrow_resumes_from_the_newest_checkpoint(
    session: Session,
) -> None:
    task = _shrunk(session)
    _back(session)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    _claim_all(session, task)
    newest = _upload(session, task, "step-50.pt", epoch=1, step=50)
    lifecycle.restart_or_fail(session, task, "a rank was killed")
    session.commit()
    dispatcher = RecordingDispatcher()
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    assert {p.resume_checkpoint_id for p in dispatcher.sent} == {newest.id}


def test_a_step_checkpoint_does_not_regrow(session: Session) -> None:
    task = _shrunk(session)
    _back(session)
    _upload(session, task, "step-20.pt", epoch=0, step=20)
    session.refresh(task)
    assert task.status is S.RUNNING and task.attempt == 2 and _groups(task) == [("cpu-a", 2)]
    assert held(session, "cpu-b") == 0


def test_without_room_it_stays_shrunk_and_checks_again_at_the_next_epoch_end(
    session: Session,
) -> None:
    task = _shrunk(session)
    _back(session)
    other = submit(session, version(session, name="q"), [{"name": "cpu-b", "workers": 1}])
    assert schedule_next(session) == other.id  # takes cpu-b's one worker
    before = _events(session, task)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.status is S.RUNNING and task.attempt == 2 and _groups(task) == [("cpu-a", 2)]
    assert _nodes(session, task, 2) == [("cpu-a", 1), ("cpu-a", 2)], "still held"
    assert _events(session, task) == before

    lifecycle.transition(session, other, S.CANCELLED, "test")  # cpu-b is free again
    session.commit()
    _upload(session, task, "step-60.pt", epoch=1, step=60)  # mid-epoch: waits for its end
    session.refresh(task)
    assert task.attempt == 2
    epoch_end = _upload(session, task, "epoch-1.pt", epoch=1, step=80)
    session.refresh(task)
    assert task.status is S.SCHEDULED and task.attempt == 3 and _groups(task) == WHOLE
    assert task.status_reason.startswith("attempt 3: allocated")
    assert _events(session, task)[-2][2] == (
        "attempt 3 queued: group cpu-b is back: taken in again from epoch 2"
    )
    dispatcher = RecordingDispatcher()
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    assert {p.resume_checkpoint_id for p in dispatcher.sent} == {epoch_end.id}


def test_an_agent_back_without_enough_workers_is_no_room(session: Session) -> None:
    task = _shrunk(session)
    session.execute(update(Agent).where(Agent.name == "agent-cpu-b").values(workers=0))
    _back(session)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.attempt == 2 and task.status is S.RUNNING


def test_the_last_epochs_end_does_not_regrow(session: Session) -> None:
    task = _shrunk(session, epochs=2)
    _back(session)
    _upload(session, task, "epoch-1.pt", epoch=1, step=80)
    session.refresh(task)
    assert task.status is S.RUNNING and task.attempt == 2 and _groups(task) == [("cpu-a", 2)]


def test_a_task_cancelled_while_its_checkpoint_arrives_stays_cancelled(
    session: Session,
) -> None:
    # The upload's session read the task RUNNING; another writer cancelled it since: the
    # regrow, under its locks, finds no RUNNING task and changes nothing.
    task = _shrunk(session)
    _back(session)
    with get_sessionmaker()() as other:
        lifecycle.transition(other, other.get_one(Task, task.id), S.CANCELLED, "by user")
        other.commit()
    assert task.status is S.RUNNING  # the upload's stale copy
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.status is S.CANCELLED and task.attempt == 2
    assert _parts(session, task, 3) == []


def test_periodic_is_not_regrown(session: Session) -> None:
    # One optimizer state per group: a new layout would drop it, so the task stays shrunk.
    task = _shrunk(session, sync_strategy="periodic", sync_period=2)
    _back(session)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.status is S.RUNNING and task.attempt == 2 and _groups(task) == [("cpu-a", 2)]


@pytest.mark.parametrize("policy", ["restart", "wait"])
def test_restart_and_wait_are_not_regrown(session: Session, policy: str) -> None:
    # A whole task with these policies: an epoch end changes nothing.
    for name, capacity_ in (("cpu-a", 2), ("cpu-b", 1), ("cpu-c", 1)):
        group(session, name, capacity_)
    whole = running_task(session, epochs=3, on_group_loss=policy)
    _upload(session, whole, "epoch-0.pt", epoch=0, step=40)
    session.refresh(whole)
    assert whole.attempt == 1 and whole.status is S.RUNNING
    # Nor one running short of its request (the policy read from its spec).
    lifecycle.transition(session, whole, S.CANCELLED, "test")
    session.commit()
    task = _shrunk_by_hand(session, policy)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.attempt == 2 and task.status is S.RUNNING and _groups(task) == [("cpu-a", 2)]


def _shrunk_by_hand(session: Session, policy: str) -> Task:
    """A task with `policy` running on cpu-a alone, as a shrink would have left it."""
    task = running_task(session, epochs=3, on_group_loss="shrink")
    session.execute(update(Agent).where(Agent.name == "agent-cpu-c").values(online=False))
    session.commit()
    _lose(session, "agent-cpu-b")
    _back(session)
    _claim_all(session, task)
    assert _groups(task) == [("cpu-a", 2)]
    task.spec = {**task.spec, "on_group_loss": policy}
    session.commit()
    return task


def test_a_task_not_shrunk_is_not_regrown(session: Session) -> None:
    for name, capacity_ in (("cpu-a", 2), ("cpu-b", 1), ("cpu-c", 1)):
        group(session, name, capacity_)
    task = running_task(session, epochs=3)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.attempt == 1 and task.status is S.RUNNING
    # Moved to a compatible group after a loss: whole, so not regrown either.
    _lose(session, "agent-cpu-b")
    _claim_all(session, task)
    assert _groups(task) == [("cpu-a", 2), ("cpu-c", 1)]
    _back(session)
    _upload(session, task, "epoch-1.pt", epoch=1, step=80)
    session.refresh(task)
    assert task.attempt == 2 and task.status is S.RUNNING


def test_an_earlier_attempts_or_a_repeated_upload_does_not_regrow(session: Session) -> None:
    task = _shrunk(session)
    _back(session)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40, attempt=1)  # sent late
    session.refresh(task)
    assert task.attempt == 2
    first = _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    session.refresh(task)
    assert task.attempt == 3
    again = _upload(session, task, "epoch-0.pt", epoch=0, step=40, attempt=2)  # a retry
    session.refresh(task)
    assert again.id == first.id and task.attempt == 3


def test_a_regrown_task_that_loses_a_group_again_shrinks_again(session: Session) -> None:
    task = _shrunk(session)
    _back(session)
    _upload(session, task, "epoch-0.pt", epoch=0, step=40)
    _claim_all(session, task)
    assert task.attempt == 3 and _groups(task) == WHOLE
    _lose(session, "agent-cpu-b")
    session.refresh(task)
    assert task.status is S.SCHEDULED and task.attempt == 4 and _groups(task) == [("cpu-a", 2)]
    assert task.attempt - 1 - lifecycle.planned_restarts(session, task) == 2
    # And comes back again at the next epoch end.
    _claim_all(session, task)
    _back(session)
    _upload(session, task, "epoch-1.pt", epoch=1, step=80)
    session.refresh(task)
    assert task.attempt == 5 and _groups(task) == WHOLE
    assert lifecycle.planned_restarts(session, task) == 2


def test_free_workers_returned_by_a_task_are_those_its_restart_frees(session: Session) -> None:
    task = _shrunk(session)
    _back(session)
    other = submit(session, version(session, name="q"), [{"name": "cpu-b", "workers": 1}])
    schedule_next(session)
    lifecycle.transition(session, other, S.CANCELLED, "test")
    session.commit()

    def seen(free: dict[str, capacity.GroupFree]) -> dict[str, tuple[int, list[int]]]:
        return {n: (g.free, [a.free for a in g.agents or []]) for n, g in free.items()}

    returned = seen(capacity.free_capacity(session, returned_by=task.id))
    assert returned == {"cpu-a": (2, [2]), "cpu-b": (1, [1])}
    assert seen(capacity.free_capacity(session))["cpu-a"] == (0, [0])
    lifecycle.restart_or_fail(session, task, "test")
    session.flush()
    assert seen(capacity.free_capacity(session)) == returned
    session.rollback()


def test_the_allocation_lock_makes_bookers_take_turns(session: Session) -> None:
    """A request that books (a regrow) and the scheduler never read free workers at once: on
    SQLite too (a lock of the process's threads), released when the transaction ends."""
    group(session, "cpu-a", 1)
    order: list[str] = []

    def other() -> None:
        with get_sessionmaker()() as second:
            capacity.lock_allocation(second)
            order.append("second has it")
            second.rollback()

    capacity.lock_allocation(session)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=0.5)
    order.append("first ends")
    session.commit()
    thread.join(timeout=30)
    assert order == ["first ends", "second has it"]
    capacity.lock_allocation(session)
    session.close()  # a closed session releases it too
    thread = threading.Thread(target=other)
    thread.start()
    thread.join(timeout=30)
    assert order[-1] == "second has it" and len(order) == 3
