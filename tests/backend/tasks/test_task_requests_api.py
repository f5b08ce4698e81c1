"""Bad input is refused with a clear message and nothing half-created; dependencies."""

import pytest
from fastapi.testclient import TestClient

from tests.conftest import add_account, login_as, make_group, make_project, task_request

pytestmark = pytest.mark.stack


def _spec(version: dict, **overrides: object) -> dict:
    """A small request: cpu-a ×1, one epoch of global batch 8."""
    small = {
        "resource_groups": [{"name": "cpu-a", "workers": 1}],
        "epochs": 1,
        "global_batch_size": 8,
    }
    return task_request(version, **{**small, **overrides})


def _refused(client: TestClient, spec: dict, status: int = 422) -> dict:
    before = len(client.get("/api/v1/tasks", params={"limit": 500}).json())
    response = client.post("/api/v1/tasks", json=spec)
    assert response.status_code == status, response.text
    assert len(client.get("/api/v1/tasks", params={"limit": 500}).json()) == before
    return dict(response.json()["error"])


def test_device_type_request_and_unknown_device_type(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    task = client.post(
        "/api/v1/tasks",
        json=_spec(
            version, resource_groups=[{"device_type": "cpu", "workers": 2, "placement": "uniform"}]
        ),
    ).json()
    assert task["spec"]["request"][0]["placement"] == "uniform" and task["spec"]["groups"] == []
    error = _refused(client, _spec(version, resource_groups=[{"device_type": "npu", "workers": 1}]))
    assert error == {
        "code": "invalid",
        "field": "resource_groups.0.device_type",
        "message": "no active resource group has device type 'npu'",
    }
    error = _refused(client, _spec(version, resource_groups=[{"device_type": "cpu", "workers": 3}]))
    assert error["message"] == (
        "resource groups of device type 'cpu' have 2 worker(s) in all; 3 requested"
    )
    error = _refused(
        client,
        _spec(version, resource_groups=[{"name": "cpu-a", "device_type": "cpu", "workers": 1}]),
    )
    assert "give either a group name or a device_type" in error["message"]


def test_priority_out_of_range(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    error = _refused(client, _spec(version, priority=101))
    assert error["field"] == "priority" and "less than or equal to 100" in error["message"]


def test_missing_dependency(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    error = _refused(client, _spec(version, depends_on=[999]), status=404)
    assert error == {
        "code": "not_found",
        "field": "depends_on.0",
        "message": "task 999 does not exist",
    }


def test_dependency_on_another_users_task(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    admin_task = client.post("/api/v1/tasks", json=_spec(version)).json()
    admin = client.account  # type: ignore[attr-defined]
    login_as(client, add_account("other@example.org"))
    _, theirs = make_project(client, name="theirs")
    mine = client.post("/api/v1/tasks", json=_spec(theirs)).json()
    error = _refused(client, _spec(theirs, depends_on=[admin_task["id"]]), status=404)
    assert error["message"] == f"task {admin_task['id']} does not exist"  # not even visible
    login_as(client, admin)  # an admin sees every task, and still may not chain them
    error = _refused(client, _spec(version, depends_on=[mine["id"]]))
    assert error["message"] == f"dependency task {mine['id']} belongs to another user"


def test_dependency_cycle_is_refused(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    first = client.post("/api/v1/tasks", json=_spec(version)).json()
    second = client.post("/api/v1/tasks", json=_spec(version, depends_on=[first["id"]])).json()
    third = client.post("/api/v1/tasks", json=_spec(version, depends_on=[second["id"]])).json()
    assert third["waiting"] and third["spec"]["depends_on"] == [second["id"]]
    response = client.patch(f"/api/v1/tasks/{first['id']}", json={"depends_on": [third["id"]]})
    assert response.status_code == 422
    chain = f"{first['id']} → {third['id']} → {second['id']} → {first['id']}"
    assert response.json()["error"]["message"] == f"dependency cycle: {chain}"
    assert client.get(f"/api/v1/tasks/{first['id']}").json()["spec"].get("depends_on") == []
    selfish = client.patch(f"/api/v1/tasks/{first['id']}", json={"depends_on": [first["id"]]})
    assert selfish.json()["error"]["message"] == f"dependency cycle: {first['id']} → {first['id']}"


def test_failed_dependency_fails_dependents_with_a_reason(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    first = client.post("/api/v1/tasks", json=_spec(version)).json()
    second = client.post("/api/v1/tasks", json=_spec(version, depends_on=[first["id"]])).json()
    third = client.post("/api/v1/tasks", json=_spec(version, depends_on=[second["id"]])).json()
    client.post(f"/api/v1/tasks/{first['id']}/cancel")
    second = client.get(f"/api/v1/tasks/{second['id']}").json()
    assert second["status"] == "FAILED"
    assert second["status_reason"] == (
        f"dependency task {first['id']} is CANCELLED: cancelled by user"
    )
    third = client.get(f"/api/v1/tasks/{third['id']}").json()
    assert (
        third["status"] == "FAILED"
        and f"dependency task {second['id']} is FAILED" in third["status_reason"]
    )
    error = _refused(client, _spec(version, depends_on=[first["id"]]))
    assert error["message"] == (
        f"dependency task {first['id']} is CANCELLED; this task could never start"
    )
