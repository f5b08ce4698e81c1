"""The load test's simulated agents (bench/fleet.py) against the app on SQLite: they register,
heartbeat, and run a task the scheduler placed from claim to finish, so the benchmark
(bench/agent_fleet.py) cannot rot."""

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from bench import fleet
from bench.agent_fleet import verdicts
from bench.fleet import AgentPlan, MemoryBroker, Rates, Window, merge, simulate
from bench.fleet_faults import logged_errors
from contracts.messaging import queue_name
from contracts.payload import SubTaskPayload
from tests.conftest import TOKEN, make_group, make_project, task_request
from tests.worker.agent.conftest import make_payload
from worker.engine.ranks import free_port

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
    logs = client.get(f"/api/v1/tasks/{task_id}/logs", params={"limit": 10_000}).json()
    # The ledger bench/fleet_faults.py holds against the database: what the API took
    ledger = report["ledger"]
    assert len({sub_task for sub_task, _agent in ledger["claims"]}) == 2
    acked = {
        (int(key.split(":")[1]), key.split(":", 2)[2], seq)
        for key, seqs in ledger["acked"].items()
        for seq in seqs
    }
    assert acked and acked <= {(line["attempt"], line["node"], line["seq"]) for line in logs}
    assert ledger["dropped"] == 0
    assert client.get(f"/api/v1/tasks/{task_id}/metrics", params={"resources": "false"}).json()
    assert client.get(f"/api/v1/tasks/{task_id}/metrics", params={"resources": "true"}).json()
    assert client.get(f"/api/v1/tasks/{task_id}").json()["progress"] == 1.0


def test_the_summary_says_which_targets_a_run_did_not_reach() -> None:
    # make bench's run stops at 250 agents: neither target is judged, and says so
    assert verdicts({250: 180.7}) == {"1000": "not measured", "2000": "not measured"}
    assert verdicts({250: 90.0, 1000: 950.0, 2000: 2500.0}) == {"1000": True, "2000": False}


def test_a_report_the_api_failed_keeps_its_lines_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the agent's reporter: a report answered 5xx on every try keeps its lines, and the
    next report carries them first; only lines of a 2xx answer count as acknowledged."""
    bodies: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(503 if len(bodies) <= 3 else 200, json={})

    async def no_wait(_s: float) -> None:
        return None

    monkeypatch.setattr(fleet.asyncio, "sleep", no_wait)
    payload = make_payload(task_id=3)

    async def run() -> tuple[fleet.SimAgent, list[bool], list[dict[str, Any]]]:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://api")
        agent = fleet.SimAgent(0, "gpu-a", http, fleet.Recorder([]), FAST, None)
        buffer, answers = fleet.Unsent(), []
        seq = agent._output(buffer, payload, [1], 0)
        answers.append(await agent._report("/tasks/3", payload, 0, 0.5, buffer))
        kept = list(buffer.lines)
        agent._output(buffer, payload, [1], seq)
        answers.append(await agent._report("/tasks/3", payload, 0, 1.0, buffer))
        assert buffer.lines == []
        return agent, answers, kept

    agent, answers, kept = asyncio.run(run())
    assert answers == [False, True]
    assert len(bodies) == 4  # one report's 3 tries (as the agent's), then the next report
    assert [line["seq"] for line in kept] == [0, 1, 2, 3]
    assert [line["seq"] for line in bodies[-1]["lines"]] == list(range(8))
    assert agent.ledger.acked == {"3:1:worker-1": list(range(8))}


def test_an_agent_whose_reports_fail_past_the_limit_fails_its_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the agent's reporter: every report failing for `OUTAGE_LIMIT_S` (0 here) fails the
    part, its unsent lines counted as given up."""

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={})

    async def no_wait(_s: float) -> None:
        return None

    monkeypatch.setattr(fleet.asyncio, "sleep", no_wait)
    monkeypatch.setattr(fleet, "OUTAGE_LIMIT_S", 0.0)
    monkeypatch.setattr(fleet, "OUTAGE_RETRY_S", 0.0)
    rates = Rates(report_s=0.05, task_s=(60.0, 60.0))

    async def run() -> tuple[fleet.SimAgent, str]:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://api")
        agent = fleet.SimAgent(0, "gpu-a", http, fleet.Recorder([]), rates, None)
        return agent, await agent._train("/tasks/3", make_payload(task_id=3), [1])

    agent, outcome = asyncio.run(run())
    assert outcome.startswith("infra: every report failed")
    assert agent.ledger.gave_up == 1 and agent.ledger.dropped >= 8
    assert agent.ledger.acked == {}


