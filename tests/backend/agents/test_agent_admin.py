"""Admins drain, disable, re-activate and describe agents; capacity and claims follow."""

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.agents import service as agents
from backend.agents.models import Agent, AgentState
from backend.agents.schemas import AgentUpdate
from backend.core.errors import Conflict
from backend.scheduler.capacity import free_capacity
from backend.scheduler.service import schedule_next
from backend.tasks import fate
from backend.tasks.models import SubTask, SubTaskStatus
from backend.tasks.models import TaskStatus as S
from contracts.agent_api import Claim, Finished
from tests.backend.scheduling import group, submit, version
from tests.conftest import add_account, agent_headers, make_group

pytestmark = pytest.mark.stack
HARDWARE = {"cpu_cores": 4, "memory_bytes": 8 * 2**30, "cuda_devices": []}


def _register(client: TestClient, name: str, workers: int = 2) -> dict:
    response = client.post(
        "/internal/v1/agents/register",
        headers=agent_headers(),
        json={
            "name": name,
            "host": "10.77.0.4",
            "resource_group": "cpu-a",
            "workers": workers,
            "hardware": HARDWARE,
            "instance_id": f"{name}-instance",
        },
    )  # the same agent each time
    assert response.status_code == 200, response.text
    return dict(response.json())


def _free(client: TestClient) -> int:
    return int(client.get("/api/v1/resource-groups/cpu-a").json()["free_workers"])


def test_drained_agent_leaves_free_capacity_and_comes_back(client: TestClient) -> None:
    make_group(client, "cpu-a", 8)
    first, second = _register(client, "a1", workers=2), _register(client, "a2", workers=3)
    assert _free(client) == 5
    drained = client.patch(
        f"/api/v1/agents/{first['id']}",
        json={"state": "draining", "description": "fan noise, rack 3"},
    )
    assert drained.status_code == 200, drained.text
    assert (drained.json()["state"], drained.json()["description"]) == (
        "draining",
        "fan noise, rack 3",
    )
    assert _free(client) == 3
    assert (
        client.patch(f"/api/v1/agents/{second['id']}", json={"state": "disabled"}).json()["state"]
        == "disabled"
    )
    assert _free(client) == 0
    # A restarted agent keeps the state its admin gave it.
    assert _register(client, "a2", workers=3)["state"] == "disabled"
    for agent in (first, second):
        client.patch(f"/api/v1/agents/{agent['id']}", json={"state": "active"})
    assert _free(client) == 5
    listed = client.get("/api/v1/agents").json()
    assert {a["name"]: a["description"] for a in listed} == {"a1": "fan noise, rack 3", "a2": ""}


def test_bad_state_and_unknown_agent_are_refused(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    agent = _register(client, "a1")
    bad = client.patch(f"/api/v1/agents/{agent['id']}", json={"state": "sleeping"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "state"
    extra = client.patch(f"/api/v1/agents/{agent['id']}", json={"workers": 9})
    assert extra.status_code == 422 and extra.json()["error"]["field"] == "workers"
    missing = client.patch("/api/v1/agents/999", json={"state": "draining"})
    assert missing.status_code == 404
    assert client.get(f"/api/v1/agents/{agent['id']}").json()["state"] == "active"


def test_only_admins_change_agents(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    agent = _register(client, "a1")
    member = add_account("member@example.org")
    refused = client.patch(
        f"/api/v1/agents/{agent['id']}", headers=member.headers, json={"state": "disabled"}
    )
    assert refused.status_code == 403
    seen = client.get(f"/api/v1/agents/{agent['id']}", headers=member.headers)
    assert seen.status_code == 200 and seen.json()["state"] == "active"


def test_draining_agent_finishes_its_work_and_is_disabled_once_idle(session: Session) -> None:
    group(session, "cpu-a", 2)
    agent = session.scalar(select(Agent))
    task = submit(session, version(session), [{"name": "cpu-a", "workers": 2}])
    assert schedule_next(session) == task.id
    sub = session.scalar(select(SubTask).where(SubTask.task_id == task.id))
    fate.claim(session, sub=sub, data=Claim(agent_id=agent.id, host=agent.host))
    agents.update(session, agent=agent, data=AgentUpdate(state=AgentState.DRAINING))
    with pytest.raises(Conflict, match="still runs 1 sub-task"):
        agents.update(session, agent=agent, data=AgentUpdate(state=AgentState.DISABLED))
    session.rollback()
    # Its running work keeps its workers; none are offered to a new task meanwhile.
    assert free_capacity(session)["cpu-a"].free == 0
    session.refresh(task)
    assert task.status is S.RUNNING
    fate.finish(session, sub=sub, data=Finished(succeeded=True, detail="done"))
    agents.update(session, agent=agent, data=AgentUpdate(state=AgentState.DISABLED))
    assert agent.state is AgentState.DISABLED
    assert free_capacity(session)["cpu-a"].free == 0


def test_a_drained_agent_cannot_claim_and_the_sub_task_is_published_again(session: Session) -> None:
    group(session, "cpu-a", 2)
    drained = session.scalar(select(Agent))
    task = submit(session, version(session), [{"name": "cpu-a", "workers": 2}])
    assert schedule_next(session) == task.id
    sub = session.scalar(select(SubTask).where(SubTask.task_id == task.id))
    sub.dispatched_at = sub.updated_at
    drained.state = AgentState.DRAINING
    session.commit()
    with pytest.raises(Conflict, match="agent 'agent-cpu-a' is draining"):
        fate.claim(session, sub=sub, data=Claim(agent_id=drained.id, host=drained.host))
    session.refresh(sub)
    assert (sub.status, sub.agent_id, sub.dispatched_at) == (SubTaskStatus.PENDING, None, None)
    other = Agent(
        name="agent-2",
        host="10.77.0.8",
        resource_group_id=drained.resource_group_id,
        workers=2,
        hardware={"cpu_cores": 2},
    )
    session.add(other)
    session.commit()
    fate.claim(session, sub=sub, data=Claim(agent_id=other.id, host=other.host))
    session.refresh(sub)
    assert (sub.status, sub.agent_id) == (SubTaskStatus.RUNNING, other.id)
