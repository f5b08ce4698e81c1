"""Failure handling: alarm, restart on healthy capacity (repair or migration), or fail."""

from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.db import utcnow
from backend.scheduler import monitor
from backend.scheduler.service import schedule_next, schedule_once
from backend.tasks import fate
from backend.tasks.models import Checkpoint, EventKind, SubTask, SubTaskStatus, Task, TaskEvent
from backend.tasks.models import TaskStatus as S
from contracts.agent_api import Claim, Finished
from tests.backend.scheduling import (
    RecordingDispatcher,
    group,
    held,
    running_task,
    submit,
    version,
)

pytestmark = pytest.mark.stack


def _subs(session: Session, task: Task) -> list[SubTask]:
    return list(
        session.scalars(
            select(SubTask)
            .where(SubTask.task_id == task.id, SubTask.attempt == task.attempt)
            .order_by(SubTask.group_index)
        )
    )


def _events(session: Session, task: Task) -> list[tuple[str, str]]:
    rows = session.scalars(
        select(TaskEvent).where(TaskEvent.task_id == task.id).order_by(TaskEvent.id)
    )
    return [(e.kind.value, e.to_status.value) for e in rows]


def _silence(session: Session, agent_name: str, seconds: float = 60) -> None:
    session.execute(
        update(Agent)
        .where(Agent.name == agent_name)
        .values(last_heartbeat_at=utcnow() - timedelta(seconds=seconds))
    )
    session.commit()


def test_dead_agent_alarms_restarts_and_migrates_to_a_compatible_group(session: Session) -> None:
    for name, capacity in (("cpu-a", 2), ("cpu-b", 1), ("cpu-c", 2)):
        group(session, name, capacity)
    task = running_task(session)
    session.add(Checkpoint(task_id=task.id, epoch=1, step=20, path="/x/epoch-1.pt", size_bytes=1))
    session.commit()
    _silence(session, "agent-cpu-a")
    dispatcher = RecordingDispatcher()
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    session.refresh(task)
    assert task.status is S.SCHEDULED and task.attempt == 2
    assert _events(session, task)[-4:] == [
        ("alarm", "RUNNING"),
        ("status", "RESTARTING"),
        ("status", "QUEUED"),
        ("status", "SCHEDULED"),
    ]
    alarm = session.scalar(select(TaskEvent).where(TaskEvent.kind == EventKind.ALARM))
    assert "agent 'agent-cpu-a'" in alarm.reason and "stopped sending heartbeats" in alarm.reason
    assert [g["name"] for g in task.spec["groups"]] == ["cpu-c", "cpu-b"]
    assert (held(session, "cpu-a"), held(session, "cpu-b"), held(session, "cpu-c")) == (0, 1, 2)
    old = session.scalars(select(SubTask).where(SubTask.task_id == task.id, SubTask.attempt == 1))
    assert {s.status for s in old} == {SubTaskStatus.ABORTED}
    assert {(p.attempt, p.resume_checkpoint_id) for p in dispatcher.sent} == {(2, 1)}


def test_restart_repairs_in_the_same_group_when_it_has_room(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    sub = _subs(session, task)[1]
    fate.finish(
        session,
        sub=sub,
        data=Finished(succeeded=False, cause="infra", detail="rank-3 exited with code -9"),
    )
    session.refresh(task)
    assert task.status is S.QUEUED and task.attempt == 2
    assert "rank-3 exited with code -9" in task.status_reason
    schedule_next(session)
    session.refresh(task)
    assert [g["name"] for g in task.spec["groups"]] == ["cpu-a", "cpu-b"]


def test_restarts_stop_at_max_restarts(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session, max_restarts=0)
    fate.finish(
        session,
        sub=_subs(session, task)[0],
        data=Finished(succeeded=False, cause="infra", detail="ps killed"),
    )
    session.refresh(task)
    assert task.status is S.FAILED
    assert "no restart left (max_restarts=0)" in task.status_reason
    assert held(session, "cpu-a") == 0


def test_user_error_fails_and_peer_errors_wait_for_the_root_cause(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    first, second = _subs(session, task)
    fate.finish(
        session,
        sub=second,
        data=Finished(succeeded=False, cause="peer", detail="Connection closed by peer"),
    )
    session.refresh(task)
    assert task.status is S.RUNNING
    fate.finish(
        session, sub=first, data=Finished(succeeded=False, cause="user", detail="ValueError: bad")
    )
    session.refresh(task)
    assert task.status is S.FAILED and "ValueError: bad" in task.status_reason


def test_only_peer_errors_everywhere_restart(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    for sub in _subs(session, task):
        fate.finish(
            session,
            sub=sub,
            data=Finished(succeeded=False, cause="peer", detail="Connection reset by peer"),
        )
    session.refresh(task)
    assert task.status is S.QUEUED and "every group lost its peers" in task.status_reason


def test_reports_of_an_old_attempt_are_ignored(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    old_first, old_second = _subs(session, task)
    fate.finish(session, sub=old_first, data=Finished(succeeded=False, cause="infra"))
    schedule_next(session)
    fate.finish(
        session, sub=old_second, data=Finished(succeeded=False, cause="stopped", detail="stopped")
    )
    session.refresh(task)
    assert task.status is S.SCHEDULED and task.attempt == 2
    with pytest.raises(Exception, match="attempt 1"):
        fate.claim(session, sub=old_second, data=Claim(agent_id=1, host="h"))


def test_unclaimed_sub_task_of_a_group_without_agents_is_restarted(session: Session) -> None:
    group(session, "cpu-a", 2)
    code = version(session)
    task = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    schedule_once(session, RecordingDispatcher(), heartbeat_timeout_s=15)
    session.execute(update(SubTask).values(dispatched_at=utcnow() - timedelta(seconds=60)))
    session.commit()
    _silence(session, "agent-cpu-a")
    assert monitor.check(session, timeout_s=15) == 1
    session.refresh(task)
    assert task.status is S.QUEUED
    assert "no active agent of its group is online" in task.status_reason


def test_agent_within_timeout_stays_online(session: Session) -> None:
    group(session, "cpu-a", 2)
    _silence(session, "agent-cpu-a", seconds=10)
    assert monitor.mark_stale_agents(session, timeout_s=15, interval_s=1) == 0
    _silence(session, "agent-cpu-a", seconds=14.5)
    assert monitor.mark_stale_agents(session, timeout_s=15, interval_s=1) == 1


def test_agent_that_registers_again_restarts_its_tasks(session: Session) -> None:
    from backend.agents import service as agents
    from backend.agents.schemas import AgentRegister

    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    session.execute(update(Agent).where(Agent.name == "agent-cpu-b").values(instance_id="0" * 32))
    agents.register(
        session,
        data=AgentRegister(  # the same agent (instance id), restarted
            name="agent-cpu-b",
            instance_id="0" * 32,
            host="10.77.0.9",
            resource_group="cpu-b",
            workers=1,
            hardware={"cpu_cores": 2, "memory_bytes": 1},
        ),
    )
    session.refresh(task)
    assert task.status is S.QUEUED and task.attempt == 2
    assert "agent 'agent-cpu-b' restarted" in task.status_reason
