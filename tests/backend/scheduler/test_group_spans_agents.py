"""A resource group spans hosts: a task's workers of a group are booked as parts across the
group's agents, each within the agent's free workers, and only that agent claims its part."""

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.agents.models import AgentState
from backend.scheduler.capacity import free_capacity
from backend.scheduler.dispatch import rebook_parts
from backend.scheduler.service import schedule_next, schedule_once
from backend.tasks import fate
from backend.tasks.models import Allocation, NodeRole, SubTask, SubTaskStatus, Task, TaskStatus
from contracts.agent_api import Claim, Finished
from tests.backend.scheduling import (
    RecordingDispatcher,
    add_agent,
    agent_named,
    group,
    submit,
    version,
)
from tests.conftest import agent_headers

pytestmark = pytest.mark.stack


def _parts(session: Session, task: Task) -> list[SubTask]:
    session.expire_all()
    return list(
        session.scalars(
            select(SubTask)
            .where(SubTask.task_id == task.id, SubTask.attempt == task.attempt)
            .order_by(SubTask.first_rank)
        )
    )


def test_a_groups_workers_are_booked_across_its_agents_never_beyond_their_free_workers(
    session: Session,
) -> None:
    a = group(session, "cpu-a", 5, online=2)
    group(session, "cpu-b", 1)
    a2 = add_agent(session, a, "a2", workers=2)
    a1, b1 = agent_named(session, "agent-cpu-a"), agent_named(session, "agent-cpu-b")
    # The group's capacity (5) exceeds what its agents offer together (4): 4 are free.
    assert free_capacity(session)["cpu-a"].free == 4
    code = version(session)
    first = submit(
        session, code, [{"name": "cpu-a", "workers": 3}, {"name": "cpu-b", "workers": 1}]
    )
    dispatcher = RecordingDispatcher()
    assert schedule_once(session, dispatcher, heartbeat_timeout_s=15) == 1
    # Ranks contiguous per group in part order; the first part hosts the parameter server.
    sent = [
        (p.agent_id, p.group_index, p.part, p.ranks, p.hosts_parameter_server)
        for p in dispatcher.sent
    ]
    assert sent == [
        (a1.id, 0, 0, [1, 2], True),
        (a2.id, 0, 1, [3], False),
        (b1.id, 1, 0, [4], False),
    ]
    assert {a.id: a.free for a in free_capacity(session)["cpu-a"].agents or []} == {
        a1.id: 0,
        a2.id: 1,
    }
    # One worker left, on a2: a task asking two of cpu-a waits, one asking one gets a2's.
    waiting = submit(session, code, [{"name": "cpu-a", "workers": 2}])
    single = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    assert schedule_next(session) == single.id
    assert [(p.agent_id, p.first_rank, p.workers) for p in _parts(session, single)] == [
        (a2.id, 1, 1)
    ]
    assert schedule_next(session) is None
    session.refresh(waiting)
    assert waiting.status is TaskStatus.QUEUED
    # Each agent's claim marks its own ranks' nodes with its host.
    for part in _parts(session, first):
        agent = session.get(type(a1), part.agent_id)
        assert agent is not None
        fate.claim(session, sub=part, data=Claim(agent_id=agent.id, host=f"host-{agent.name}"))
    hosts = session.execute(
        select(Allocation.role, Allocation.rank, Allocation.host)
        .where(Allocation.task_id == first.id)
        .order_by(Allocation.rank.nulls_first())
    ).all()
    assert [(role.value, rank, host) for role, rank, host in hosts] == [
        (NodeRole.TASK_MANAGER.value, None, "host-agent-cpu-a"),
        (NodeRole.PARAMETER_SERVER.value, 0, "host-agent-cpu-a"),
        (NodeRole.COMPUTE.value, 1, "host-agent-cpu-a"),
        (NodeRole.COMPUTE.value, 2, "host-agent-cpu-a"),
        (NodeRole.COMPUTE.value, 3, "host-a2"),
        (NodeRole.COMPUTE.value, 4, "host-agent-cpu-b"),
    ]
    # The task succeeds once every part has, and its agents' workers are free again.
    for part in _parts(session, first):
        fate.finish(session, sub=part, data=Finished(succeeded=True, detail="done"))
    session.refresh(first)
    assert first.status is TaskStatus.SUCCEEDED
    assert free_capacity(session)["cpu-a"].free == 3  # a2 still runs `single`


