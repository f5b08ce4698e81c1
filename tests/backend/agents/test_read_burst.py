"""A burst of agents' reads larger than the connection pool and the threadpool is answered:
the agents' read routes give their connection back before FastAPI validates their answer in
its threadpool (docs/scaling.md, "Fixed: a registration burst deadlocked the API")."""

import asyncio

import httpx
from fastapi.testclient import TestClient

from tests.conftest import TOKEN, make_group, make_project, task_request

BURST = 120  # requests at once: more than the 40 threads and the pool's 15 connections


def test_a_burst_of_agent_reads_is_answered(client: TestClient) -> None:
    make_group(client, "cpu-a")
    make_group(client, "cpu-b")
    _, version = make_project(client, example="tiny_regression")
    task = client.post("/api/v1/tasks", json=task_request(version)).json()

    async def burst() -> list[int]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=client.app),
            base_url="http://api/internal/v1",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
        ) as api:
            paths = ["/resource-groups/cpu-a", f"/tasks/{task['id']}/state"]
            paths.append(f"/tasks/{task['id']}/rendezvous")
            answers = await asyncio.wait_for(
                asyncio.gather(*(api.get(paths[i % 3]) for i in range(BURST))), timeout=25
            )
            return [answer.status_code for answer in answers]

    assert asyncio.run(burst()) == [200] * BURST
