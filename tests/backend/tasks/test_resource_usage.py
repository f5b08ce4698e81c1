"""The ranks' resource use sent with the agents' heartbeats: stored as metrics, shown in
/metrics, and one alarm when a rank's memory nears its limit."""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.tasks.models import Allocation, EventKind, NodeRole, Task, TaskEvent
from tests.backend.scheduling import group, running_task
from tests.conftest import agent_headers

pytestmark = pytest.mark.stack


def _beat(client: TestClient, session: Session, body: dict[str, Any]) -> None:
    agent = session.scalar(select(Agent).where(Agent.name == "agent-cpu-a"))
    assert agent is not None
    response = client.post(
        f"/internal/v1/agents/{agent.id}/heartbeat", headers=agent_headers(), json=body
    )
    assert response.status_code == 200, response.text


def _task(session: Session) -> tuple[Task, list[int]]:
    """A running task with a 1000 MiB memory limit, and its compute ranks."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session, memory_limit_mb=1000)
    ranks = session.scalars(
        select(Allocation.rank).where(
            Allocation.task_id == task.id, Allocation.role == NodeRole.COMPUTE
        )
    )
    return task, sorted(rank for rank in ranks if rank is not None)


def _alarms(session: Session, task: Task) -> list[str]:
    rows = session.scalars(
        select(TaskEvent.reason).where(
            TaskEvent.task_id == task.id, TaskEvent.kind == EventKind.ALARM
        )
    )
    return list(rows)


def _sample(rank: int, rss_mb: float, **more: float) -> dict[str, Any]:
    return {"rank": rank, "cpu_percent": 87.5, "rss_mb": rss_mb, **more}


def test_samples_are_stored_shown_in_metrics_and_exported(
    client: TestClient, session: Session
) -> None:
    task, ranks = _task(session)
    rank = ranks[1]
    sample = _sample(rank, 300.0, gpu_util=40.0, gpu_mem_mb=2048.0)
    samples = [sample, _sample(0, 120.0), _sample(999, 1.0)]  # 0: the parameter server
    running = [{"task_id": task.id, "ranks": [0, rank], "samples": samples}]
    _beat(client, session, {"running": running})
    url = f"/api/v1/tasks/{task.id}/metrics"
    stored = client.get(url, params={"resources": True}).json()
    assert {(m["name"], m["rank"], m["value"]) for m in stored} == {
        ("rank_cpu_percent", rank, 87.5),
        ("rank_rss_mb", rank, 300.0),
        ("rank_gpu_util", rank, 40.0),
        ("rank_gpu_mem_mb", rank, 2048.0),
        ("rank_cpu_percent", 0, 87.5),
        ("rank_rss_mb", 0, 120.0),
    }  # rank 999 holds no node of the task: dropped
    assert all(m["created_at"] for m in stored)
    assert client.get(url, params={"resources": False}).json() == []
    assert len(client.get(url).json()) == 6
    assert _alarms(session, task) == []
    text = TestClient(client.app).get("/metrics").text
    assert f'polytrain_rank_cpu_percent{{rank="{rank}",task="{task.id}"}} 87.5' in text
    assert f'polytrain_rank_memory_rss_mib{{rank="{rank}",task="{task.id}"}} 300.0' in text
    assert f'polytrain_rank_gpu_memory_mib{{rank="{rank}",task="{task.id}"}} 2048.0' in text


def test_memory_near_the_limit_alarms_once_per_rank(client: TestClient, session: Session) -> None:
    task, ranks = _task(session)
    for rss in (850.0, 905.0, 990.0):  # 90% of 1000 MiB is the line
        running = [{"task_id": task.id, "ranks": ranks, "samples": [_sample(ranks[0], rss)]}]
        _beat(client, session, {"running": running})
    session.expire_all()
    [alarm] = _alarms(session, task)
    assert f"rank {ranks[0]} of attempt 1 is near its memory limit" in alarm
    assert "905 MiB" in alarm and "memory_limit_mb=1000" in alarm
    session.refresh(task)
    assert task.status.value == "RUNNING"  # an alarm, not a failure
    running = [{"task_id": task.id, "ranks": ranks, "samples": [_sample(ranks[1], 950.0)]}]
    _beat(client, session, {"running": running})
    session.expire_all()
    assert len(_alarms(session, task)) == 2  # another rank: its own alarm


def test_a_heartbeat_without_samples_is_still_accepted(
    client: TestClient, session: Session
) -> None:
    task, ranks = _task(session)
    _beat(client, session, {"running": [{"task_id": task.id, "ranks": ranks}]})
    _beat(client, session, {})
    assert client.get(f"/api/v1/tasks/{task.id}/metrics").json() == []


def test_samples_of_a_task_no_longer_active_are_dropped(
    client: TestClient, session: Session
) -> None:
    task, ranks = _task(session)
    client.post(f"/api/v1/tasks/{task.id}/cancel").raise_for_status()
    running = [{"task_id": task.id, "ranks": ranks, "samples": [_sample(ranks[0], 990.0)]}]
    _beat(client, session, {"running": running})
    assert client.get(f"/api/v1/tasks/{task.id}/metrics").json() == []
    session.expire_all()
    assert _alarms(session, task) == []
