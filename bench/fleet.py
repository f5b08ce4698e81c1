"""Simulated agents: lightweight asyncio clients of the internal API (bench/agent_fleet.py).

Each `SimAgent` makes the calls the real agent (`worker/agent/`) makes, at its rates
(`Rates`), with bodies of the `contracts.agent_api` shapes: it registers with real
`Hardware`, heartbeats (with per-rank `samples` every third beat, as the agent's 15 s
`SAMPLE_EVERY_S` over a 5 s beat), takes sub-task messages from its group's queue
(`Broker`), claims them, publishes or reads the rendezvous, long-polls the task's state
(learning of a cancellation from it or from the heartbeat's answer, as the agent's
`StateWatch` and `TaskStates`), reports logs, progress and metrics in one request (the
agent's `Reporter`: `Report`), and reports the sub-task finished. No rank runs: the
"training" is a sleep of `Rates.task_s` seconds.

One event loop drives every agent of a process; each agent has its own HTTP connection
pool (as each real agent process has), and each request's latency is timed client-side
and kept per time window (`Window`) in a `Recorder`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx

from contracts.agent_api import (
    ACTIVE_STATUSES,
    REPORT_MAX_ITEMS,
    STATE_WAIT_S,
    Hardware,
    HeartbeatReply,
    Report,
)
from contracts.messaging import queue_name
from contracts.payload import SubTaskPayload
from worker.agent.client import CALLER_RETRIES
from worker.agent.reporter import OUTAGE_LIMIT_S, OUTAGE_RETRY_S
from worker.engine.ranks import node_name

HARDWARE = Hardware(
    device_type="cuda",
    device_model="NVIDIA A100-SXM4-80GB",
    device_memory_mb=81_920,
    cpu_cores=128,
    memory_bytes=2 * 1024**4,
    cuda_devices=["NVIDIA A100-SXM4-80GB"] * 8,
    platform="Linux-5.15.0-105-generic-x86_64-with-glibc2.35",
    torch="2.13.0+cu121",
)
"""What every simulated host reports: an 8-GPU A100 server (one agent, 8 workers)."""
WORKERS = 8


@dataclass(frozen=True)
class Rates:
    """How often a simulated agent calls the API (seconds unless named otherwise).

    `heartbeat_s`: the beat (issue 19's 5 s; the agent's default `heartbeat_interval_s` is
    3 s), measured like the real agent's: the wait starts after the previous beat's answer.
    `sample_every`: beats per resource sample (15 s / 5 s). `state_wait_s`: a running
    sub-task's long-poll of its task's state (`GET /tasks/{id}/state?status=&attempt=
    &wait_s=`, the agent's `StateWatch`): answered at a change, else after this.
    `report_s`: one `POST /tasks/{id}/report` (`Report`: `log_lines` lines and the progress)
    per running sub-task (the agent's `Reporter` flushes at most every 0.5 s while output
    comes; a training loop that logs every few seconds makes one flush every 2 s).
    `metrics_s`: an epoch's metrics (3 per worker rank and 4 of the parameter server), sent
    with the next report. When a sub-task ends, one more report, as the reporter's final
    flush.
    `task_s`: how long a claimed sub-task "trains" (uniform in the range).
    `broker_poll_s`: the BRPOP timeout of an idle agent (kombu's Redis channel: 1 s).
    """

    heartbeat_s: float = 5.0
    sample_every: int = 3
    state_wait_s: float = STATE_WAIT_S
    report_s: float = 2.0
    log_lines: int = 4
    metrics_s: float = 30.0
    task_s: tuple[float, float] = (60.0, 180.0)
    broker_poll_s: float = 1.0
    rendezvous_poll_s: float = 0.5


@dataclass(frozen=True)
class Window:
    """A measured interval of wall-clock time (`time.time()`, s), labelled (e.g. "250")."""

    label: str
    start: float
    end: float


class Broker(Protocol):
    """Where an idle agent takes the next sub-task message of its own queue
    (`contracts.messaging.queue_name`: the group's parts booked for that agent) from."""

    async def take(self, queue: str, timeout_s: float) -> dict[str, Any] | None:
        """The next message's payload (a `SubTaskPayload` as JSON) or None after `timeout_s`."""
        ...

    async def close(self) -> None: ...


class MemoryBroker:
    """An in-process queue per agent queue name (tests: the scheduler's payloads `put` here)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = defaultdict(asyncio.Queue)

    def put(self, queue: str, payload: dict[str, Any]) -> None:
        self._queues[queue].put_nowait(payload)

    async def take(self, queue: str, timeout_s: float) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self._queues[queue].get(), timeout_s)
        except TimeoutError:
            return None

    async def close(self) -> None:
        return None


class RedisBroker:
    """The agents' queues of the API's Celery producer on Redis, read as a Celery consumer
    reads them: one connection per agent, BRPOP on `rg.<group>.agent-<id>` with a 1 s
    timeout (kombu's Redis channel), the payload decoded from Celery's message (protocol 2:
    a base64 JSON body `[args, kwargs, embed]`, the payload being `args[0]`)."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(url, single_connection_client=True)

    async def take(self, queue: str, timeout_s: float) -> dict[str, Any] | None:
        """The next message, or None after ``timeout_s``; while Redis is unreachable (a
        restart), None after a second's wait, the next call reconnecting, as a Celery
        worker's consumer does."""
        from redis.exceptions import ConnectionError as RedisDown
        from redis.exceptions import TimeoutError as RedisTimeout

        try:
            found = await self._redis.brpop([queue], timeout=max(1, round(timeout_s)))
        except (RedisDown, RedisTimeout):
            await asyncio.sleep(1.0)
            return None
        if found is None:
            return None
        message = json.loads(found[1])
        args = json.loads(base64.b64decode(message["body"]))[0]
        return dict(args[0])

    async def close(self) -> None:
        await self._redis.aclose()


class Recorder:
    """Client-side latencies (ms) and errors per window and request kind, plus the loop's
    lag (how late a 100 ms timer fires: the generator's own saturation)."""

    def __init__(self, windows: list[Window]) -> None:
        self.windows = windows
        self.latency: dict[str, dict[str, list[float]]] = {
            w.label: defaultdict(list) for w in windows
        }
        self.errors: dict[str, Counter[str]] = {w.label: Counter() for w in windows}
        self.lag: dict[str, list[float]] = {w.label: [] for w in windows}
        self.totals: Counter[str] = Counter()

    def _window(self, now: float) -> str | None:
        for window in self.windows:
            if window.start <= now < window.end:
                return window.label
        return None

    def request(self, kind: str, ms: float, error: str | None, at: float | None = None) -> None:
        """One request's latency, or its error, in the window of ``at`` (when it was sent,
        `time.time()`; default now)."""
        self.totals[kind if error is None else f"{kind}:{error}"] += 1
        label = self._window(time.time() if at is None else at)
        if label is None:
            return
        if error is None:
            self.latency[label][kind].append(ms)
        else:
            self.errors[label][f"{kind}:{error}"] += 1

    def loop_lag(self, ms: float) -> None:
        label = self._window(time.time())
        if label is not None:
            self.lag[label].append(ms)


def percentile(values: list[float], q: float) -> float | None:
    """The `q`-quantile (0..1) of `values`, nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(latency: dict[str, list[float]], errors: Counter[str]) -> dict[str, Any]:
    """Per request kind: answered count, errors (an error status, or no answer after every
    try), transport retries, p50 and p99 in ms (rounded to 0.1)."""
    kinds = sorted(set(latency) | {key.split(":")[0] for key in errors})
    out: dict[str, Any] = {}
    for kind in kinds:
        values = latency.get(kind, [])
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        mine = {key.split(":", 1)[1]: n for key, n in errors.items() if key.split(":")[0] == kind}
        out[kind] = {
            "count": len(values),
            "errors": sum(n for what, n in mine.items() if not what.startswith("retried")),
            "retries": sum(n for what, n in mine.items() if what.startswith("retried")),
            "p50_ms": None if p50 is None else round(p50, 1),
            "p99_ms": None if p99 is None else round(p99, 1),
        }
    return out


@dataclass
class Ledger:
    """What the API told a generator's agents it took, for bench/fleet_faults.py to hold
    against the database: every sub-task claimed (`claims`: sub-task id, agent name; a 204),
    every log line a report carried that was answered 2xx (`acked`: "task:attempt:node" ->
    seqs), the lines an agent gave up on (`dropped`: a sub-task's last report failed after
    every retry), and the parts failed because every report failed for `OUTAGE_LIMIT_S`
    (`gave_up`); and every claim not taken (`refused`: sub-task id, agent name, the answer:
    a status and its text, or that none came), which explains a part the database holds
    for an agent that was never told."""

    claims: list[tuple[int, str]] = field(default_factory=list)
    refused: list[tuple[int, str, str]] = field(default_factory=list)
    acked: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    dropped: int = 0
    gave_up: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "claims": self.claims,
            "refused": self.refused,
            "acked": dict(self.acked),
            "dropped": self.dropped,
            "gave_up": self.gave_up,
        }

    @staticmethod
    def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Several generators' `as_json()` as one."""
        acked: dict[str, list[int]] = defaultdict(list)
        for part in parts:
            for key, seqs in part["acked"].items():
                acked[key] += seqs
        return {
            "claims": [c for part in parts for c in part["claims"]],
            "refused": [r for part in parts for r in part.get("refused", [])],
            "acked": dict(acked),
            "dropped": sum(part["dropped"] for part in parts),
            "gave_up": sum(part["gave_up"] for part in parts),
        }


@dataclass
class Unsent:
    """A running sub-task's reporter buffer (the agent's `Reporter`): the lines and metrics
    not yet taken by the API, since when every report failed, and when the next may go
    (`time.monotonic()`, s)."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    metric_seq: dict[str, int] = field(default_factory=dict)  # each node's next metric number
    failing_since: float | None = None
    retry_at: float = 0.0


@dataclass
class SimAgent:
    """One simulated host: an agent of `group` with `WORKERS` workers.

    `running` holds the sub-task it runs (task id, ranks) for its heartbeats; `state` the
    latest (status, attempt) of its task, from the long-poll or a heartbeat's answer;
    `stopped` is set when that state says the sub-task must stop.
    """

    index: int
    group: str
    http: httpx.AsyncClient
    recorder: Recorder
    rates: Rates
    broker: Broker | None
    name: str = ""
    host: str = ""
    agent_id: int | None = None
    heartbeats: int = 0
    running: dict[str, Any] | None = None
    state: tuple[str, int] | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    rng: random.Random = field(default_factory=random.Random)
    ledger: Ledger = field(default_factory=Ledger)

    def __post_init__(self) -> None:
        self.name = self.name or f"sim-{self.index:04d}"
        self.host = (
            self.host
            or f"10.{64 + self.index // 65_536}.{self.index // 256 % 256}.{self.index % 256}"
        )
        self.rng = random.Random(self.index)

    async def call(
        self, kind: str, method: str, path: str, *, tries: int = 6, **kwargs: Any
    ) -> httpx.Response | None:
        """One request, timed from its first try to its answer; None if every try failed.

        As the agent's `InternalApi`: a transport error (e.g. the server closed an idle
        keep-alive connection as the request left) or a 5xx answer is tried again after 0.5,
        1, 2, 4, 5 s (`tries`, 6 in all by default; a heartbeat's 2, a report's and a claim's
        3, as the agent's); each
        retry is counted (`kind:retried-<error>`), the latency includes the waits, and a
        request that failed every try is an error (`kind:<error>`).
        """
        started, sent, delay = time.perf_counter(), time.time(), 0.5
        last = tries - 1
        for attempt in range(tries):
            try:
                response = await self.http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt == last:
                    self.recorder.request(kind, 0.0, type(exc).__name__, sent)
                    return None
                self.recorder.request(kind, 0.0, f"retried-{type(exc).__name__}", sent)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if response.status_code < 500 or attempt == last:
                break
            self.recorder.request(kind, 0.0, f"retried-{response.status_code}", sent)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        ms = (time.perf_counter() - started) * 1000
        ok = response.status_code < 400 or (kind == "claim" and response.status_code == 409)
        self.recorder.request(kind, ms, None if ok else str(response.status_code), sent)
        return response

    async def register(self) -> bool:
        """`GET` the group's device, then register; whether the API took the agent."""
        await self.call("group_device", "GET", f"/resource-groups/{self.group}")
        response = await self.call(
            "register",
            "POST",
            "/agents/register",
            json={
                "name": self.name,
                "instance_id": f"{self.name}-instance",
                "host": self.host,
                "resource_group": self.group,
                "workers": WORKERS,
                "hardware": HARDWARE.model_dump(),
            },
        )
        if response is None or response.status_code != 200:
            return False
        self.agent_id = int(response.json()["id"])
        return True

    def _running(self) -> list[dict[str, Any]]:
        """The heartbeat's `running`, with resource samples every `sample_every` beats."""
        if self.running is None:
            return []
        entry: dict[str, Any] = {"task_id": self.running["task_id"], "ranks": self.running["ranks"]}
        if self.heartbeats % self.rates.sample_every == 0:
            entry["samples"] = [
                {
                    "rank": rank,
                    "cpu_percent": round(self.rng.uniform(90, 105), 1),
                    "rss_mb": round(self.rng.uniform(1000, 3000), 1),
                    "gpu_util": round(self.rng.uniform(70, 99), 1),
                    "gpu_mem_mb": round(self.rng.uniform(30_000, 70_000), 1),
                }
                for rank in self.running["ranks"]
            ]
        return [entry]

    async def beat(self) -> None:
        """Heartbeat every `heartbeat_s` after the previous answer, as the agent's thread,
        naming the running task (`tasks`) and learning its state from the answer."""
        while True:
            await asyncio.sleep(self.rates.heartbeat_s)
            self.heartbeats += 1
            running = self.running
            body: dict[str, Any] = {"running": self._running()}
            if running is not None:
                body["tasks"] = [running["task_id"]]
            # Tried twice, as the agent's (`InternalApi.heartbeat`): the next beat comes
            # one interval later.
            response = await self.call(
                "heartbeat", "POST", f"/agents/{self.agent_id}/heartbeat", tries=2, json=body
            )
            if running is None or response is None or response.status_code != 200:
                continue
            for state in HeartbeatReply.model_validate(response.json()).tasks:
                if state.task_id == running["task_id"] and self.running is running:
                    self._learn(state.status, state.attempt, running["attempt"])

    def _learn(self, status: str, attempt: int, mine: int) -> None:
        """A state of the running task: `stopped` once it is not active in attempt `mine`."""
        self.state = (status, attempt)
        if status not in ACTIVE_STATUSES or attempt != mine:
            self.stopped.set()

    async def watch_state(self, task: str, payload: SubTaskPayload) -> None:
        """The agent's `StateWatch`: ask the state at once, then long-poll it with the state
        known until the sub-task must stop (or this watch is cancelled as it ends)."""
        while not self.stopped.is_set():
            params: dict[str, Any] = {"attempt": payload.attempt}
            if self.state is not None:
                params.update(
                    status=self.state[0], attempt=self.state[1], wait_s=self.rates.state_wait_s
                )
            response = await self.call(
                "state_wait",
                "GET",
                f"{task}/state",
                params=params,
                timeout=self.rates.state_wait_s + 30.0,
            )
            if response is None or response.status_code != 200:
                await asyncio.sleep(1.0)
                continue
            found = response.json()
            self._learn(found["status"], found["attempt"], payload.attempt)

    async def serve(self) -> None:
        """Take the group's messages one at a time and run each (no message while busy)."""
        assert self.broker is not None and self.agent_id is not None
        queue = queue_name(self.group, self.agent_id)
        while True:
            raw = await self.broker.take(queue, self.rates.broker_poll_s)
            if raw is not None:
                await self.run_sub_task(SubTaskPayload.model_validate(raw))

    async def run_sub_task(self, payload: SubTaskPayload) -> None:
        """Claim, meet at the rendezvous, "train" with the agent's reports, finish.

        As the agent's runner: a claim the API could not answer (every try a transport error
        or a 5xx) is tried again `OUTAGE_RETRY_S` later with the same claim id, for up to
        `OUTAGE_LIMIT_S`."""
        body = {
            "agent_id": self.agent_id,
            "host": self.host,
            "attempt": payload.attempt,
            "claim_id": secrets.token_hex(16),
        }
        began = time.monotonic()
        while True:
            response = await self.call(
                "claim",
                "POST",
                f"/sub-tasks/{payload.sub_task_id}/claim",
                tries=1 + CALLER_RETRIES,  # as the agent's: its own clock tries again
                json=body,
            )
            unanswered = response is None or response.status_code >= 500
            if not unanswered or time.monotonic() - began > OUTAGE_LIMIT_S:
                break
            await asyncio.sleep(OUTAGE_RETRY_S)
        if response is None or response.status_code != 204:
            answer = (
                f"no answer after {time.monotonic() - began:.0f} s"
                if response is None
                else f"{response.status_code}: {response.text[:300]}"
            )
            self.ledger.refused.append((payload.sub_task_id, self.name, answer))
            return
        self.ledger.claims.append((payload.sub_task_id, self.name))
        task = f"/tasks/{payload.task_id}"
        if payload.hosts_parameter_server:
            await self.call(
                "rendezvous",
                "PUT",
                f"{task}/rendezvous",
                json={"master_addr": self.host, "master_port": 29500, "attempt": payload.attempt},
            )
        else:
            await self._await_rendezvous(task)
        ranks = ([0] if payload.hosts_parameter_server else []) + list(payload.ranks)
        self.state, self.stopped = None, asyncio.Event()
        self.running = {"task_id": payload.task_id, "ranks": ranks, "attempt": payload.attempt}
        watch = asyncio.create_task(self.watch_state(task, payload))
        try:
            outcome = await self._train(task, payload, ranks)
        finally:
            self.running = None
            watch.cancel()
        cause = "infra" if outcome.startswith("infra") else "stopped" if outcome else "user"
        await self.call(
            "finished",
            "POST",
            f"/sub-tasks/{payload.sub_task_id}/finished",
            json={
                "succeeded": outcome == "",
                "detail": outcome or "done",
                "cause": cause,
            },
        )

    async def _await_rendezvous(self, task: str) -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            response = await self.call("rendezvous", "GET", f"{task}/rendezvous")
            if (
                response is not None
                and response.status_code == 200
                and response.json()["master_port"]
            ):
                return
            await asyncio.sleep(self.rates.rendezvous_poll_s)

    async def _train(self, task: str, payload: SubTaskPayload, ranks: list[int]) -> str:
        """Report logs and progress (and an epoch's metrics when due) until done, or until
        the task's state says stop; "" or why it stopped ("infra: ..." when the API failed
        every report for `OUTAGE_LIMIT_S`, as the agent's reporter then fails the part).

        As the agent's `Reporter`: a failed report keeps its lines and metrics for the next,
        which goes `OUTAGE_RETRY_S` later."""
        rates, seq = self.rates, 0
        started = time.monotonic()
        duration = self.rng.uniform(*rates.task_s)
        next_metrics = started + rates.metrics_s
        epoch, buffer = 0, Unsent()
        while (now := time.monotonic()) - started < duration:
            wake = min(rates.report_s, max(0.0, started + duration - now))
            try:
                await asyncio.wait_for(self.stopped.wait(), wake)
            except TimeoutError:
                pass
            if self.stopped.is_set():
                status = self.state[0] if self.state else "gone"
                if buffer.lines or buffer.metrics:  # the reporter's flush as the ranks stop
                    await self._report_last(task, payload, epoch, buffer)
                self.ledger.dropped += len(buffer.lines)
                return f"stopped: task is {status}"
            now = time.monotonic()
            if now >= next_metrics:
                next_metrics += rates.metrics_s
                epoch += 1
                buffer.metrics += self._metrics(buffer, payload.attempt, ranks, epoch, seq)
            seq = self._output(buffer, payload, ranks, seq)
            if now < buffer.retry_at:
                continue
            if await self._report(task, payload, epoch, (now - started) / duration, buffer):
                buffer.failing_since, buffer.retry_at = None, 0.0
                continue
            buffer.failing_since = buffer.failing_since or now
            if now - buffer.failing_since > OUTAGE_LIMIT_S:
                self.ledger.dropped += len(buffer.lines)
                self.ledger.gave_up += 1
                return f"infra: every report failed for {OUTAGE_LIMIT_S:.0f} s"
            buffer.retry_at = now + OUTAGE_RETRY_S
        # As an agent's reporter flushes when its ranks end: the last interval's report goes
        # out, with the last epoch's metrics.
        buffer.metrics += self._metrics(buffer, payload.attempt, ranks, epoch + 1, seq)
        self._output(buffer, payload, ranks, seq)
        await self._report_last(task, payload, epoch, buffer)
        self.ledger.dropped += len(buffer.lines)
        return ""

    async def _report_last(
        self, task: str, payload: SubTaskPayload, epoch: int, buffer: Unsent
    ) -> None:
        """The last report, as the ranks end: tried again every `OUTAGE_RETRY_S` while the
        API fails it, until `OUTAGE_LIMIT_S` of failed reports, as the agent's
        `Reporter.flush_last`; what is still unsent then is the caller's to count."""
        while not await self._report(task, payload, epoch, 1.0, buffer):
            now = time.monotonic()
            buffer.failing_since = buffer.failing_since or now
            if now - buffer.failing_since > OUTAGE_LIMIT_S:
                return
            await asyncio.sleep(OUTAGE_RETRY_S)

    def _output(self, buffer: Unsent, payload: SubTaskPayload, ranks: list[int], seq: int) -> int:
        """``log_lines`` more lines from ``seq`` into ``buffer``; the next seq."""
        stamp = datetime.now(UTC).replace(tzinfo=None).isoformat()
        buffer.lines += [
            {
                "attempt": payload.attempt,
                "node": f"worker-{ranks[-1]}",
                "seq": seq + i,
                "time": stamp,
                "text": f"step {seq + i}: loss {self.rng.uniform(0.1, 2.0):.4f}",
            }
            for i in range(self.rates.log_lines)
        ]
        return seq + self.rates.log_lines

    async def _report(
        self, task: str, payload: SubTaskPayload, epoch: int, done: float, buffer: Unsent
    ) -> bool:
        """One report (`Report`) of what ``buffer`` holds (up to `REPORT_MAX_ITEMS` lines and
        metrics: a few seconds' worth here) and the progress; whether the API answered 2xx,
        which takes the report's lines and metrics out of ``buffer`` (the lines then count as
        acknowledged, `Ledger.acked`)."""
        lines, metrics = buffer.lines[:REPORT_MAX_ITEMS], buffer.metrics[:REPORT_MAX_ITEMS]
        report = Report.model_validate(
            {
                "lines": lines,
                "metrics": metrics,
                "progress": {
                    "progress": min(1.0, done),
                    "epoch": epoch,
                    "attempt": payload.attempt,
                },
            }
        )
        response = await self.call(
            "report",
            "POST",
            f"{task}/report",
            tries=1 + CALLER_RETRIES,  # as the agent's: the next flush tries again
            json=report.model_dump(mode="json"),
        )
        if response is None or response.status_code >= 300:
            return False
        for line in lines:
            key = f"{payload.task_id}:{line['attempt']}:{line['node']}"
            self.ledger.acked[key].append(line["seq"])
        del buffer.lines[: len(lines)], buffer.metrics[: len(metrics)]
        return True

    def _metrics(
        self, buffer: Unsent, attempt: int, ranks: list[int], epoch: int, step: int
    ) -> list[dict[str, Any]]:
        """An epoch's metrics: 3 per worker rank, 4 of the parameter server (rank 0), each
        numbered in its node's sequence (`buffer.metric_seq`), as the agent's reporter does."""
        wanted = [
            (rank, name)
            for rank in ranks
            if rank > 0
            for name in ("samples_per_s", "batch_share", "idle_fraction")
        ] + [
            (0, name)
            for name in ("train_loss", "val_loss", "val_accuracy", "update_norm")
            if 0 in ranks
        ]
        out = []
        for rank, name in wanted:
            node = node_name(rank)
            number = buffer.metric_seq.get(node, 0)
            buffer.metric_seq[node] = number + 1
            metric = {"name": name, "value": round(self.rng.uniform(0, 1), 4), "step": step}
            metric.update(epoch=epoch, attempt=attempt, node=node, seq=number)
            if rank > 0:
                metric["rank"] = rank
            out.append(metric)
        return out


@dataclass(frozen=True)
class AgentPlan:
    """A simulated agent to start: its index, group and start time (`time.time()`, s)."""

    index: int
    group: str
    start_at: float


async def simulate(
    plans: list[AgentPlan],
    *,
    client: Callable[[], httpx.AsyncClient],
    broker: Callable[[], Broker] | None,
    windows: list[Window],
    until: float,
    rates: Rates = Rates(),
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Run the agents of `plans` until `until` (`time.time()`, s) or until `stop` is set,
    whichever comes first; the report per window.

    `client()` makes one agent's HTTP client (base URL `.../internal/v1`, the agent token);
    `broker()` one agent's broker connection (None: agents take no sub-tasks). Returns
    `{"registered", "register_failed", "heartbeats", "windows": [{"label", "latency_ms":
    {kind: [every latency]}, "errors": {"kind:status": count}, "cpu_s" (this process's CPU
    seconds in the window), "loop_lag_p99_ms"}], "totals", "ledger"}` (`Ledger.as_json`;
    `merge` pools several).
    """
    recorder = Recorder(windows)
    ledger = Ledger()
    agents: list[SimAgent] = []
    closers: list[Callable[[], Any]] = []
    jobs: list[asyncio.Task[None]] = []
    cpu: dict[str, list[float]] = {w.label: [] for w in windows}
    failed = 0

    async def start(plan: AgentPlan) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, plan.start_at - time.time()))
        http = client()
        closers.append(http.aclose)
        agent = SimAgent(plan.index, plan.group, http, recorder, rates, None, ledger=ledger)
        if not await agent.register():
            failed += 1
            return
        agents.append(agent)
        jobs.append(asyncio.create_task(agent.beat()))
        if broker is not None:
            agent.broker = broker()
            closers.append(agent.broker.close)
            jobs.append(asyncio.create_task(agent.serve()))

    async def clock() -> None:
        """Loop lag every 100 ms, and this process's CPU time at each window's ends."""
        marks = sorted((t, w.label) for w in windows for t in (w.start, w.end))
        while True:
            due = time.perf_counter() + 0.1
            await asyncio.sleep(0.1)
            recorder.loop_lag((time.perf_counter() - due) * 1000)
            while marks and time.time() >= marks[0][0]:
                cpu[marks.pop(0)[1]].append(time.process_time())

    starters = [asyncio.create_task(start(plan)) for plan in plans]
    ticker = asyncio.create_task(clock())
    stopped = asyncio.create_task((stop or asyncio.Event()).wait())
    await asyncio.wait([stopped], timeout=max(0.0, until - time.time()))
    stopped.cancel()
    for job in [*starters, *jobs, ticker]:
        job.cancel()

    async def close_all() -> None:
        await asyncio.gather(*starters, *jobs, ticker, return_exceptions=True)
        await asyncio.gather(*(close() for close in closers), return_exceptions=True)

    try:  # a bounded clean-up: the report must not wait on a thousand slow closes
        await asyncio.wait_for(close_all(), timeout=10.0)
    except TimeoutError:
        pass
    report = []
    for window in windows:
        marks, lag = cpu[window.label], recorder.lag[window.label]
        report.append(
            {
                "label": window.label,
                "latency_ms": dict(recorder.latency[window.label]),
                "errors": dict(recorder.errors[window.label]),
                "cpu_s": round(marks[1] - marks[0], 3) if len(marks) == 2 else None,
                "loop_lag_p99_ms": round(percentile(lag, 0.99) or 0.0, 1) if lag else None,
            }
        )
    return {
        "registered": len(agents),
        "register_failed": failed,
        "heartbeats": sum(a.heartbeats for a in agents),
        "windows": report,
        "totals": dict(recorder.totals),
        "ledger": ledger.as_json(),
    }


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The reports of several generator processes (`simulate`) as one: counts summed, each
    window's latencies pooled and summarized (`summarize`), its errors summed, each
    process's CPU seconds and loop lag kept in a list (one entry per process)."""
    windows = []
    for i, first in enumerate(reports[0]["windows"]):
        parts = [r["windows"][i] for r in reports]
        latency: dict[str, list[float]] = defaultdict(list)
        errors: Counter[str] = Counter()
        for part in parts:
            errors.update(part["errors"])
            for kind, values in part["latency_ms"].items():
                latency[kind] += values
        windows.append(
            {
                "label": first["label"],
                "requests": summarize(latency, errors),
                "errors": dict(errors),
                "cpu_s": [part["cpu_s"] for part in parts],
                "loop_lag_p99_ms": [part["loop_lag_p99_ms"] for part in parts],
            }
        )
    return {
        "registered": sum(r["registered"] for r in reports),
        "register_failed": sum(r["register_failed"] for r in reports),
        "heartbeats": sum(r["heartbeats"] for r in reports),
        "windows": windows,
        "ledger": Ledger.merged([r["ledger"] for r in reports]),
    }
