"""An API (and so scheduler) restart raises no false heartbeat alarm.

While the API is down the agents' heartbeats fail; the scheduler of the new
process must give every agent one full heartbeat timeout from its own start
before it marks any offline and restarts its tasks.
"""

from datetime import timedelta

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.config import get_settings
from backend.core.db import utcnow
from backend.scheduler import monitor
from backend.scheduler.loop import SchedulerLoop
from backend.tasks.models import EventKind, Task, TaskEvent
from backend.tasks.models import TaskStatus as S
from tests.backend.scheduling import RecordingDispatcher, group, running_task

pytestmark = pytest.mark.stack


def _running(session: Session) -> Task:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    return running_task(session)


def _last_heartbeats(session: Session, seconds_ago: float) -> None:
    session.execute(
        update(Agent).values(last_heartbeat_at=utcnow() - timedelta(seconds=seconds_ago))
    )
    session.commit()


def _alarms(session: Session, task: Task) -> list[str]:
    return [
        e.reason
        for e in session.scalars(
            select(TaskEvent).where(TaskEvent.task_id == task.id, TaskEvent.kind == EventKind.ALARM)
        )
    ]


def test_restarted_scheduler_gives_agents_a_full_timeout(session: Session) -> None:
    task = _running(session)
    timeout = get_settings().heartbeat_timeout_s
    # The API was down for longer than the timeout: the agents' last heartbeats are older.
    _last_heartbeats(session, seconds_ago=timeout + 20)
    loop = SchedulerLoop(get_settings(), RecordingDispatcher())  # the new process's scheduler
    loop.run_pass()
    session.expire_all()
    assert all(agent.online for agent in session.scalars(select(Agent)))
    assert session.get(Task, task.id).status is S.RUNNING
    assert _alarms(session, task) == []

    # Heartbeats reach the new process: still no alarm once it has watched a full timeout.
    loop.started_at = utcnow() - timedelta(seconds=timeout + 5)
    _last_heartbeats(session, seconds_ago=1)
    loop.run_pass()
    session.expire_all()
    assert session.get(Task, task.id).status is S.RUNNING and _alarms(session, task) == []


def test_silent_agent_is_still_timed_out_after_a_full_timeout_of_watching(session: Session) -> None:
    task = _running(session)
    timeout = get_settings().heartbeat_timeout_s
    loop = SchedulerLoop(get_settings(), RecordingDispatcher())
    loop.started_at = utcnow() - timedelta(seconds=timeout + 5)
    _last_heartbeats(session, seconds_ago=timeout + 20)
    loop.run_pass()
    session.expire_all()
    assert not any(agent.online for agent in session.scalars(select(Agent)))
    assert session.get(Task, task.id).attempt == 2
    assert any("stopped sending heartbeats" in reason for reason in _alarms(session, task))


def test_staleness_clock_starts_at_the_watch_start(session: Session) -> None:
    group(session, "cpu-a", 2)
    _last_heartbeats(session, seconds_ago=600)
    start = utcnow() - timedelta(seconds=10)
    assert monitor.mark_stale_agents(session, timeout_s=15, interval_s=1, watching_since=start) == 0
    start = utcnow() - timedelta(seconds=14.5)  # past timeout - interval: a pass now is due
    assert monitor.mark_stale_agents(session, timeout_s=15, interval_s=1, watching_since=start) == 1


def test_agents_cleared_by_the_previous_process_are_not_judged_during_the_watch(
    session: Session,
) -> None:
    """The old API, draining its connections on shutdown, heard no heartbeats and marked
    the agents offline. The new scheduler restarts nothing before it has watched a full
    timeout; by then the live agents have heartbeated and are online again."""
    task = _running(session)
    session.execute(update(Agent).values(online=False))  # the old process's last verdict
    session.commit()
    timeout = get_settings().heartbeat_timeout_s
    assert (
        monitor.check(
            session, timeout_s=timeout, interval_s=1, watching_since=utcnow() - timedelta(seconds=1)
        )
        == 0
    )
    session.expire_all()
    assert session.get(Task, task.id).status is S.RUNNING and _alarms(session, task) == []
    assert session.get(Task, task.id).attempt == 1
    # Without the watch start (as before the fix) the same state raises the false alarm.
    assert monitor.check(session, timeout_s=timeout, interval_s=1) == 1
    session.expire_all()
    assert any("stopped sending heartbeats" in r for r in _alarms(session, task))


def test_first_exit_signal_stops_the_scheduler_without_waiting(session: Session) -> None:
    from backend.scheduler.loop import stop_all_soon

    loop = SchedulerLoop(get_settings(), RecordingDispatcher())
    loop.start()
    try:
        stop_all_soon()
        loop._thread.join(timeout=30)
        assert not loop._thread.is_alive()
    finally:
        loop.stop()
