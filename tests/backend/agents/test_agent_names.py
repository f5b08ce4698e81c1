"""Two agents cannot share a name: a live agent keeps it against any other process.

The same agent restarted (same instance id, kept in its data dir) takes its
name back at once; a second agent elsewhere is refused with 409 naming the
field until the holder is offline.
"""

from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from backend.agents.models import Agent
from backend.core import db
from backend.core.db import utcnow
from tests.conftest import agent_headers, make_group
from worker.agent.identity import NameClash, claim_instance_id


def _register(client: TestClient, instance_id: str | None, host: str = "10.0.0.1"):
    body = {
        "name": "gpu-box",
        "host": host,
        "resource_group": "cpu-a",
        "workers": 1,
        "hardware": {"cpu_cores": 2, "memory_bytes": 1},
    }
    if instance_id is not None:
        body["instance_id"] = instance_id
    return client.post("/internal/v1/agents/register", headers=agent_headers(), json=body)


def test_second_live_agent_with_the_same_name_is_refused(client: TestClient) -> None:
    make_group(client)
    first = _register(client, "a" * 32)
    assert first.status_code == 200, first.text
    for other in ("b" * 32, None):
        refused = _register(client, other, host="10.0.0.2")
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["field"] == "name"
        assert "'gpu-box' is in use by a live agent on 10.0.0.1" in error["message"]
    with db.get_sessionmaker()() as session:  # the holder is untouched
        agent = session.scalar(select(Agent).where(Agent.name == "gpu-box"))
        assert (agent.host, agent.instance_id, agent.online) == ("10.0.0.1", "a" * 32, True)
    # The same agent restarted takes its name back at once.
    again = _register(client, "a" * 32)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


def test_name_of_an_offline_agent_can_be_taken(client: TestClient) -> None:
    make_group(client)
    agent_id = _register(client, "a" * 32).json()["id"]
    with db.get_sessionmaker()() as session:  # silent for longer than the heartbeat timeout
        session.execute(update(Agent).values(last_heartbeat_at=utcnow() - timedelta(seconds=60)))
        session.commit()
    moved = _register(client, "b" * 32, host="10.0.0.2")
    assert moved.status_code == 200 and moved.json()["host"] == "10.0.0.2"
    # ...and so can the name of one that deregistered.
    client.post(f"/internal/v1/agents/{agent_id}/deregister", headers=agent_headers())
    assert _register(client, "c" * 32, host="10.0.0.3").status_code == 200


def test_instance_id_is_kept_in_the_data_dir(tmp_path: Path) -> None:
    first = claim_instance_id(tmp_path, "agent-x")
    assert first == claim_instance_id(tmp_path, "agent-x")  # same process: same id
    assert (tmp_path / "agents" / "agent-x.id").read_text() == first
    assert (tmp_path / "agents" / "agent-x.id").stat().st_mode & 0o777 == 0o600
    assert claim_instance_id(tmp_path, "agent-y") != first


def test_second_process_on_the_same_data_dir_exits_naming_the_clash(tmp_path: Path) -> None:
    import subprocess
    import sys

    claim_instance_id(tmp_path, "agent-z")
    code = (
        "import sys; from worker.agent.identity import claim_instance_id, NameClash\n"
        "try: claim_instance_id(sys.argv[1], 'agent-z')\n"
        "except NameClash as exc: print(exc); sys.exit(3)\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[3],
    )
    assert other.returncode == 3, other.stderr
    assert "agent name 'agent-z' is in use by another agent on this host" in other.stdout
    assert NameClash.__doc__


@pytest.mark.parametrize("bad", ["short", "x" * 65, "has space!"])
def test_malformed_instance_id_is_refused(client: TestClient, bad: str) -> None:
    make_group(client)
    response = _register(client, bad)
    assert response.status_code == 422 and "instance_id" in response.text
