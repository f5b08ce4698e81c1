"""`on_group_loss`: what a restart does when a group the task ran on cannot take its workers
again (its agent died): `shrink` goes on with the surviving groups, `restart` waits for a
compatible group with room, `wait` waits for the task's own groups."""

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.db import utcnow
from backend.scheduler.service import schedule_next, schedule_once
from backend.tasks import fate, lifecycle
from backend.tasks.models import SubTask, Task
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
from tests.conftest import make_group, make_project

pytestmark = pytest.mark.stack


def _lose(session: Session, agent_name: str) -> None:
    """The agent stops heartbeating; one scheduler pass notices, restarts and places."""
    session.execute(
        update(Agent)
        .where(Agent.name == agent_name)
        .values(last_heartbeat_at=utcnow() - timedelta(seconds=60))
    )
    session.commit()
    schedule_once(session, RecordingDispatcher(), heartbeat_timeout_s=15)


def _groups(task: Task) -> list[tuple[str, int]]:
    return [(g["name"], g["workers"]) for g in task.spec["groups"]]


def test_shrink_goes_on_with_the_surviving_groups_when_none_has_room(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)  # cpu-a ×2, cpu-b ×1: no spare capacity anywhere
    assert task.spec["on_group_loss"] == "shrink", "the default on several groups"
    _lose(session, "agent-cpu-b")
    session.refresh(task)
    assert task.status is S.SCHEDULED and task.attempt == 2
    assert _groups(task) == [("cpu-a", 2)]
    assert (held(session, "cpu-a"), held(session, "cpu-b")) == (2, 0)
    assert len(task.spec["request"]) == 2, "the request is kept for a later restart"


def test_shrink_waits_when_the_survivors_caps_cannot_hold_the_batch(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    # cpu-a's workers take at most 20 samples a step each: alone they cannot hold 64.
    request = [
        {"name": "cpu-a", "workers": 2, "max_local_batch": 20},
        {"name": "cpu-b", "workers": 1},
    ]
    task = submit(session, version(session), request, split_policy="weighted")
    assert schedule_next(session) is not None
    for sub in session.scalars(select(SubTask).where(SubTask.task_id == task.id)):
        agent = session.get_one(Agent, sub.agent_id)
        fate.claim(session, sub=sub, data=Claim(agent_id=agent.id, host=agent.host))
    session.refresh(task)
    assert task.status is S.RUNNING and task.spec["on_group_loss"] == "shrink"
    _lose(session, "agent-cpu-b")
    session.refresh(task)
    assert task.status is S.QUEUED and task.attempt == 2  # waits for room, not shrunk
    assert held(session, "cpu-a") == 0


def test_shrink_moves_to_a_compatible_group_with_room_first(session: Session) -> None:
    for name, capacity in (("cpu-a", 2), ("cpu-b", 1), ("cpu-c", 1)):
        group(session, name, capacity)
    task = running_task(session)
    _lose(session, "agent-cpu-b")
    session.refresh(task)
    assert task.status is S.SCHEDULED and _groups(task) == [("cpu-a", 2), ("cpu-c", 1)]


@pytest.mark.parametrize("policy", ["restart", "wait"])
def test_restart_and_wait_keep_the_task_whole(session: Session, policy: str) -> None:
    for name, capacity in (("cpu-a", 2), ("cpu-b", 1), ("cpu-c", 1)):
        group(session, name, capacity)
    task = running_task(session, on_group_loss=policy)
    _lose(session, "agent-cpu-b")
    session.refresh(task)
    assert task.attempt == 2
    if policy == "restart":  # cpu-c has room: moved there
        assert task.status is S.SCHEDULED and _groups(task) == [("cpu-a", 2), ("cpu-c", 1)]
    else:  # waits for cpu-b itself
        assert task.status is S.QUEUED and held(session, "cpu-c") == 0


def test_a_restart_after_a_shrink_takes_the_whole_request_again(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    _lose(session, "agent-cpu-b")
    session.refresh(task)
    assert _groups(task) == [("cpu-a", 2)]
    session.execute(update(Agent).values(last_heartbeat_at=utcnow(), online=True))
    session.commit()
    lifecycle.restart_or_fail(session, task, "a rank was killed")
    session.commit()
    schedule_once(session, RecordingDispatcher(), heartbeat_timeout_s=15)
    session.refresh(task)
    assert task.attempt == 3 and _groups(task) == [("cpu-a", 2), ("cpu-b", 1)]


def test_shrink_on_one_group_is_refused_naming_the_field(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    project, version = make_project(client)
    body = {
        "project_id": project["id"],
        "code_version_id": version["id"],
        "epochs": 1,
        "global_batch_size": 8,
        "resource_groups": [{"name": "cpu-a", "workers": 2}],
    }
    refused = client.post("/api/v1/tasks", json={**body, "on_group_loss": "shrink"})
    assert refused.status_code == 422
    assert refused.json()["error"]["field"] == "on_group_loss"
    assert "no group would be left" in refused.json()["error"]["message"]
    accepted = client.post("/api/v1/tasks", json=body)
    assert accepted.json()["spec"]["on_group_loss"] == "restart", "the default on one group"
