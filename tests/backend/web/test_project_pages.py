"""The projects pages: the create-project form and adding code versions, errors inline."""

from fastapi.testclient import TestClient

from tests.backend.web.dom import Node, parse
from tests.conftest import make_project, with_csrf

TRAINING_MODULE = b"""
def build_model(): ...
def build_datasets(): ...
def build_optimizer(params): ...
def loss_fn(output, target): ...
"""


def _field_of(page: Node, input_id: str) -> Node:
    """The `.field` block holding the input: where its error message must appear."""
    node = page.by_id(input_id).parent
    while node is not None and "field" not in node.attrs.get("class", "").split():
        node = node.parent
    assert node is not None, f"#{input_id} is not inside a .field"
    return node


def test_missing_name_is_shown_next_to_the_field_and_description_is_kept(
    client: TestClient,
) -> None:
    response = client.post(
        "/projects", data=with_csrf(client, {"name": "", "description": "digits, small CNN"})
    )
    assert response.status_code == 422
    page = parse(response.text)
    error = _field_of(page, "project-name").find(data_field="name")
    assert "at least 1 character" in error.text()
    assert page.by_id("project-name").attrs["aria-invalid"] == "true"
    assert page.by_id("project-description").text() == "digits, small CNN"


def test_duplicate_name_is_refused_inline_with_values_kept(client: TestClient) -> None:
    assert (
        client.post(
            "/projects", data=with_csrf(client, {"name": "mnist"}), follow_redirects=False
        ).status_code
        == 303
    )
    response = client.post(
        "/projects", data=with_csrf(client, {"name": "mnist", "description": "second try"})
    )
    assert response.status_code == 409
    page = parse(response.text)
    error = _field_of(page, "project-name").find(data_field="name")
    assert "a project named 'mnist' already exists" in error.text()
    assert page.by_id("project-name").attrs["value"] == "mnist"
    assert page.by_id("project-description").text() == "second try"
    assert [p["name"] for p in client.get("/api/v1/projects").json()] == ["mnist"]


def test_created_project_opens_with_a_flash_and_is_listed(client: TestClient) -> None:
    response = client.post(
        "/projects",
        data=with_csrf(client, {"name": "mnist", "description": "<b>bold</b>"}),
        follow_redirects=False,
    )
    assert response.status_code == 303
    project_page = client.get(response.headers["location"])
    assert (
        "Project 'mnist' created."
        in parse(project_page.text).find(class_="flash flash-info").text()
    )
    listing = client.get("/projects")
    assert listing.status_code == 200
    assert "&lt;b&gt;bold&lt;/b&gt;" in listing.text
    assert "<b>bold</b>" not in listing.text
    assert not parse(client.get("/projects").text).find_all(class_="flash flash-info")


def test_add_example_version_and_refuse_unknown_example(client: TestClient) -> None:
    project_id = client.post("/api/v1/projects", json={"name": "mnist"}).json()["id"]
    added = client.post(
        f"/projects/{project_id}/code-versions", data=with_csrf(client, {"example": "mnist_cnn"})
    )
    assert added.status_code == 200
    versions = parse(added.text).by_id("code-versions")
    assert "v1" in versions.text() and "mnist_cnn.py" in versions.text()
    refused = client.post(
        f"/projects/{project_id}/code-versions", data=with_csrf(client, {"example": "nope"})
    )
    assert refused.status_code == 422
    error = _field_of(parse(refused.text), "example").find(data_field="example")
    assert "no bundled example 'nope'" in error.text()


def test_upload_checks_the_module_and_reports_inline(client: TestClient) -> None:
    project_id = client.post("/api/v1/projects", json={"name": "mnist"}).json()["id"]
    url = f"/projects/{project_id}/code-versions/upload"
    refused = client.post(
        url, data=with_csrf(client, {}), files={"file": ("train.py", b"def build_model(): ...\n")}
    )
    assert refused.status_code == 422
    error = _field_of(parse(refused.text), "file").find(data_field="file")
    assert "missing def build_datasets(...)" in error.text()
    accepted = client.post(
        url,
        data=with_csrf(client, {}),
        files={"file": ("train.py", TRAINING_MODULE)},
        follow_redirects=False,
    )
    assert accepted.status_code == 303
    versions = client.get(f"/api/v1/projects/{project_id}/code-versions").json()
    assert [(v["version"], v["filename"]) for v in versions] == [(1, "train.py")]


def test_unknown_project_is_an_html_404(client: TestClient) -> None:
    response = client.get("/projects/999")
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/html")
    assert "project 999 does not exist" in response.text


def test_project_page_lists_its_tasks_form_defaults(client: TestClient) -> None:
    project, version = make_project(client)
    page = parse(client.get(f"/projects/{project['id']}").text)
    selected = page.by_id("task-code-version").find("option", value=str(version["id"]))
    assert "selected" in selected.attrs
    assert page.by_id("task-epochs").attrs["value"] == "5"
    assert page.by_id("task-global_batch_size").attrs["value"] == "64"
