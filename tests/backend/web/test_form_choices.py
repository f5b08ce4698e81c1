"""Portal forms refuse values outside their choices, naming the field, and store nothing:
bundled examples by name only, the task form's selects and fields, yes/no choices."""

import pytest
from fastapi.testclient import TestClient

from backend.projects.code import EXAMPLES_DIR
from tests.backend.web.dom import parse
from tests.conftest import add_account, make_group, make_project, with_csrf

OUTSIDE = [
    "../backend/main",
    str(EXAMPLES_DIR.parent / "backend" / "main"),
    "__init__",
    "examples/mnist_cnn",
]


def _versions(client: TestClient, project_id: int) -> list:
    return list(client.get(f"/api/v1/projects/{project_id}/code-versions").json())


@pytest.mark.parametrize("example", OUTSIDE)
def test_add_example_form_takes_only_a_listed_name(client: TestClient, example: str) -> None:
    project_id = client.post("/api/v1/projects", json={"name": "mnist"}).json()["id"]
    refused = client.post(
        f"/projects/{project_id}/code-versions", data=with_csrf(client, {"example": example})
    )
    assert refused.status_code == 422
    error = parse(refused.text).find(data_field="example").text()
    assert "no bundled example" in error and "mnist_cnn" in error
    assert _versions(client, project_id) == []


@pytest.mark.parametrize("example", OUTSIDE)
def test_task_form_takes_only_a_listed_example(client: TestClient, example: str) -> None:
    make_group(client, "cpu-a", capacity=2)
    project_id = client.post("/api/v1/projects", json={"name": "mnist"}).json()["id"]
    form = {
        "code_version_id": f"example:{example}",
        "group": ["cpu-a"],
        "workers": ["1"],
        "global_batch_size": "8",
    }
    refused = client.post(f"/projects/{project_id}/tasks", data=with_csrf(client, form))
    assert refused.status_code == 422
    assert "no bundled example" in parse(refused.text).find(data_field="code_version_id").text()
    assert _versions(client, project_id) == [] and client.get("/api/v1/tasks").json() == []


def _task_form(version: dict, **fields: str | list[str]) -> dict:
    return {
        "code_version_id": str(version["id"]),
        "name": "my run",
        "group": ["cpu-a"],
        "workers": ["1"],
        "global_batch_size": "8",
        **fields,
    }


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("split_policy", "fastest", "'even' or 'weighted'"),
        ("sync_strategy", "../sync", "'sync', 'periodic', 'quorum' or 'diloco'"),
    ],
)
def test_task_form_select_outside_its_options_is_refused_at_the_field(
    client: TestClient, field: str, value: str, words: str
) -> None:
    make_group(client, "cpu-a", capacity=2)
    project, version = make_project(client)
    refused = client.post(
        f"/projects/{project['id']}/tasks",
        data=with_csrf(client, _task_form(version, **{field: value})),
    )
    assert refused.status_code == 422
    page = parse(refused.text)
    assert words in page.find(data_field=field).text()
    assert page.by_id("task-name").attrs["value"] == "my run"
    assert client.get("/api/v1/tasks").json() == []


def test_task_form_field_it_does_not_have_is_refused_by_name(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    project, version = make_project(client)
    refused = client.post(
        f"/projects/{project['id']}/tasks",
        data=with_csrf(client, _task_form(version, split="weighted", split_policy="weighted")),
    )
    assert refused.status_code == 422
    page = parse(refused.text)
    assert page.by_id("error-__all__").text() == "split: not a field of this form"
    assert page.by_id("task-name").attrs["value"] == "my run"
    assert page.by_id("task-split_policy").find("option", selected="").attrs["value"] == "weighted"
    assert client.get("/api/v1/tasks").json() == []


def test_task_form_groups_without_a_worker_count_are_refused(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=2)
    project, version = make_project(client)
    refused = client.post(
        f"/projects/{project['id']}/tasks",
        data=with_csrf(client, _task_form(version, group=["cpu-a", "cpu-b"], workers=["1"])),
    )
    assert refused.status_code == 422
    assert (
        "2 groups but 1 worker counts"
        in parse(refused.text).find(data_field="resource_groups").text()
    )
    assert client.get("/api/v1/tasks").json() == []


def test_user_active_choice_outside_true_false_is_refused(client: TestClient) -> None:
    other = add_account("other@example.org")
    refused = client.post(
        f"/admin/users/{other.id}", data=with_csrf(client, {"role": "member", "is_active": "nope"})
    )
    assert refused.status_code == 422
    assert "is_active must be true or false" in refused.text
    assert client.get(f"/api/v1/users/{other.id}").json()["is_active"] is True


def test_archive_choice_outside_true_false_is_refused(client: TestClient) -> None:
    project, _ = make_project(client)
    url = f"/projects/{project['id']}/archive"
    client.post(url, data=with_csrf(client, {"archived": "true"})).raise_for_status()
    refused = client.post(url, data=with_csrf(client, {"archived": "yes please"}))
    assert refused.status_code == 422
    assert "archived: choose true or false" in refused.text
    assert client.get(f"/api/v1/projects/{project['id']}").json()["archived_at"] is not None


def test_nul_in_a_form_field_is_refused_by_name(client: TestClient) -> None:
    refused = client.post("/projects", data=with_csrf(client, {"name": "mn\x00ist"}))
    assert refused.status_code == 422
    assert "name: must not contain NUL characters" in refused.text
    assert client.get("/api/v1/projects").json() == []


def test_task_form_takes_each_groups_sharding_and_cap_and_keeps_them_after_an_error(
    client: TestClient,
) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    project, version = make_project(client)
    rows = {
        "group": ["cpu-a", "cpu-b"],
        "workers": ["2", "1"],
        "group_sharding": ["fsdp", ""],
        "group_cap": ["", "three"],
    }
    refused = client.post(
        f"/projects/{project['id']}/tasks", data=with_csrf(client, _task_form(version, **rows))
    )
    assert refused.status_code == 422
    page = parse(refused.text)
    assert "whole number of samples" in page.find(data_field="group.cpu-b").text()
    assert page.by_id("sharding-cpu-a").find("option", selected="").attrs["value"] == "fsdp"
    assert page.by_id("cap-cpu-b").attrs["value"] == "three"
    assert client.get("/api/v1/tasks").json() == []

    rows["group_cap"] = ["", "3"]
    made = client.post(
        f"/projects/{project['id']}/tasks",
        data=with_csrf(client, _task_form(version, **rows)),
        follow_redirects=False,
    )
    assert made.status_code == 303, made.text
    (task,) = client.get("/api/v1/tasks").json()
    asked = {g["name"]: g for g in task["spec"]["request"]}  # placed when it is scheduled
    assert asked["cpu-a"]["sharding"] == "fsdp" and asked["cpu-a"].get("max_local_batch") is None
    assert asked["cpu-b"].get("sharding") is None and asked["cpu-b"]["max_local_batch"] == 3
