"""Tags, the task list's filters and paging, and the comparison of tasks (REST)."""

from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.tasks.models import Metric, Task, TaskStatus
from tests.conftest import add_account, login_as, make_group, make_project, task_request


def _submit(client: TestClient, version: dict, **fields: object) -> dict:
    body = task_request(version, resource_groups=[{"name": "cpu-a", "workers": 1}], **fields)
    response = client.post("/api/v1/tasks", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def _ids(response) -> list[int]:  # type: ignore[no-untyped-def]
    assert response.status_code == 200, response.text
    return [task["id"] for task in response.json()]


def test_tags_are_stored_sorted_once_kept_by_retry_and_changed_at_any_status(
    client: TestClient,
) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    task = _submit(client, version, tags=["lr=3e-4", "baseline", "baseline"])
    assert task["tags"] == ["baseline", "lr=3e-4"]
    client.post(f"/api/v1/tasks/{task['id']}/cancel").raise_for_status()
    changed = client.patch(f"/api/v1/tasks/{task['id']}", json={"tags": ["zz", "baseline", "a"]})
    assert changed.status_code == 200, changed.text
    assert changed.json()["tags"] == ["a", "baseline", "zz"]  # sorted in the answer itself
    changed = client.patch(f"/api/v1/tasks/{task['id']}", json={"tags": ["paper:fig3"]})
    assert changed.json()["tags"] == ["paper:fig3"]
    # priority still changes only while queued, and saying so keeps the tags as they were
    refused = client.patch(f"/api/v1/tasks/{task['id']}", json={"priority": 5, "tags": []})
    assert refused.status_code == 409
    assert "tags change at any time" in refused.json()["error"]["message"]
    assert client.get(f"/api/v1/tasks/{task['id']}").json()["tags"] == ["paper:fig3"]
    retry = client.post(f"/api/v1/tasks/{task['id']}/retry").json()
    assert retry["tags"] == ["paper:fig3"]


def test_a_bad_tag_is_refused_naming_it_and_nothing_is_stored(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    body = task_request(version, resource_groups=[{"name": "cpu-a", "workers": 1}])
    for tags, field in (([" spaced out"], "tags.0"), (["x" * 65], "tags.0"), (["t"] * 17, "tags")):
        response = client.post("/api/v1/tasks", json={**body, "tags": [*tags]})
        assert response.status_code == 422, tags
        assert response.json()["error"]["field"] == field
    assert client.get("/api/v1/tasks").json() == []


@pytest.mark.stack  # the filters' SQL (EXISTS, LIKE with ESCAPE) on PostgreSQL as well
def test_the_list_filters_by_status_every_tag_and_name_and_pages(
    client: TestClient, session: Session
) -> None:
    make_group(client, "cpu-a", 2)
    project, version = make_project(client)
    other, other_version = make_project(client, name="other")
    a = _submit(client, version, name="MNIST lr 0.1", tags=["sweep", "lr"])
    b = _submit(client, version, name="mnist lr 0.01", tags=["sweep"])
    c = _submit(client, version, name="resnet_50%", tags=["lr"])
    d = _submit(client, other_version, name="mnist elsewhere", tags=["sweep", "lr"])
    client.post(f"/api/v1/tasks/{b['id']}/cancel").raise_for_status()
    get = client.get
    assert _ids(get("/api/v1/tasks", params={"tag": ["sweep", "lr"]})) == [d["id"], a["id"]]
    assert _ids(get("/api/v1/tasks", params={"name": "MNIST"})) == [d["id"], b["id"], a["id"]]
    # LIKE's own characters are text in a search: "_" and "%" match only themselves
    assert _ids(get("/api/v1/tasks", params={"name": "n_t"})) == []  # not "net"
    assert _ids(get("/api/v1/tasks", params={"name": "t%5"})) == []  # not "t_5"
    assert _ids(get("/api/v1/tasks", params={"name": "_50%"})) == [c["id"]]
    assert _ids(get("/api/v1/tasks", params={"status": "CANCELLED"})) == [b["id"]]
    mine = {"project_id": project["id"], "tag": "sweep"}
    assert _ids(get("/api/v1/tasks", params=mine)) == [b["id"], a["id"]]
    page = get("/api/v1/tasks", params={"limit": 2, "offset": 1})
    assert _ids(page) == [c["id"], b["id"]]
    assert page.headers["X-Total-Count"] == "4"
    bad = get("/api/v1/tasks", params={"tag": "bad tag"})  # refused as on submission
    assert bad.status_code == 422 and bad.json()["error"]["field"].startswith("tag")
    filtered = get("/api/v1/tasks", params={"tag": "lr", "limit": 1})
    assert filtered.headers["X-Total-Count"] == "3"
    # another user sees none of them, whatever the filter
    stranger = login_as(client, add_account("s@example.org"))
    assert _ids(stranger.get("/api/v1/tasks", params={"tag": "sweep"})) == []
    assert other["id"] != project["id"]


def _report(session: Session, task_id: int, points: list[tuple[int, int, str, float | None]]):  # type: ignore[no-untyped-def]
    task = session.get(Task, task_id)
    assert task is not None
    start = datetime(2026, 1, 1)
    task.started_at = start
    for i, (step, epoch, name, value) in enumerate(points):
        session.add(
            Metric(
                task_id=task_id,
                step=step,
                epoch=epoch,
                name=name,
                value=value,
                rank=None,
                created_at=start + timedelta(seconds=10 * (i + 1)),
            )
        )
    session.add(Metric(task_id=task_id, step=1, epoch=0, name="samples_per_s", value=9, rank=0))
    session.commit()


def test_compare_names_what_differs_final_metrics_and_curves(
    client: TestClient, session: Session
) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    a = _submit(client, version, name="a", epochs=2, tags=["x"])
    b = _submit(client, version, name="b", epochs=3, data={"num_workers": 1})
    _report(
        session,
        a["id"],
        [(10, 0, "val_loss", 2.0), (15, 1, "step/train_loss", 3.0), (20, 1, "val_loss", 1.0)],
    )
    _report(session, b["id"], [(10, 0, "val_loss", 1.5), (10, 0, "val_accuracy", None)])
    response = client.get(
        "/api/v1/tasks/compare", params={"ids": [a["id"], b["id"]], "metric": "val_loss"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [t["id"] for t in body["tasks"]] == [a["id"], b["id"]]
    assert [t["final_metrics"] for t in body["tasks"]] == [
        {"val_loss": 1.0},
        {"val_loss": 1.5, "val_accuracy": None},
    ]
    assert body["tasks"][0]["tags"] == ["x"]
    differing = {d["field"]: d["values"] for d in body["differences"]}
    assert differing["epochs"] == [2, 3]
    assert differing["data.num_workers"][1] == 1
    assert "global_batch_size" not in differing  # the same in both
    # task-wide only (no per-rank series); a per-step series has a curve but no final value
    assert body["metrics"] == ["step/train_loss", "val_accuracy", "val_loss"]
    curve = body["curves"][0]["points"]
    assert [(p["step"], p["epoch"], p["value"], p["seconds"]) for p in curve] == [
        (10, 0, 2.0, 10.0),
        (20, 1, 1.0, 30.0),
    ]
    without = client.get("/api/v1/tasks/compare", params={"ids": [a["id"], b["id"]]}).json()
    assert without["curves"] == [] and without["metric"] is None


def test_compare_refuses_one_task_too_many_and_a_task_the_caller_cannot_see(
    client: TestClient,
) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    a, b = _submit(client, version), _submit(client, version)
    one = client.get("/api/v1/tasks/compare", params={"ids": [a["id"], a["id"]]})
    assert one.status_code == 422
    assert "2 to 10 different tasks (1 given)" in one.json()["error"]["message"]
    many = client.get("/api/v1/tasks/compare", params={"ids": list(range(1, 12))})
    assert many.status_code == 422
    stranger = login_as(client, add_account("s@example.org"))
    hidden = stranger.get("/api/v1/tasks/compare", params={"ids": [a["id"], b["id"]]})
    assert hidden.status_code == 404


def test_status_filter_value_is_checked(client: TestClient) -> None:
    response = client.get("/api/v1/tasks", params={"status": "DONE"})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "status"
    assert TaskStatus.SUCCEEDED.value == "SUCCEEDED"
