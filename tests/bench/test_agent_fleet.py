"""The load test's simulated agents (bench/fleet.py) against the app on SQLite: they register,
heartbeat, and run a task the scheduler placed from claim to finish, so the benchmark
(bench/agent_fleet.py) cannot rot."""

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi.testclient import TestClient

from bench.agent_fleet import verdicts
from bench.fleet import AgentPlan, MemoryBroker, Rates, Window, merge, simulate
from contracts.messaging import queue_name
from contracts.payload import SubTaskPayload
from tests.conftest import TOKEN, make_group, make_project, task_request

FAST = Rates(
    heartbeat_s=0.3,
    state_wait_s=2.0,
    report_s=0.3,
    metrics_s=0.5,
    task_s=(1.0, 1.0),
    rendezvous_poll_s=0.1,
)
# How long the test waits for the fleet to register and the task to end: a bound for a hung
# run, not a speed the test expects (each step waits on its condition, never on a clock).
PATIENCE_S = 120.0


class QueueDispatcher:
    """The scheduler's messages, put on the simulated agents' in-process queues."""

    def __init__(self, broker: MemoryBroker, loop: asyncio.AbstractEventLoop) -> None:
        self.broker, self.loop = broker, loop

    def send(self, payload: SubTaskPayload) -> None:
        body = payload.model_dump(mode="json")
        assert payload.agent_id is not None, "parts are booked for one agent"
        queue = queue_name(payload.group.name, payload.agent_id)
        self.loop.call_soon_threadsafe(self.broker.put, queue, body)


def test_simulated_agents_register_heartbeat_and_run_a_task(
    client: TestClient, session: Any
) -> None:
    from backend.scheduler.service import schedule_once

    make_group(client, "gpu-a", capacity=16, device_type="cuda")
    make_group(client, "gpu-b", capacity=16, device_type="cuda")
    _, version = make_project(client, example="tiny_regression")
    task = client.post(
        "/api/v1/tasks",
        json=task_request(
            version,
            resource_groups=[{"name": "gpu-a", "workers": 8}, {"name": "gpu-b", "workers": 8}],
        ),
    )
    assert task.status_code == 201, task.text

    task_id = task.json()["id"]

    async def wait_for(what: str, done: Callable[[], bool]) -> None:
        """Poll `done` (in a thread: it calls the app) until it holds; no speed assumed."""
        deadline = time.monotonic() + PATIENCE_S
        while not await asyncio.to_thread(done):
            assert time.monotonic() < deadline, f"{what} not within {PATIENCE_S} s"
            await asyncio.sleep(0.1)

    async def run() -> dict[str, Any]:
        broker, stop = MemoryBroker(), asyncio.Event()
        now = time.time()
        plans = [AgentPlan(i, "gpu-a" if i % 2 else "gpu-b", now) for i in range(5)]
        fleet = asyncio.create_task(
            simulate(
                plans,
                client=lambda: httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=client.app),
                    base_url="http://api/internal/v1",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ),
                broker=lambda: broker,
                windows=[Window("all", now, now + PATIENCE_S)],
                until=now + PATIENCE_S,
                rates=FAST,
                stop=stop,
            )
        )
        await wait_for("5 agents registered", lambda: len(client.get("/api/v1/agents").json()) == 5)
        dispatcher = QueueDispatcher(broker, asyncio.get_running_loop())
        await asyncio.to_thread(schedule_once, session, dispatcher, heartbeat_timeout_s=15)
        await wait_for(
            "the task finished",
            lambda: client.get(f"/api/v1/tasks/{task_id}").json()["status"] == "SUCCEEDED",
        )
        stop.set()
        return merge([await fleet])

    report = asyncio.run(run())
    assert report["registered"] == 5 and report["register_failed"] == 0
    assert report["heartbeats"] >= 5
    (window,) = report["windows"]
    assert set(window) == {"label", "requests", "errors", "cpu_s", "loop_lag_p99_ms"}
    requests = window["requests"]
    assert window["errors"] == {}
    assert requests["heartbeat"]["count"] >= 5
    assert {"count", "errors", "p50_ms", "p99_ms"} <= set(requests["heartbeat"])
    assert requests["claim"]["count"] == 2 and requests["finished"]["count"] == 2
    for kind in ("state_wait", "report", "rendezvous"):
        assert requests[kind]["count"] >= 1, kind
    # The agent's protocol: no state poll, no separate logs/progress/metrics requests.
    assert not {"task_state", "logs", "progress", "metrics"} & set(requests)
    assert client.get(f"/api/v1/tasks/{task_id}/logs").json()
    assert client.get(f"/api/v1/tasks/{task_id}/metrics", params={"resources": "false"}).json()
    assert client.get(f"/api/v1/tasks/{task_id}/metrics", params={"resources": "true"}).json()
    assert client.get(f"/api/v1/tasks/{task_id}").json()["progress"] == 1.0


def test_the_summary_says_which_targets_a_run_did_not_reach() -> None:
    # make bench's run stops at 250 agents: neither target is judged, and says so
    assert verdicts({250: 180.7}) == {"1000": "not measured", "2000": "not measured"}
    assert verdicts({250: 90.0, 1000: 950.0, 2000: 2500.0}) == {"1000": True, "2000": False}
