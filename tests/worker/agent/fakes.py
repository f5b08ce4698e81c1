"""A fake backend internal API (an httpx transport) and fake rank slots for the agent's tests.

`FakeApi` answers the `/internal/v1` routes the agent calls, validating each body with the
same `contracts.agent_api` schemas the real API uses (422 otherwise), and records every
request. `FakePool` hands out `sh` processes standing in for sandboxed interpreters: each
waits for its rank, then runs the shell script given for that rank.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from contracts import agent_api as schemas
from contracts.trial import TrialResult
from worker.agent.client import InternalApi
from worker.engine.report import PREFIX

TOKEN = "agent-token"
BODIES: dict[str, type[BaseModel]] = {  # what each route's body must be, as the API checks
    "claim": schemas.Claim,
    "finished": schemas.Finished,
    "heartbeat": schemas.Heartbeat,
    "logs": schemas.LogBatch,
    "metrics": schemas.MetricBatch,
    "progress": schemas.Progress,
    "report": schemas.Report,
    "alarms": schemas.Alarm,
    "provenance": schemas.Provenance,
    "rendezvous": schemas.Rendezvous,
    "ready": schemas.Ready,
    "trial": TrialResult,
}


def event(kind: str, **fields: Any) -> str:
    """A shell command that prints one engine event line (`worker.engine.report`)."""
    return f"echo '{PREFIX}{json.dumps({'type': kind, **fields})}'"


class FakeApi:
    """The backend's internal API for one task, in memory.

    `fail[route]`: HTTP statuses (0: a dropped connection) to answer, in order, before
    handling `route` normally,
    where `route` is the path's last word (`report`, `claim`, ...; `state` for the task's
    state, a long-poll when it carries `wait_s`). `before(route)` runs before each answer
    (to change the task's state mid-run). A heartbeat is answered with the task's state
    for every task it names.
    `claimed_by` refuses (409) a claim, like a sub-task taken by another agent.
    """

    def __init__(self, *, status: str = "RUNNING", attempt: int = 1) -> None:
        self.status, self.attempt = status, attempt
        self.code = b"print('hello')\n"
        self.checkpoints: dict[int, bytes] = {}
        # checkpoint id -> its sharded state's files ("<name>.dcp/<file>" -> bytes)
        self.parts: dict[int, dict[str, bytes]] = {}
        self.master: tuple[str, int] | None = None
        self.peer_hosts: list[str] = []
        self.peers_complete = False
        self.claimed_by: str | None = None
        self.refuse_field: str | None = None
        self.fail: dict[str, list[int]] = {}
        self.before: Callable[[str], None] = lambda route: None
        self.requests: list[httpx.Request] = []

    def client(self, retries: int = 2) -> InternalApi:
        return InternalApi(
            "http://api.test", TOKEN, retries=retries, transport=httpx.MockTransport(self.handle)
        )

    def calls(self, route: str) -> list[httpx.Request]:
        """Every answered request to `route` (the path's last word), in order."""
        return [r for r in self.requests if r.url.path.rsplit("/", 1)[-1] == route]

    def bodies(self, route: str) -> list[Any]:
        """The JSON bodies of the answered requests to `route` that carry one, in order."""
        return [json.loads(r.content) for r in self.calls(route) if r.content]

    def reported(self, part: str) -> list[Any]:
        """What the combined reports carried of `part` (`lines`, `metrics`: every item, in
        order; `progress`: each progress sent)."""
        reports = self.bodies("report")
        if part == "progress":
            return [r["progress"] for r in reports if r.get("progress") is not None]
        return [item for r in reports for item in r.get(part, [])]

    def state_polls(self) -> list[httpx.Request]:
        """The state requests that were not long-polls (asked at once, no known state)."""
        return [r for r in self.calls("state") if "wait_s" not in r.url.params]

    def _wait_state(self, request: httpx.Request) -> None:
        """A long-poll: return once the state differs from the one the agent knows, or after
        `wait_s` (at most 2 s here, so a watch left behind by a test ends soon)."""
        params = request.url.params
        if "wait_s" not in params:
            return
        known = (params["status"], int(params.get("attempt", 1)))
        deadline = time.monotonic() + min(2.0, float(params["wait_s"]))
        while (self.status, self.attempt) == known and time.monotonic() < deadline:
            time.sleep(0.01)

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        path = request.url.path
        assert path.startswith("/internal/v1/"), path
        route = path.rsplit("/", 1)[-1]
        failures = self.fail.get(route)
        if failures:
            status = failures.pop(0)
            if status == 0:
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(status, json={"error": {"message": "injected"}})
        if route in BODIES and request.method != "GET":
            try:
                BODIES[route].model_validate_json(request.content or b"{}")
            except ValidationError as exc:
                return httpx.Response(422, json={"detail": exc.errors(include_url=False)})
        self.requests.append(request)
        self.before(route)
        return self._answer(request, route)

    def _answer(self, request: httpx.Request, route: str) -> httpx.Response:
        if route == "register":
            return httpx.Response(201, json={"id": 7})
        if route == "claim":
            claim = json.loads(request.content)
            if self.claimed_by or claim["attempt"] != self.attempt:
                return httpx.Response(
                    409,
                    json={
                        "error": {
                            "message": f"taken by {self.claimed_by} in attempt {self.attempt}",
                            "field": self.refuse_field,
                        }
                    },
                )
            self.peer_hosts = sorted({*self.peer_hosts, claim["host"]})
            return httpx.Response(200, json={})
        if route == "code":
            return httpx.Response(200, content=self.code)
        if re.search(r"/checkpoints/\d+$", request.url.path):
            return httpx.Response(200, content=self.checkpoints[int(route)])
        listed = re.search(r"/checkpoints/(\d+)/parts$", request.url.path)
        if listed:
            return httpx.Response(
                200, json={"parts": sorted(self.parts.get(int(listed[1]), {})), "missing": []}
            )
        part = re.search(r"/checkpoints/(\d+)/parts/(.+)$", request.url.path)
        if part:
            return httpx.Response(200, content=self.parts[int(part[1])][part[2]])
        if route == "checkpoint-parts":
            return httpx.Response(200, json={"stored": request.url.params["part"]})
        if route == "state":
            self._wait_state(request)
            return httpx.Response(200, json={"status": self.status, "attempt": self.attempt})
        if route == "heartbeat":
            body = json.loads(request.content or b"{}")
            named = {e["task_id"] for e in body.get("running", [])} | set(body.get("tasks", []))
            states = [
                {"task_id": task_id, "status": self.status, "attempt": self.attempt}
                for task_id in sorted(named)
            ]
            return httpx.Response(200, json={"tasks": states})
        if route == "report":
            return httpx.Response(200, json={"stored": len(json.loads(request.content)["lines"])})
        if route == "rendezvous" and request.method == "PUT":
            body = json.loads(request.content)
            self.master = (body["master_addr"], body["master_port"])
            return httpx.Response(204)
        if route == "rendezvous":
            addr, port = self.master or (None, None)
            return httpx.Response(
                200,
                json={
                    "master_addr": addr,
                    "master_port": port,
                    "status": self.status,
                    "attempt": self.attempt,
                    "peer_hosts": self.peer_hosts,
                    "peers_complete": self.peers_complete,
                },
            )
        if route == "finished":
            return httpx.Response(200, json={"status": "RUNNING"})
        if route == "ready":
            return httpx.Response(200, json={"status": self.status, "attempt": self.attempt})
        if route == "checkpoints" and request.method == "POST":
            return httpx.Response(200, json={"id": len(self.calls("checkpoints"))})
        if route == "provenance":
            return httpx.Response(200, json={"stored": len(json.loads(request.content)["records"])})
        if route == "alarms":
            return httpx.Response(200, json={"stored": True})
        if route == "trial":
            return httpx.Response(200, json={"plan_id": 1, "fitted": True})
        if re.fullmatch(r"deregister|logs|metrics|progress", route):
            return httpx.Response(
                200 if route == "logs" else 204, json={"stored": 0} if route == "logs" else None
            )
        return httpx.Response(404, json={"error": {"message": f"no route {route}"}})


class FakeLease:
    """A sandbox uid lease that records which peers its rank was let reach."""

    def __init__(self) -> None:
        self.admitted: list[tuple[int, list[str]]] = []

    def admit(self, task_id: int, peers: Sequence[str] = ()) -> None:
        self.admitted.append((task_id, list(peers)))

    def release(self) -> None:
        pass


class FakeSlot:
    """An `sh` waiting (like a warm interpreter) for its order, then running its rank's script."""

    def __init__(self, rank_dir: Path, scripts: Mapping[int, str]) -> None:
        rank_dir.mkdir(parents=True)
        self.rank_dir, self.scripts, self.lease = rank_dir, scripts, FakeLease()
        self.env: dict[str, str] = {}
        self.popen = subprocess.Popen(
            ["sh", "-c", "read -r go && exec sh ./run.sh"],
            cwd=rank_dir,
            text=True,
            bufsize=1,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def begin(
        self,
        spec_path: Path,
        env: Mapping[str, str],
        *,
        task_id: int,
        peers: Sequence[str],
        memory_limit_mb: int,
    ) -> bool:
        assert spec_path.parent == self.rank_dir and memory_limit_mb >= 1
        self.env = dict(env)
        self.lease.admit(task_id, peers)
        (self.rank_dir / "run.sh").write_text(self.scripts.get(int(env["RANK"]), "exit 0"))
        assert self.popen.stdin is not None
        self.popen.stdin.write("go\n")
        self.popen.stdin.close()
        return True


class FakePool:
    """Stands in for `WarmPool`: rank r runs `scripts[r]` (default: exit 0)."""

    def __init__(self, root: Path, scripts: Mapping[int, str]) -> None:
        self.root, self.scripts = root, scripts
        self.slots: list[FakeSlot] = []

    def acquire(self) -> FakeSlot:
        slot = FakeSlot(self.root / f"slot-{len(self.slots)}", self.scripts)
        self.slots.append(slot)
        return slot

    def by_rank(self) -> dict[int, FakeSlot]:
        return {int(s.env["RANK"]): s for s in self.slots if s.env}

    def close(self) -> None:
        for slot in self.slots:
            if slot.popen.poll() is None:
                slot.popen.kill()
            slot.popen.wait()
            if slot.popen.stdout is not None:
                slot.popen.stdout.close()
