"""`polytrain plan task.yaml` against a real HTTP server: it starts a plan from the task file,
waits while the trial runs (its timings are reported through the internal API, as a trial's
parameter server does), shows the options with the recommendation and the left-out groups,
prints JSON, submits the planned task; a bad file exits naming the field; Ctrl-C leaves the
plan running and says how to cancel it."""

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from polytrain.client import commands
from tests.backend.plans.test_plans_api import _timings
from tests.conftest import ADMIN_EMAIL, add_account, agent_headers, make_group

TASK_FILE = """\
project: planned
example: tiny_regression
name: planned run
epochs: 3
global_batch_size: 64
priority: 5
resource_groups:
  - {name: cpu-a, workers: 2}
  - {name: cpu-b, workers: 1}
"""


@pytest.fixture
def api(server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    """The admin's REST client; the CLI uses the same account's token."""
    admin = add_account(ADMIN_EMAIL, admin=True)
    monkeypatch.setenv("POLYTRAIN_TOKEN", admin.token)
    with httpx.Client(base_url=server, headers=admin.headers, timeout=30) as client:
        make_group(client, "cpu-a", capacity=2)  # type: ignore[arg-type]
        make_group(client, "cpu-b", capacity=1)  # type: ignore[arg-type]
        yield client


@contextmanager
def trials_reported(api: httpx.Client, **timings: float) -> Iterator[list[int]]:
    """While inside: each new plan's trial reports `_timings(**timings)` (as its parameter
    server would) a moment after the plan is created; yields the reported plan ids."""
    reported: list[int] = []
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(0.1):
            for plan in api.get("/api/v1/plans").json():
                if plan["status"] == "trial" and plan["id"] not in reported:
                    api.put(
                        f"/internal/v1/tasks/{plan['trial_task_id']}/trial",
                        headers=agent_headers(),
                        json=_timings(**timings),
                    ).raise_for_status()
                    reported.append(plan["id"])

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    try:
        yield reported
    finally:
        stop.set()
        thread.join(10)


def _task_file(tmp_path: Path, text: str = TASK_FILE) -> str:
    path = tmp_path / "task.yaml"
    path.write_text(text)
    return str(path)


def test_plan_shows_the_recommendation_prints_json_and_submits(  # type: ignore[no-untyped-def]
    run, api: httpx.Client, tmp_path: Path
) -> None:
    task_file = _task_file(tmp_path)
    with trials_reported(api, slow_a=0.5) as reported:  # cpu-b's fixed step cost is 0.5 s
        shown = run("plan", task_file)
        assert shown.exit_code == 0, shown.output
        assert "plan 1: trial task 1 queued on cpu-a, cpu-b" in shown.output
        assert "plan 1 ready: 6 options" in shown.output  # 3 subsets × 2 split policies
        assert "★ recommended: cpu-a × 2, " in shown.output
        starred = [line for line in shown.output.splitlines() if "★" in line]
        assert "cpu-a × 2" in starred[0] and "cpu-b" not in starred[0]  # its table row
        left_out = next(line for line in shown.output.splitlines() if "cpu-b: left out:" in line)
        assert "later" in left_out  # the reason, as the plan gives it
        assert "  cpu-a: 2 worker(s), cannot be left out" in shown.output  # the only group

        printed = run("plan", task_file, "--json")
        assert printed.exit_code == 0, printed.output
        plan = json.loads(printed.stdout)
        assert plan["status"] == "ready" and plan["best"]["workers"] == {"cpu-a": 2}
        assert "cpu-b" in plan["left_out"] and plan["task_request"]["plan_id"] == plan["id"]

        submitted = run("plan", task_file, "--submit")
        assert submitted.exit_code == 0, submitted.output
        plan_id = reported[-1]
    assert f"submitted from plan {plan_id}: planned run (QUEUED, about" in submitted.output
    task_id = int(submitted.output.split("task ")[-1].split(" submitted")[0])
    task = api.get(f"/api/v1/tasks/{task_id}").json()
    assert task["spec"]["plan_id"] == plan_id
    assert task["eta_s"] is not None and task["eta_s"] > 0  # known before its first step
    assert [(g["name"], g["workers"]) for g in task["spec"]["groups"]] == [("cpu-a", 2)]
    assert task["priority"] == 5  # the file's other settings are kept


def test_deadline_names_the_fewest_workers(run, api: httpx.Client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    with trials_reported(api):
        shown = run("plan", _task_file(tmp_path), "--deadline", deadline)
    assert shown.exit_code == 0, shown.output
    answer = next(line for line in shown.output.splitlines() if line.startswith("⏱ deadline"))
    assert "cpu-a × 1 " in answer and "fewest workers predicted to make it" in answer
    assert "★ recommended: cpu-a × 2 + cpu-b × 1, weighted split" in shown.output
    assert "  cpu-b: 1 worker(s), saves " in shown.output  # its marginal gain


def test_a_bad_file_exits_naming_the_field(run, api: httpx.Client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    unknown = TASK_FILE.replace("{name: cpu-b, workers: 1}", "{name: gpu-x, workers: 1}")
    refused = run("plan", _task_file(tmp_path, unknown))
    assert refused.exit_code == 1
    assert "error:" in refused.output and "(field resource_groups.1" in refused.output
    past = run("plan", _task_file(tmp_path), "--deadline", "2020-01-01T00:00:00Z")
    assert past.exit_code == 1 and "(field deadline)" in past.output
    assert api.get("/api/v1/plans").json() == [] and api.get("/api/v1/tasks").json() == []


def test_no_wait_then_ctrl_c_leaves_the_plan_running_and_plan_cancel_stops_it(  # type: ignore[no-untyped-def]
    run, api: httpx.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = run("plan", _task_file(tmp_path), "--no-wait")
    assert started.exit_code == 0, started.output
    assert "plan 1: trial task 1 queued on cpu-a, cpu-b" in started.output
    assert "polytrain plan-cancel 1" in started.output

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(
        commands, "time", SimpleNamespace(monotonic=time.monotonic, sleep=interrupt)
    )
    waited = run("plan-show", "1", "--wait")
    assert waited.exit_code == 130
    assert "plan 1 keeps running (trial task 1)" in waited.output
    assert "polytrain plan-cancel 1" in waited.output
    assert api.get("/api/v1/plans/1").json()["status"] == "trial"

    assert "plan 1 cancelled" in run("plan-cancel", "1").output
    assert api.get("/api/v1/tasks/1").json()["status"] == "CANCELLED"
    shown = run("plan-show", "1")
    assert shown.exit_code == 1 and "plan 1 cancelled" in shown.output
    again = run("plan-cancel", "1")
    assert again.exit_code == 1 and "trial has ended" in again.output
