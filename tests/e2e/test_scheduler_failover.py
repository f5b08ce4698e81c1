"""Several API processes, one scheduler: the elected process is killed (SIGKILL) while 50
tasks are being submitted and booked; the other process takes the lead, and every task is
booked once and finishes (issue 37, item 2).

Two real `polytrain api` processes on one PostgreSQL database (each on a port of its own, as
on two hosts); simulated agents (`SimAgent`: the agent's requests with the bodies of
contracts/agent_api.py, taking the scheduler's messages from Redis as the agent's Celery
consumer does; no ranks run) and the submissions talk to the process that is not killed, so
what is tested is the handover of the scheduler, not the loss of the killed process's own
requests.
"""

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import select

from backend.core import db
from backend.tasks.models import Allocation, NodeRole, SubTask, Task, TaskEvent
from contracts.agent_api import Claim, Finished, Hardware, Heartbeat, RunningRanks
from contracts.messaging import queue_name
from contracts.payload import SubTaskPayload
from tests import production
from tests.conftest import ADMIN_EMAIL, TOKEN, add_account
from worker.engine.ranks import free_port

TASKS = 50
AGENTS = 6  # 3 per group, 2 workers each, a task takes 2: 6 tasks run at once
WORKERS = 2
# A bound for a hung run, not a speed the test expects: each step waits on its condition.
PATIENCE_S = 240.0


class SimAgent(threading.Thread):
    """An agent without ranks: registers, heartbeats every second with the ranks it "runs",
    takes its queue's messages one at a time, claims each, "trains" 0.3 s, reports it
    finished. `claimed` counts its claims answered 204, `duplicates` those answered 409
    (a message published again: the claim refuses a taken sub-task)."""

    def __init__(self, index: int, group: str, api_url: str, broker: str) -> None:
        super().__init__(daemon=True)
        self.name, self.group, self.host = f"sim-{index}", group, f"10.0.0.{index + 1}"
        self.api = httpx.Client(
            base_url=f"{api_url}/internal/v1",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        self.broker = redis.Redis.from_url(broker)
        self.stop = threading.Event()
        self.running: RunningRanks | None = None
        self.claimed = self.duplicates = 0
        self.errors: list[str] = []
        hardware = Hardware(device_type="cpu", cpu_cores=4, memory_bytes=8 * 1024**3)
        answer = self.api.post(
            "/agents/register",
            json={
                "name": self.name,
                "host": self.host,
                "resource_group": group,
                "workers": WORKERS,
                "hardware": hardware.model_dump(mode="json"),
            },
        )
        assert answer.status_code == 200, answer.text
        self.agent_id = int(answer.json()["id"])

    def _call(self, path: str, body: dict[str, Any]) -> int:
        answer = self.api.post(path, json=body)
        if answer.status_code >= 400 and answer.status_code != 409:
            self.errors.append(f"{path}: {answer.status_code} {answer.text}")
        return answer.status_code

    def beat(self) -> None:
        while not self.stop.wait(1.0):
            running = [self.running] if self.running else []
            beat = Heartbeat(running=running)
            self._call(f"/agents/{self.agent_id}/heartbeat", beat.model_dump(mode="json"))

    def run(self) -> None:
        threading.Thread(target=self.beat, daemon=True).start()
        queue = queue_name(self.group, self.agent_id)
        while not self.stop.is_set():
            found = self.broker.brpop([queue], timeout=1)
            if found is None:
                continue
            body = json.loads(base64.b64decode(json.loads(found[1])["body"]))  # Celery's
            payload = SubTaskPayload.model_validate(body[0][0])
            claim = Claim(agent_id=self.agent_id, host=self.host, attempt=payload.attempt)
            code = self._call(f"/sub-tasks/{payload.sub_task_id}/claim", claim.model_dump())
            if code == 409:
                self.duplicates += 1
                continue
            self.claimed += 1
            ranks = ([0] if payload.hosts_parameter_server else []) + list(payload.ranks)
            self.running = RunningRanks(task_id=payload.task_id, ranks=ranks)
            time.sleep(0.3)
            self.running = None
            done = Finished(succeeded=True, detail="done")
            self._call(f"/sub-tasks/{payload.sub_task_id}/finished", done.model_dump())

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=10)
        self.api.close()
        self.broker.close()