def test_a_claim_that_would_oversubscribe_the_host_is_refused_and_nothing_is_lost(
    session: Session, client: TestClient
) -> None:
    a = group(session, "cpu-a", 2, online=1)
    other = add_agent(session, a, "a2", workers=1)
    first = agent_named(session, "agent-cpu-a")
    code = version(session)
    running = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    assert schedule_next(session) == running.id
    (running_part,) = _parts(session, running)
    assert running_part.agent_id == first.id
    fate.claim(session, sub=running_part, data=Claim(agent_id=first.id, host=first.host))
    task = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    assert schedule_next(session) == task.id
    (part,) = _parts(session, task)
    assert part.agent_id == other.id

    def claim(agent_id: int) -> dict:
        answer = client.post(
            f"/internal/v1/sub-tasks/{part.id}/claim",
            headers=agent_headers(),
            json={"agent_id": agent_id, "host": "h", "attempt": 1},
        )
        assert answer.status_code == 409, answer.text
        return answer.json()["error"]

    # Only the agent a part is booked for claims it.
    assert claim(first.id)["field"] == "agent_id"
    # Its agent is drained: the part is handed back, and no agent has room for it now.
    other.state = AgentState.DRAINING
    session.commit()
    assert claim(other.id)["field"] == "agent_id"
    assert rebook_parts(session) == 0
    # The busy agent takes the unbooked part only within its own `workers`: refused, naming it.
    error = claim(first.id)
    assert error["field"] == "workers" and "workers=1" in error["message"], error
    (part,) = _parts(session, task)
    assert (part.status, part.agent_id) == (SubTaskStatus.PENDING, None)
    # Its running task ends: the part is booked for the agent that now has room, and runs.
    fate.finish(session, sub=running_part, data=Finished(succeeded=True, detail="done"))
    assert rebook_parts(session) == 1
    (part,) = _parts(session, task)
    assert (part.agent_id, part.dispatched_at) == (first.id, None)
    fate.claim(session, sub=part, data=Claim(agent_id=first.id, host=first.host))
    session.refresh(task)
    assert task.status is TaskStatus.RUNNING


def test_an_agent_of_another_group_cannot_claim_a_part(session: Session) -> None:
    group(session, "cpu-a", 1)
    group(session, "cpu-b", 1)
    task = submit(session, version(session), [{"name": "cpu-a", "workers": 1}])
    assert schedule_next(session) == task.id
    (part,) = _parts(session, task)
    stranger = agent_named(session, "agent-cpu-b")
    with pytest.raises(fate.Conflict, match="serves another resource group") as refused:
        fate.claim(session, sub=part, data=Claim(agent_id=stranger.id, host=stranger.host))
    assert refused.value.field == "agent_id"
    (part,) = _parts(session, task)
    assert (part.status, part.agent_id) == (
        SubTaskStatus.PENDING,
        agent_named(session, "agent-cpu-a").id,
    )


def test_a_part_of_a_lost_agent_goes_to_another_and_a_lost_running_part_restarts_the_task(
    session: Session,
) -> None:
    a = group(session, "cpu-a", 3, online=1)
    a2 = add_agent(session, a, "a2", workers=1)
    a1 = agent_named(session, "agent-cpu-a")
    task = submit(session, version(session), [{"name": "cpu-a", "workers": 2}])
    dispatcher = RecordingDispatcher()
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    assert [(p.agent_id, p.ranks) for p in dispatcher.sent] == [(a1.id, [1]), (a2.id, [2])]
    first, second = _parts(session, task)
    fate.claim(session, sub=first, data=Claim(agent_id=a1.id, host=a1.host))
    # a2 goes offline before it claims: its part is booked for a3, which joined meanwhile.
    a2.online = False
    session.commit()
    a3 = add_agent(session, a, "a3", workers=1)
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    assert [(p.agent_id, p.sub_task_id, p.ranks) for p in dispatcher.sent[2:]] == [
        (a3.id, second.id, [2])
    ]
    (_, second) = _parts(session, task)
    fate.claim(session, sub=second, data=Claim(agent_id=a3.id, host=a3.host))
    # a3 is lost while it runs its part: the task restarts, on the agents still serving.
    a3.online = False
    a2.online = True
    session.commit()
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    session.refresh(task)
    assert task.attempt == 2 and task.status is TaskStatus.SCHEDULED
    assert [(p.agent_id, p.first_rank, p.workers) for p in _parts(session, task)] == [
        (a1.id, 1, 1),
        (a2.id, 2, 1),
    ]
