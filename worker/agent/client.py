"""HTTP client of the backend's internal API, with retries for transient failures."""

import json
import secrets
import time
from typing import Any

import httpx

from contracts.agent_api import STATE_WAIT_S, GroupDevice, HeartbeatReply


class Conflict(Exception):
    """The backend refused a state change (e.g. a sub-task already claimed).

    `field` names what was refused: `agent_id` when the agent itself was drained or
    disabled by an admin.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def without_nul(value: Any) -> Any:
    """`value` with every NUL character in its strings replaced by U+FFFD.

    The backend refuses NUL in any string (no store keeps it); a rank's output
    (logs, metric names, a failure's traceback) may hold one, and must still arrive.
    """
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_nul(v) for v in value]
    return value


def unanswered(exc: httpx.HTTPError) -> bool:
    """True when `exc` (from a call, after its retries) says the API could not answer: a
    transport error or a 5xx, over once the API or its database is back. False for a 4xx,
    which the same request would meet again."""
    if isinstance(exc, httpx.HTTPStatusError):
        return not exc.response.is_client_error
    return isinstance(exc, httpx.TransportError)


CALLER_RETRIES = 2
"""How often a call is tried again here (0.5 and 1 s later) when its caller tries it again
itself, on a clock of its own: a report (the reporter's next flush 5 s later, for up to its
`OUTAGE_LIMIT_S`) and a claim (the runner's, every 5 s for as long). Through the client's
own retries (`run_agent`: 30, about 137 s of waits) one failed flush or claim outlasted
that limit, and the callers' clocks never ran."""
HEARTBEAT_TIMEOUT_S = 10.0
"""Seconds a heartbeat waits for its answer (the client's 30 s for any other call): a beat
to an API process that took the connection and hangs fails in time to reach another."""


class InternalApi:
    """Typed calls of `/internal/v1`; every call carries the agent token."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        retries: int = 5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`transport`: httpx's default (the network) unless given, e.g. a fake API in tests."""
        self._http = httpx.Client(
            base_url=base_url.rstrip("/") + "/internal/v1",
            timeout=30.0,
            headers={"Authorization": f"Bearer {token}"},
            transport=transport,
        )
        self._retries = retries

    def _call(
        self, method: str, path: str, *, retries: int | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One request, tried again after a transport error or a 5xx up to `retries` times
        (the client's own count unless given), 0.5 s later, then twice as long each time up
        to 5 s. Raises Conflict for a 409, httpx.HTTPStatusError for any other error status
        (at once for a 4xx), httpx.TransportError once the retries are spent."""
        retries = self._retries if retries is None else retries
        if "json" in kwargs:
            kwargs["json"] = without_nul(kwargs["json"])
        delay = 0.5
        for attempt in range(retries + 1):
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == retries:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if response.status_code == 409:
                error = response.json()["error"]
                raise Conflict(error["message"], error.get("field"))
            if response.status_code >= 500 and attempt < retries:
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            response.raise_for_status()
            return response
        raise AssertionError("unreachable")

    def group_device(self, resource_group: str) -> GroupDevice:
        """The device type `resource_group` is served with, and the models it accepts."""
        return GroupDevice.model_validate(
            self._call("GET", f"/resource-groups/{resource_group}").json()
        )

    def register(self, **agent: Any) -> int:
        return int(self._call("POST", "/agents/register", json=agent).json()["id"])

    def heartbeat(
        self,
        agent_id: int,
        running: list[dict[str, Any]] | None = None,
        tasks: list[int] | None = None,
    ) -> dict[int, tuple[str, int]]:
        """Beat, with the ranks alive (`running`) and the tasks this agent runs a part of
        (`tasks`); the (status, attempt) of each task named, from the answer.

        Tried once more 0.5 s later (another API process may answer), each try waiting
        `HEARTBEAT_TIMEOUT_S` at most, then raises the transport error or error status: the
        caller beats again one interval later, so an agent reaches an API back from a
        restart within about one heartbeat interval of its first answer. Retried with the
        client's backoff, a beat waited up to 5 s between tries, and a restarted API whose
        monitor allows a short timeout (6 s, 1 s beats: tests/e2e/test_api_restart.py)
        declared healthy agents lost and restarted their task."""
        body: dict[str, Any] = {"running": running or []}
        if tasks:
            body["tasks"] = tasks
        answer = self._call(
            "POST",
            f"/agents/{agent_id}/heartbeat",
            json=body,
            retries=min(self._retries, 1),
            timeout=HEARTBEAT_TIMEOUT_S,
        )
        if not answer.content:
            return {}
        reply = HeartbeatReply.model_validate(answer.json())
        return {state.task_id: (state.status, state.attempt) for state in reply.tasks}

    def deregister(self, agent_id: int) -> None:
        self._call("POST", f"/agents/{agent_id}/deregister")

    def claim(
        self,
        sub_task_id: int,
        *,
        agent_id: int,
        host: str,
        attempt: int = 1,
        preparing: bool = False,
        claim_id: str | None = None,
    ) -> None:
        """Take the part; `preparing`: the environment is built first (then :meth:`ready`).
        Every retry carries the same claim id (`claim_id`, a new random one by default; a
        caller that tries the claim again passes the same), so a claim the API took whose
        answer was lost is answered again rather than refused (`Claim.claim_id`). Tried
        `CALLER_RETRIES` more times at most: the runner tries a claim again itself."""
        self._call(
            "POST",
            f"/sub-tasks/{sub_task_id}/claim",
            retries=min(self._retries, CALLER_RETRIES),
            json={
                "agent_id": agent_id,
                "host": host,
                "attempt": attempt,
                "preparing": preparing,
                "claim_id": claim_id or secrets.token_hex(16),
            },
        )

    def ready(self, sub_task_id: int, *, detail: str) -> tuple[str, int]:
        """The preparing part's environment is there; the task's status and attempt after
        it (RUNNING once every part has it)."""
        state = self._call(
            "POST", f"/sub-tasks/{sub_task_id}/ready", json={"detail": detail}
        ).json()
        return str(state["status"]), int(state.get("attempt", 1))

    def finished(
        self, sub_task_id: int, *, succeeded: bool, detail: str, cause: str = "user"
    ) -> None:
        self._call(
            "POST",
            f"/sub-tasks/{sub_task_id}/finished",
            json={"succeeded": succeeded, "detail": detail, "cause": cause},
        )

    def task_state(self, task_id: int) -> tuple[str, int]:
        """The task's status and current attempt."""
        state = self._call("GET", f"/tasks/{task_id}/state").json()
        return str(state["status"]), int(state.get("attempt", 1))

    def wait_state(
        self, task_id: int, status: str, attempt: int, wait_s: float = STATE_WAIT_S
    ) -> tuple[str, int]:
        """Long-poll the task's state: answered as soon as it is no longer (`status`,
        `attempt`), else after `wait_s` seconds with it (`status` "": unknown, answered at
        once)."""
        params: dict[str, Any] = {"attempt": attempt}
        if status:
            params.update(status=status, wait_s=wait_s)
        state = self._call(
            "GET", f"/tasks/{task_id}/state", params=params, timeout=wait_s + 30.0
        ).json()
        return str(state["status"]), int(state.get("attempt", 1))

    def fetch_checkpoint(self, task_id: int, checkpoint_id: int) -> bytes:
        """A stored checkpoint's bytes (to resume from)."""
        return self._call("GET", f"/tasks/{task_id}/checkpoints/{checkpoint_id}").content

    def code(self, task_id: int) -> bytes:
        return self._call("GET", f"/tasks/{task_id}/code").content

    def set_rendezvous(self, task_id: int, addr: str, port: int, *, attempt: int = 1) -> None:
        self._call(
            "PUT",
            f"/tasks/{task_id}/rendezvous",
            json={"master_addr": addr, "master_port": port, "attempt": attempt},
        )

    def rendezvous(self, task_id: int) -> dict[str, Any]:
        return dict(self._call("GET", f"/tasks/{task_id}/rendezvous").json())

    def report(
        self,
        task_id: int,
        *,
        lines: list[dict[str, Any]],
        metrics: list[dict[str, Any]],
        progress: dict[str, Any] | None = None,
    ) -> None:
        """Log lines, metrics and the latest progress in one request (`Report`); tried
        `CALLER_RETRIES` more times at most: the reporter sends what failed again later."""
        body: dict[str, Any] = {"lines": lines, "metrics": metrics}
        if progress is not None:
            body["progress"] = progress
        self._call(
            "POST",
            f"/tasks/{task_id}/report",
            json=body,
            retries=min(self._retries, CALLER_RETRIES),
        )

    def logs(self, task_id: int, lines: list[dict[str, Any]]) -> None:
        self._call("POST", f"/tasks/{task_id}/logs", json={"lines": lines})

    def metrics(self, task_id: int, metrics: list[dict[str, Any]]) -> None:
        self._call("POST", f"/tasks/{task_id}/metrics", json={"metrics": metrics})

    def progress(self, task_id: int, progress: float, epoch: int, attempt: int = 1) -> None:
        self._call(
            "POST",
            f"/tasks/{task_id}/progress",
            json={"progress": progress, "epoch": epoch, "attempt": attempt},
        )

    def checkpoint(
        self,
        task_id: int,
        *,
        name: str,
        epoch: int,
        step: int,
        body: bytes,
        attempt: int = 1,
        parts: list[str] | None = None,
    ) -> int:
        """Upload a checkpoint file (``parts``: the files of its sharded optimizer state,
        which their workers upload, :meth:`checkpoint_part`; sent with it as a multipart
        form, never in the query string); returns its id."""
        params: dict[str, Any] = {"name": name, "epoch": epoch, "step": step, "attempt": attempt}
        url = f"/tasks/{task_id}/checkpoints"
        if parts:
            response = self._call(
                "POST",
                url,
                params=params,
                files={"checkpoint": (name, body, "application/octet-stream")},
                data={"parts": json.dumps(parts)},
            )
            # A portal older than this agent would store the form itself as the file.
            if response.json().get("sharded_files") != len(parts):
                raise Conflict(
                    f"the portal did not take checkpoint {name!r}'s {len(parts)} state files "
                    "(a portal older than this agent?)",
                    "parts",
                )
        else:
            response = self._call("POST", url, content=body, params=params)
        return int(response.json()["id"])

    def checkpoint_part(self, task_id: int, *, part: str, body: bytes, attempt: int = 1) -> None:
        """Upload a file of a checkpoint's state folder (``part``: ``<name>.dcp/<file>``)."""
        self._call(
            "POST",
            f"/tasks/{task_id}/checkpoint-parts",
            content=body,
            params={"part": part, "attempt": attempt},
        )

    def checkpoint_parts(self, task_id: int, checkpoint_id: int) -> dict[str, list[str]]:
        """A stored checkpoint's sharded-state files: ``parts`` and those ``missing``."""
        return dict(self._call("GET", f"/tasks/{task_id}/checkpoints/{checkpoint_id}/parts").json())

    def fetch_checkpoint_part(self, task_id: int, checkpoint_id: int, part: str) -> bytes:
        """One stored file of a checkpoint's state folder (to resume from)."""
        return self._call(
            "GET", f"/tasks/{task_id}/checkpoints/{checkpoint_id}/parts/{part}"
        ).content

    def alarm(
        self, task_id: int, *, reason: str, group: str, attempt: int = 1, kind: str = "alarm"
    ) -> None:
        """Raise an alarm event of the task about group ``group`` (``kind`` ``guard``: a guard
        event, the guard parked the group or took it back)."""
        self._call(
            "POST",
            f"/tasks/{task_id}/alarms",
            json={"reason": reason, "group": group, "attempt": attempt, "kind": kind},
        )

    def trial(self, task_id: int, result: dict[str, Any]) -> None:
        """Store a plan's trial timings (the trial task's parameter server reported them)."""
        self._call("PUT", f"/tasks/{task_id}/trial", json=result)

    def provenance(self, task_id: int, checkpoint_id: int, provenance: dict[str, Any]) -> None:
        """Store the shard provenance checkpoint ``checkpoint_id`` carried."""
        self._call(
            "PUT", f"/tasks/{task_id}/checkpoints/{checkpoint_id}/provenance", json=provenance
        )