def wait_until(what: str, done: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + PATIENCE_S
    while not (found := done()):
        assert time.monotonic() < deadline, f"{what}: not within {PATIENCE_S} s"
        time.sleep(0.1)
    return found


def _api(port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "polytrain.cli", "api", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture
def processes(service_env: Path) -> Iterator[tuple[dict[int, str], str, str]]:
    """Two API processes on the test's PostgreSQL database: ({pid: url}, database, broker)."""
    database, broker = os.environ["DATABASE_URL"], production.fresh_broker()
    env = {
        **os.environ,
        "BROKER_URL": broker,
        "POLYTRAIN_RATE_LIMIT_STORAGE_URL": production.fresh_broker(),
        "POLYTRAIN_SCHEDULER_LEASE_S": "1",
        "POLYTRAIN_SCHEDULER_INTERVAL_S": "0.2",
        "PYTHONUNBUFFERED": "1",
    }
    procs = {}
    service_env.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        port = free_port()
        proc = _api(port, env, service_env / f"api-{i}.log")
        procs[proc.pid] = (proc, f"http://127.0.0.1:{port}")
    try:
        for proc, url in procs.values():

            def healthy(proc: subprocess.Popen[bytes] = proc, url: str = url) -> bool:
                assert proc.poll() is None, f"API exited; see {service_env}/api-*.log"
                try:
                    return httpx.get(f"{url}/api/v1/health", timeout=5).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until("the API answers", healthy)
        yield {pid: url for pid, (_, url) in procs.items()}, database, broker
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _leader_gauge(url: str) -> str:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    (line,) = [s for s in text.splitlines() if s.startswith("polytrain_scheduler_leader{")]
    return line.rsplit(" ", 1)[1]


@pytest.mark.stack(only="postgresql")
def test_killing_the_elected_process_loses_no_task_and_books_none_twice(
    processes: tuple[dict[int, str], str, str],
) -> None:
    urls, database, broker = processes
    leader = wait_until("a process leads", lambda: production.leader_pid(database))
    assert leader in urls
    (survivor,) = set(urls) - {leader}
    api_url = urls[survivor]
    assert (_leader_gauge(urls[leader]), _leader_gauge(api_url)) == ("1.0", "0.0")
    headers = add_account(ADMIN_EMAIL, admin=True).headers

    with httpx.Client(base_url=api_url, headers=headers, timeout=30) as api:
        for name in ("cpu-a", "cpu-b"):
            api.post(
                "/api/v1/resource-groups",
                json={"name": name, "device_type": "cpu", "capacity": WORKERS * AGENTS // 2},
            ).raise_for_status()
        project = api.post("/api/v1/projects", json={"name": "failover"}).json()
        version = api.post(
            f"/api/v1/projects/{project['id']}/code-versions", json={"example": "tiny_regression"}
        ).json()

    def submit(api: httpx.Client, i: int) -> int:
        answer = api.post(
            "/api/v1/tasks",
            json={
                "project_id": project["id"],
                "code_version_id": version["id"],
                "resource_groups": [{"name": "cpu-a" if i % 2 else "cpu-b", "workers": WORKERS}],
                "epochs": 1,
                "global_batch_size": 64,
            },
        )
        assert answer.status_code == 201, answer.text
        return int(answer.json()["id"])

    def statuses(ids: list[int]) -> set[str]:
        with db.get_sessionmaker()() as session:
            return {str(s) for s in session.scalars(select(Task.status).where(Task.id.in_(ids)))}

    agents = [SimAgent(i, "cpu-a" if i % 2 else "cpu-b", api_url, broker) for i in range(AGENTS)]
    for agent in agents:
        agent.start()
    try:
        with httpx.Client(base_url=api_url, headers=headers, timeout=30) as api:
            ids = [submit(api, i) for i in range(TASKS // 2)]
            wait_until(  # the leader is booking: some tasks left the queue, most wait
                "a task booked", lambda: statuses(ids) - {"QUEUED"}
            )
            os.kill(leader, signal.SIGKILL)
            ids += [submit(api, i) for i in range(TASKS // 2, TASKS)]
            assert (
                wait_until("the other process leads", lambda: production.leader_pid(database))
                == survivor
            )
            wait_until(
                "every task ended",
                lambda: statuses(ids) <= {"SUCCEEDED", "FAILED", "CANCELLED"},
            )
            assert statuses(ids) == {"SUCCEEDED"}
            assert _leader_gauge(api_url) == "1.0"
    finally:
        for agent in agents:
            agent.close()
    assert [e for agent in agents for e in agent.errors] == []
    assert sum(agent.claimed for agent in agents) == TASKS  # each part claimed once

    with db.get_sessionmaker()() as session:
        tasks = session.scalars(select(Task).where(Task.id.in_(ids))).all()
        assert len(tasks) == TASKS and {t.attempt for t in tasks} == {1}  # none restarted
        booked = defaultdict(int)
        for event in session.scalars(select(TaskEvent).where(TaskEvent.task_id.in_(ids))):
            if event.to_status == "SCHEDULED":
                booked[event.task_id] += 1
        assert booked == dict.fromkeys(ids, 1)  # each booked exactly once
        parts = session.scalars(select(SubTask).where(SubTask.task_id.in_(ids))).all()
        assert sorted(p.task_id for p in parts) == sorted(ids)  # one part each, all claimed
        assert {p.status.value for p in parts} == {"SUCCEEDED"}
        # No group ever held more workers than it has (each compute node: +1 booked, -1 freed).
        changes: dict[int, list[tuple[Any, int]]] = defaultdict(list)
        for node in session.scalars(
            select(Allocation).where(
                Allocation.task_id.in_(ids), Allocation.role == NodeRole.COMPUTE
            )
        ):
            assert node.released_at is not None
            changes[node.resource_group_id] += [(node.created_at, 1), (node.released_at, -1)]
        for group_changes in changes.values():
            held = peak = 0
            for _, change in sorted(group_changes, key=lambda c: (c[0], c[1])):
                held += change
                peak = max(peak, held)
            assert peak <= WORKERS * AGENTS // 2
