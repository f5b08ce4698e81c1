"""A small world for authorization tests: an admin, a project owner, a member of her
project and a stranger; her project has code, a task with logs, metrics and a checkpoint."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.conftest import Account, add_account, agent_headers, make_group


@dataclass
class World:
    client: TestClient
    admin: Account
    owner: Account
    member: Account
    stranger: Account
    project: dict
    version: dict
    task: dict
    checkpoint: dict
    anonymous: TestClient

    def as_(self, account: Account | None) -> dict[str, str]:
        """Headers acting as `account` (None: nobody)."""
        return account.headers if account else {"Authorization": ""}


def _report(client: TestClient, task_id: int) -> dict:
    """What an agent would report for the task: a log line, a metric, a checkpoint."""
    base = f"/internal/v1/tasks/{task_id}"
    client.post(
        f"{base}/logs",
        headers=agent_headers(),
        json={
            "lines": [
                {"node": "rank-1", "seq": 0, "time": "2026-01-01T00:00:00", "text": "secret line"}
            ]
        },
    ).raise_for_status()
    client.post(
        f"{base}/metrics",
        headers=agent_headers(),
        json={"metrics": [{"name": "val_loss", "value": 0.5, "epoch": 0, "step": 1}]},
    ).raise_for_status()
    response = client.post(
        f"{base}/checkpoints",
        headers=agent_headers(),
        params={"name": "epoch-0.pt", "epoch": 0, "step": 1},
        content=b"weights",
    )
    response.raise_for_status()
    return dict(response.json())


@pytest.fixture
def world(client: TestClient, service_env: Path) -> Iterator[World]:
    admin = client.account  # type: ignore[attr-defined]
    owner, member, stranger = (
        add_account(f"{n}@example.org") for n in ("owner", "member", "stranger")
    )
    make_group(client, "cpu-a", capacity=2)
    as_owner = owner.headers
    project = client.post(
        "/api/v1/projects", headers=as_owner, json={"name": "secret", "description": "owner's"}
    ).json()
    version = client.post(
        f"/api/v1/projects/{project['id']}/code-versions",
        headers=as_owner,
        json={"example": "tiny_regression"},
    ).json()
    client.post(
        f"/api/v1/projects/{project['id']}/members", headers=as_owner, json={"email": member.email}
    ).raise_for_status()
    task = client.post(
        "/api/v1/tasks",
        headers=as_owner,
        json={
            "project_id": project["id"],
            "code_version_id": version["id"],
            "epochs": 1,
            "global_batch_size": 8,
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    ).json()
    checkpoint = _report(client, task["id"])
    yield World(
        client,
        admin,
        owner,
        member,
        stranger,
        project,
        version,
        task,
        checkpoint,
        TestClient(client.app),
    )
