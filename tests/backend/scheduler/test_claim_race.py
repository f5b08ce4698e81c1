"""Two agents claim a task's two parts at once, each in a request of its own: on SQLite
(the embedded default), FOR UPDATE locks no row, so the second claim may have read the
task before the first moved it to RUNNING. On PostgreSQL the row lock orders them, and the
interleaving below cannot happen (the first claim would wait for the second's lock)."""

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.core import db
from backend.scheduler.service import schedule_once
from backend.tasks import fate
from backend.tasks.models import EventKind, SubTask, SubTaskStatus, Task, TaskEvent, TaskStatus
from contracts.agent_api import Claim
from tests.backend.scheduling import RecordingDispatcher, group, submit, version


def test_a_claim_that_read_the_task_before_another_starts_it_once(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    group(session, "cpu-a", 1)
    group(session, "cpu-b", 1)
    code = version(session)
    task = submit(session, code, [{"name": "cpu-a", "workers": 1}, {"name": "cpu-b", "workers": 1}])
    assert schedule_once(session, RecordingDispatcher(), heartbeat_timeout_s=15) == 1
    first, second = session.scalars(
        select(SubTask).where(SubTask.task_id == task.id).order_by(SubTask.group_index)
    ).all()
    assert first.agent_id is not None and second.agent_id is not None
    counted = fate.running_workers
    with db.get_sessionmaker()() as other:
        late = other.get_one(SubTask, second.id)

        def first_claim_meanwhile(claiming: Session, *, agent_id: int) -> int:
            # The second claim has read the task (SCHEDULED) and checked it; the first
            # claim runs to its commit now, before the second writes anything.
            if claiming is other:
                monkeypatch.setattr(fate, "running_workers", counted)
                assert first.agent_id is not None
                fate.claim(session, sub=first, data=Claim(agent_id=first.agent_id, host="a"))
            return counted(claiming, agent_id=agent_id)

        monkeypatch.setattr(fate, "running_workers", first_claim_meanwhile)
        fate.claim(other, sub=late, data=Claim(agent_id=second.agent_id, host="b"))
    session.expire_all()
    timeline = session.scalars(
        select(TaskEvent.to_status)
        .where(TaskEvent.task_id == task.id, TaskEvent.kind == EventKind.STATUS)
        .order_by(TaskEvent.id)
    ).all()
    assert timeline == [TaskStatus.QUEUED, TaskStatus.SCHEDULED, TaskStatus.RUNNING]
    parts = session.scalars(select(SubTask.status).where(SubTask.task_id == task.id)).all()
    assert set(parts) == {SubTaskStatus.RUNNING}
    assert session.get_one(Task, task.id).status is TaskStatus.RUNNING
