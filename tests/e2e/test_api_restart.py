"""Restarting the API mid-training raises no false heartbeat alarm.

The API (and its scheduler) is stopped for longer than the heartbeat timeout
while a task trains; the agents' heartbeats fail meanwhile. The new process
gives every agent one full timeout from its start: the healthy task goes on
and succeeds on its first attempt, with no alarm and no restart. A second
agent under a live agent's name exits saying so, and the holder is untouched.
"""

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polytrain.stack import GroupSetup, LocalStack
from tests.e2e.conftest import COLD_RANKS, new_version, submit, wait_for
from worker.engine.ranks import free_port

TIMEOUT_S = 6.0
ENDED = {"SUCCEEDED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {
        "POLYTRAIN_HEARTBEAT_TIMEOUT_S": str(TIMEOUT_S),
        "POLYTRAIN_HEARTBEAT_INTERVAL_S": "1",
        "POLYTRAIN_SCHEDULER_INTERVAL_S": "0.5",
        **COLD_RANKS,
    }
    with LocalStack(
        data_dir=tmp_path_factory.mktemp("restart"),
        port=free_port(),
        groups=[GroupSetup("cpu-a", 2), GroupSetup("cpu-b", 1)],
        extra_env=env,
    ) as running:
        yield running


def test_api_down_longer_than_the_heartbeat_timeout_raises_no_alarm(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        version = new_version(api, example="mnist_cnn")
        task = submit(api, version, epochs=4, global_batch_size=64, seed=7)
        wait_for(api, task["id"], {"RUNNING"} | ENDED, 120)
    stack.stop_api()  # a group may still be claiming its sub-task: that must survive too
    time.sleep(TIMEOUT_S + 4)  # the agents' heartbeats fail for longer than the timeout
    stack.start_api()
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        done = wait_for(api, task["id"], ENDED, 300)
        events = api.get(f"/api/v1/tasks/{task['id']}/events").json()
        timeline = [(e["kind"], e["to_status"], e["reason"]) for e in events]
        assert done["status"] == "SUCCEEDED", done["status_reason"]
        assert done["attempt"] == 1, f"{timeline}; logs in {stack.data_dir}"
        assert [e for e in events if e["kind"] == "alarm"] == []
        assert "RESTARTING" not in [e["to_status"] for e in events]
        agents = api.get("/api/v1/agents").json()
        assert {a["name"] for a in agents if a["online"]} == {"agent-cpu-a", "agent-cpu-b"}


def test_second_agent_with_a_live_name_exits_naming_the_clash(
    stack: LocalStack, tmp_path: Path
) -> None:
    args = [
        sys.executable,
        "-m",
        "polytrain.cli",
        "agent",
        "--resource-group",
        "cpu-a",
        "--workers",
        "1",
        "--name",
        "agent-cpu-a",
    ]
    # Another host (its own data dir): the API refuses the name while agent-cpu-a lives.
    elsewhere = subprocess.run(
        args,
        env={**stack.env(), "POLYTRAIN_DATA_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert elsewhere.returncode == 2, elsewhere.stderr
    assert "agent refused: agent name 'agent-cpu-a' is in use by a live agent on" in (
        elsewhere.stderr
    )
    # This host, same data dir: refused before it even asks the API.
    here = subprocess.run(args, env=stack.env(), capture_output=True, text=True, timeout=120)
    assert here.returncode == 2, here.stderr
    assert "is in use by another agent on this host" in here.stderr
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        agents = {a["name"]: a for a in api.get("/api/v1/agents").json()}
    assert agents["agent-cpu-a"]["online"] and len(agents) == 2  # the holder is untouched
