"""Task submission through REST: validation, lifecycle records, nothing half-created."""

from fastapi.testclient import TestClient

from tests.conftest import make_group, make_project, task_request


def test_submit_records_queued_task_with_event(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    make_group(client, "cpu-b", 1)
    _, version = make_project(client)
    response = client.post("/api/v1/tasks", json=task_request(version))
    assert response.status_code == 201, response.text
    task = response.json()
    assert task["status"] == "QUEUED"
    assert [g["workers"] for g in task["spec"]["groups"]] == [2, 1]
    events = client.get(f"/api/v1/tasks/{task['id']}/events").json()
    assert [(e["from_status"], e["to_status"], e["reason"]) for e in events] == [
        (None, "QUEUED", "submitted")
    ]


def test_malformed_spec_names_the_field(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    response = client.post("/api/v1/tasks", json=task_request(version, epochs=0))
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "epochs"
    response = client.post("/api/v1/tasks", json=task_request(version, global_batch_size="big"))
    assert response.json()["error"]["field"] == "global_batch_size"
    assert client.get("/api/v1/tasks").json() == []


def test_unknown_group_and_too_many_workers_are_refused(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    unknown = client.post("/api/v1/tasks", json=task_request(version))
    assert unknown.status_code == 422
    assert unknown.json()["error"]["field"] == "resource_groups.1.name"
    assert "'cpu-b' does not exist" in unknown.json()["error"]["message"]
    too_many = client.post(
        "/api/v1/tasks",
        json=task_request(version, resource_groups=[{"name": "cpu-a", "workers": 3}]),
    )
    assert too_many.status_code == 422
    assert too_many.json()["error"]["field"] == "resource_groups.0.workers"
    assert "has 2 worker(s); 3 requested" in too_many.json()["error"]["message"]
    assert client.get("/api/v1/tasks").json() == []


def test_global_batch_smaller_than_workers_is_refused(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    response = client.post(
        "/api/v1/tasks",
        json=task_request(
            version, resource_groups=[{"name": "cpu-a", "workers": 2}], global_batch_size=1
        ),
    )
    assert response.status_code == 422
    assert "smaller than the number of workers" in response.json()["error"]["message"]


def test_cancel_is_recorded_and_final(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    task = client.post(
        "/api/v1/tasks",
        json=task_request(version, resource_groups=[{"name": "cpu-a", "workers": 1}]),
    ).json()
    assert client.post(f"/api/v1/tasks/{task['id']}/cancel").json()["status"] == "CANCELLED"
    again = client.post(f"/api/v1/tasks/{task['id']}/cancel")
    assert again.status_code == 409
    assert "CANCELLED" in again.json()["error"]["message"]


def test_unknown_task_is_404_in_shared_shape(client: TestClient) -> None:
    response = client.get("/api/v1/tasks/999")
    assert response.status_code == 404
    assert response.json() == {
        "error": {"code": "not_found", "message": "task 999 does not exist", "field": "task_id"}
    }


def test_openapi_served(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/api/v1/tasks" in paths and "/api/v1/tasks/{task_id}/logs/stream" in paths
    assert client.get("/docs").status_code == 200
