"""The agent's message handling: one validation per message, the Celery wiring, heartbeats."""

from __future__ import annotations

import logging
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.messaging import RUN_SUBTASK
from contracts.payload import SubTaskPayload
from tests.worker.agent.conftest import make_payload
from tests.worker.agent.fakes import FakeApi
from worker.agent import main
from worker.agent.processes import ProcessSet, RunningRegistry
from worker.config import AgentSettings


class Runner:
    """Records the payloads it is asked to run."""

    def __init__(self) -> None:
        self.runs: list[Any] = []

    def run(self, payload: SubTaskPayload) -> str:
        self.runs.append(payload)
        return "succeeded"


def test_a_valid_message_reaches_the_runner_as_a_payload() -> None:
    runner, payload = Runner(), make_payload()
    raw = payload.model_dump(mode="json")
    assert main.run_validated(runner, "17", raw) == "succeeded"  # type: ignore[arg-type]
    assert runner.runs == [payload] and isinstance(runner.runs[0], SubTaskPayload)


@pytest.mark.parametrize(
    ("message_id", "change"),
    [
        ("17", {"epochs": 0}),
        ("17", {"groups": []}),
        ("99", {}),  # the Celery id is not the sub-task it carries
    ],
)
def test_an_invalid_message_is_dropped_unrun(message_id: str, change: dict[str, Any]) -> None:
    runner = Runner()
    raw = {**make_payload().model_dump(mode="json"), **change}
    assert main.run_validated(runner, message_id, raw) == "invalid"  # type: ignore[arg-type]
    assert runner.runs == []


def test_the_consumer_app_runs_a_sub_task_message(settings: AgentSettings) -> None:
    runner = Runner()
    app = main.make_celery(settings, runner)  # type: ignore[arg-type]
    conf = app.conf
    assert conf.task_acks_late and conf.worker_prefetch_multiplier == 1
    payload = make_payload()
    result = app.tasks[RUN_SUBTASK].apply(args=[payload.model_dump(mode="json")], task_id="17")
    assert result.get() == "succeeded" and runner.runs == [payload]
    other = app.tasks[RUN_SUBTASK].apply(args=[payload.model_dump(mode="json")], task_id="18")
    assert other.get() == "invalid" and len(runner.runs) == 1


def test_the_embedded_broker_is_polled_more_often_than_once_a_second(
    settings: AgentSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queued message reaches the agent within a tenth of a second, not kombu's 1 s; the
    broker's connection (SQLite, which refuses unknown engine options) still opens."""
    from kombu.transport import sqlalchemy as sqla_transport

    monkeypatch.setattr(sqla_transport.Transport, "polling_interval", 1.0)
    Path(settings.data_dir).mkdir(parents=True)
    app = main.make_celery(settings, Runner())  # type: ignore[arg-type]
    with app.connection_for_read() as conn:
        conn.SimpleQueue("rg.cpu-a.agent-1").put({"probe": 1})
        assert conn.transport.polling_interval == settings.broker_poll_s < 1.0
    assert AgentSettings.model_fields["broker_poll_s"].default == 0.1


def test_heartbeats_carry_the_running_ranks_and_survive_an_api_outage(api: FakeApi) -> None:
    registry, procs = RunningRegistry(), ProcessSet()
    alive = subprocess.Popen(
        ["sleep", "30"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    ended = subprocess.Popen(["true"], stdout=subprocess.PIPE, text=True)
    ended.wait()
    procs.add(2, alive)
    procs.add(3, ended)
    registry.add(4, procs)
    registry.add(5, ProcessSet())  # no rank alive: not reported
    api.fail["heartbeat"] = [500, 500]
    stop = threading.Event()

    def stop_after_two(route: str) -> None:
        if route == "heartbeat" and len(api.calls("heartbeat")) >= 2:
            stop.set()

    api.before = stop_after_two
    beating = threading.Thread(
        target=main._heartbeats, args=(api.client(retries=0), 7, 0.01, stop, registry)
    )
    try:
        beating.start()
        beating.join(timeout=10)
        assert not beating.is_alive()
    finally:
        stop.set()
        alive.kill()
        alive.wait()
    assert api.bodies("heartbeat") == [{"running": [{"task_id": 4, "ranks": [2]}]}] * 2
    assert all(r.url.path == "/internal/v1/agents/7/heartbeat" for r in api.requests)


def test_failed_beats_log_an_outage_once_a_new_error_again_and_the_recovery(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = [100.0]
    monkeypatch.setattr(main.time, "monotonic", lambda: clock[0])
    request = httpx.Request("POST", "http://api/internal/v1/agents/7/heartbeat")
    refused = httpx.ConnectError("[Errno 111] Connection refused", request=request)
    unavailable = httpx.HTTPStatusError(
        "503", request=request, response=httpx.Response(503, request=request)
    )
    failures = main.BeatFailures()
    with caplog.at_level(logging.WARNING, logger=main.log.name):
        for _ in range(5):  # the API restarting: one line, not one a beat
            failures.failed(refused, 1.0)
            clock[0] += 1.0
        failures.failed(unavailable, 1.0)  # its database not back yet: a new error, said
        clock[0] += main.BeatFailures.REPEAT_S
        failures.failed(unavailable, 1.0)  # still failing a minute on: said again
        failures.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert "Connection refused" in lines[0] and "failing for 0 s" in lines[0]
    assert "503" in lines[1] and "failing for 5 s" in lines[1]
    assert "failing for 65 s" in lines[2]
    assert lines[3] == "heartbeats reach the API again after 65.0 s"
    assert not any(r.exc_info for r in caplog.records)  # an HTTP error: no traceback