def test_a_broker_that_is_down_answers_no_message() -> None:
    """A simulated agent's queue read while Redis restarts: no message, no exception (the
    agent's serving loop would end), as a Celery consumer reconnects."""
    broker = fleet.RedisBroker(f"redis://127.0.0.1:{free_port()}/0")

    async def take() -> Any:
        try:
            return await broker.take("rg.a.agent-1", 1.0)
        finally:
            await broker.close()

    assert asyncio.run(take()) is None


def test_the_fault_run_reads_the_exceptions_its_api_logged(tmp_path: Path) -> None:
    log = tmp_path / "api.log"
    log.write_text(
        "publishing sub-task 305 failed; retrying next pass\n"
        "Traceback (most recent call last):\n"
        '  File "kombu/connection.py", line 539, in _reraise_as_library_errors\n'
        "kombu.exceptions.OperationalError: Error 111 connecting. Connection refused.\n"
        "INFO: 127.0.0.1 - POST /internal/v1/agents/1/heartbeat 200\n"
    )
    assert logged_errors(log) == {
        "kombu.exceptions.OperationalError: Error 111 connecting. Connection refused.": 1
    }
    assert logged_errors(tmp_path / "none.log") == {}


def test_a_claim_not_taken_is_in_the_ledger_with_its_answer() -> None:
    """A refused claim runs nothing and is recorded with the API's answer, which is what
    bench/fleet_faults.py shows for a part the database holds for an agent never told."""
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(409, json={"error": {"message": "sub-task 9 is RUNNING"}})

    async def run() -> fleet.SimAgent:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://api")
        agent = fleet.SimAgent(0, "gpu-a", http, fleet.Recorder([]), FAST, None)
        agent.agent_id = 7
        await agent.run_sub_task(make_payload(task_id=3, sub_task_id=9))
        return agent

    agent = asyncio.run(run())
    assert seen == ["/sub-tasks/9/claim"]  # refused at once: no rendezvous, no report
    assert agent.ledger.claims == []
    [(sub_task, name, answer)] = agent.ledger.refused
    assert (sub_task, name) == (9, agent.name) and answer.startswith("409: ")
    assert "sub-task 9 is RUNNING" in answer
    assert fleet.Ledger.merged([agent.ledger.as_json()])["refused"] == [(9, agent.name, answer)]


def test_a_simulated_heartbeat_is_tried_twice_as_the_agents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A beat the API fails is tried once more, then left to the next beat, as the agent's."""
    waits: list[float] = []
    requests: list[str] = []

    class NextBeat(Exception):
        pass

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request.url.path)
        if len(requests) > 2:  # the next beat has begun: enough
            raise NextBeat
        return httpx.Response(503, json={})

    async def no_wait(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(fleet.asyncio, "sleep", no_wait)

    async def run() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://api")
        agent = fleet.SimAgent(0, "gpu-a", http, fleet.Recorder([]), FAST, None)
        agent.agent_id = 7
        await agent.beat()

    with pytest.raises(NextBeat):
        asyncio.run(run())
    assert requests == ["/agents/7/heartbeat"] * 3
    # the interval, the one retry's 0.5 s, the next interval: no backoff beyond one retry
    assert waits == [FAST.heartbeat_s, 0.5, FAST.heartbeat_s]


def test_the_last_report_rides_out_an_outage_as_the_agents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the agent's `Reporter.flush_last`: the report as the ranks end is tried again
    while the API fails it, so a restart then drops no line."""
    answers = [503] * 7 + [200]  # two reports' 3 tries fail, the third report's second is taken

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(answers.pop(0), json={})

    async def no_wait(_s: float) -> None:
        return None

    monkeypatch.setattr(fleet.asyncio, "sleep", no_wait)
    payload = make_payload(task_id=3)

    async def run() -> tuple[fleet.SimAgent, fleet.Unsent]:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://api")
        agent = fleet.SimAgent(0, "gpu-a", http, fleet.Recorder([]), FAST, None)
        buffer = fleet.Unsent()
        agent._output(buffer, payload, [1], 0)
        await agent._report_last("/tasks/3", payload, 0, buffer)
        return agent, buffer

    agent, buffer = asyncio.run(run())
    assert answers == [] and buffer.lines == []
    assert agent.ledger.acked == {"3:1:worker-1": list(range(FAST.log_lines))}
