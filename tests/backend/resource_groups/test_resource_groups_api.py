"""Resource groups managed by admins: create, edit, labels, drain, disable, delete; agents."""

import pytest
from fastapi.testclient import TestClient

from tests.conftest import add_account, agent_headers, make_group, make_project, register_agent

pytestmark = pytest.mark.stack
HARDWARE = {"cpu_cores": 8, "memory_bytes": 16 * 2**30, "cuda_devices": []}


def _register(
    client: TestClient, group: str, workers: int = 2, name: str = "a1", **hardware: object
) -> dict:
    response = register_agent(client, group, {**HARDWARE, **hardware}, name=name, workers=workers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _submit(client: TestClient, version: dict, groups: list[dict]) -> object:
    return client.post(
        "/api/v1/tasks",
        json={
            "project_id": version["project_id"],
            "code_version_id": version["id"],
            "resource_groups": groups,
            "epochs": 1,
            "global_batch_size": 8,
        },
    )


def test_create_edit_labels_and_read_capacity(client: TestClient) -> None:
    response = client.post(
        "/api/v1/resource-groups",
        json={"name": "gpu-a", "device_type": "cuda", "capacity": 4, "labels": {"model": "a100"}},
    )
    assert response.status_code == 201, response.text
    group = response.json()
    assert (group["state"], group["labels"], group["free_workers"]) == (
        "active",
        {"model": "a100"},
        0,
    )
    edited = client.patch(
        "/api/v1/resource-groups/gpu-a", json={"capacity": 8, "labels": {"model": "h100"}}
    ).json()
    assert (edited["capacity"], edited["labels"]) == (8, {"model": "h100"})
    bad = client.post(
        "/api/v1/resource-groups",
        json={"name": "x", "device_type": "cpu", "capacity": 1, "labels": {"bad key!": "v"}},
    )
    assert bad.status_code == 422 and "label 'bad key!'" in bad.json()["error"]["message"]


def test_capacity_follows_agents_online(client: TestClient) -> None:
    make_group(client, "cpu-a", 4)
    _register(client, "cpu-a", workers=3, cuda_devices=["NVIDIA A100"])
    group = client.get("/api/v1/resource-groups/cpu-a").json()
    assert (group["agents_online"], group["online_workers"], group["free_workers"]) == (1, 3, 3)
    agent = client.get("/api/v1/agents", params={"resource_group": "cpu-a"}).json()[0]
    assert agent["hardware"]["cuda_devices"] == ["NVIDIA A100"]
    assert agent["hardware"]["memory_bytes"] == 16 * 2**30
    client.post(f"/internal/v1/agents/{agent['id']}/deregister", headers=agent_headers())
    assert client.get("/api/v1/resource-groups/cpu-a").json()["free_workers"] == 0


def test_registration_without_hardware_is_refused(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    response = client.post(
        "/internal/v1/agents/register",
        headers=agent_headers(),
        json={"name": "a1", "host": "h", "resource_group": "cpu-a", "workers": 1, "hardware": {}},
    )
    assert response.status_code == 422
    assert response.json()["error"]["field"].startswith("hardware")


def test_drain_refuses_new_tasks_and_disable_waits_for_running_ones(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    queued = _submit(client, version, [{"name": "cpu-a", "workers": 1}])
    assert queued.status_code == 201
    drained = client.patch("/api/v1/resource-groups/cpu-a", json={"state": "draining"})
    assert drained.json()["state"] == "draining"
    refused = _submit(client, version, [{"name": "cpu-a", "workers": 1}])
    assert refused.status_code == 422
    assert refused.json()["error"]["message"] == (
        "resource group 'cpu-a' is draining; it accepts no new tasks"
    )
    by_type = _submit(client, version, [{"device_type": "cpu", "workers": 1}])
    assert "no active resource group has device type 'cpu'" in by_type.json()["error"]["message"]
    assert (
        client.patch("/api/v1/resource-groups/cpu-a", json={"state": "disabled"}).json()["state"]
        == "disabled"
    )  # nothing runs on it: a queued task holds no node
    active = client.patch("/api/v1/resource-groups/cpu-a", json={"state": "active"})
    assert active.status_code == 200


def test_delete_refused_while_in_use(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    task = _submit(client, version, [{"name": "cpu-a", "workers": 1}]).json()
    refused = client.delete("/api/v1/resource-groups/cpu-a")
    assert refused.status_code == 409 and "in use" in refused.json()["error"]["message"]
    client.post(f"/api/v1/tasks/{task['id']}/cancel")
    agent = _register(client, "cpu-a")
    assert client.delete("/api/v1/resource-groups/cpu-a").status_code == 409  # agent online
    client.post(f"/internal/v1/agents/{agent['id']}/deregister", headers=agent_headers())
    assert client.delete("/api/v1/resource-groups/cpu-a").status_code == 204
    assert client.get("/api/v1/resource-groups/cpu-a").status_code == 404
    assert client.get(f"/api/v1/tasks/{task['id']}/events").status_code == 200
    make_group(client, "cpu-a", 3)  # the name is free again


def test_only_admins_manage_groups(client: TestClient) -> None:
    member = add_account("member@example.org")
    response = client.post(
        "/api/v1/resource-groups",
        headers=member.headers,
        json={"name": "cpu-z", "device_type": "cpu", "capacity": 1},
    )
    assert response.status_code == 403
