"""The submit form's Plan button and its hidden `plan_id`: the page offers the button and its
script, the portal's own session (cookie + CSRF header) may start a plan over REST as the
page's script does, a task submitted from the form with `plan_id` carries it and has an ETA,
and a refused `plan_id` is shown next to the form with every value kept."""

import pytest
from fastapi.testclient import TestClient

from tests.backend.plans.test_plans_api import _timings
from tests.backend.web.dom import parse
from tests.conftest import agent_headers, make_group, make_project, with_csrf


def _setup(client: TestClient) -> tuple[dict, dict]:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    return make_project(client, example="tiny_regression")


def _plan_body(version: dict) -> dict:
    return {
        "project_id": version["project_id"],
        "code_version_id": version["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        "global_batch_size": 64,
        "epochs": 3,
    }


def _form(version: dict, **fields: str) -> dict:
    return {
        "code_version_id": str(version["id"]),
        "name": "planned run",
        "group": ["cpu-a", "cpu-b"],
        "workers": ["2", "1"],
        "global_batch_size": "64",
        "epochs": "3",
        "split_policy": "weighted",
        **fields,
    }


def test_the_form_has_a_plan_button_and_a_hidden_plan_id(client: TestClient) -> None:
    project, _ = _setup(client)
    page = parse(client.get(f"/projects/{project['id']}").text)
    form = page.by_id("task-form")
    assert form.attrs["data-project-id"] == str(project["id"])
    assert form.find("button", id="plan-button").attrs["type"] == "button"  # never submits
    hidden = form.find("input", name="plan_id")
    assert hidden.attrs["type"] == "hidden" and hidden.attrs["value"] == ""
    assert not page.find_all(id="task-plan_id")  # no typed-in plan id under More settings
    assert "hidden" in page.by_id("plan-note").attrs and "hidden" in page.by_id("plan-panel").attrs
    assert page.by_id("plan-chart").tag == "canvas" and page.by_id("plan-use")
    scripts = [s.attrs.get("src", "") for s in page.find_all("script")]
    assert any(s.endswith("vendor/chart.umd.js") for s in scripts)
    assert any(s.endswith("/plan.js") for s in scripts)
    assert client.get("/static/plan.js").status_code == 200


def test_the_pages_session_starts_a_plan_with_its_csrf_header(client: TestClient) -> None:
    _, version = _setup(client)
    del client.headers["Authorization"]  # as the page's script: the session cookie only
    refused = client.post("/api/v1/plans", json=_plan_body(version))
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]["message"]
    csrf = {"X-CSRF-Token": client.account.csrf}  # type: ignore[attr-defined]
    created = client.post("/api/v1/plans", json=_plan_body(version), headers=csrf)
    assert created.status_code == 201, created.text
    plan = client.get(f"/api/v1/plans/{created.json()['id']}").json()
    assert plan["status"] == "trial" and plan["trial_task_id"]
    bad = client.post(
        "/api/v1/plans",
        json={**_plan_body(version), "resource_groups": [{"name": "gpu-x", "workers": 1}]},
        headers=csrf,
    )
    assert bad.status_code == 422
    assert bad.json()["error"]["field"].startswith("resource_groups.0")
    cancelled = client.post(f"/api/v1/plans/{plan['id']}/cancel", headers=csrf)
    assert cancelled.json()["status"] == "cancelled"


def test_a_task_submitted_with_plan_id_carries_it_and_has_an_eta(client: TestClient) -> None:
    project, version = _setup(client)
    plan = client.post("/api/v1/plans", json=_plan_body(version)).json()
    client.put(
        f"/internal/v1/tasks/{plan['trial_task_id']}/trial",
        headers=agent_headers(),
        json=_timings(),
    ).raise_for_status()
    ready = client.get(f"/api/v1/plans/{plan['id']}").json()
    response = client.post(
        f"/projects/{project['id']}/tasks",
        data=with_csrf(client, _form(version, plan_id=str(plan["id"]))),
        follow_redirects=False,
    )
    assert response.status_code == 303, response.text
    task = client.get(response.headers["location"].replace("/tasks/", "/api/v1/tasks/")).json()
    assert task["spec"]["plan_id"] == plan["id"]
    assert task["eta_s"] == pytest.approx(ready["best"]["finish_s"], rel=1e-3)  # before a step


def test_a_refused_plan_id_is_shown_next_to_the_form_with_values_kept(
    client: TestClient,
) -> None:
    project, version = _setup(client)
    plan = client.post("/api/v1/plans", json=_plan_body(version)).json()  # not fitted yet
    response = client.post(
        f"/projects/{project['id']}/tasks",
        data=with_csrf(client, _form(version, plan_id=str(plan["id"]))),
    )
    assert response.status_code == 422
    page = parse(response.text)
    assert "no fitted model yet" in page.find(data_field="plan_id").text()
    assert page.find("input", name="plan_id").attrs["value"] == str(plan["id"])
    assert "hidden" not in page.by_id("plan-note").attrs
    assert page.by_id("plan-note-id").text() == f"#{plan['id']}"
    assert page.by_id("task-name").attrs["value"] == "planned run"
    assert page.by_id("workers-cpu-b").attrs["value"] == "1"
    assert page.by_id("task-split_policy").find("option", selected="").attrs["value"] == "weighted"
    tasks = client.get("/api/v1/tasks").json()
    assert [t["id"] for t in tasks] == [plan["trial_task_id"]]  # only the trial
