"""Projects and code versions: examples, uploads checked against the contract."""

from fastapi.testclient import TestClient

from tests.conftest import make_project

GOOD = b"""
def build_model(): ...
def build_datasets(): ...
def build_optimizer(params): ...
def loss_fn(output, target): ...
"""


def test_upload_creates_new_immutable_versions(client: TestClient) -> None:
    project, first = make_project(client)
    upload = client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", GOOD, "text/x-python")},
    )
    assert upload.status_code == 201, upload.text
    assert (first["version"], upload.json()["version"]) == (1, 2)
    versions = client.get(f"/api/v1/projects/{project['id']}/code-versions").json()
    assert [v["version"] for v in versions] == [2, 1]


def test_upload_missing_contract_function_is_refused(client: TestClient) -> None:
    project, _ = make_project(client)
    bad = GOOD.replace(b"def loss_fn(output, target): ...", b"")
    response = client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", bad, "text/x-python")},
    )
    assert response.status_code == 422
    assert "missing def loss_fn" in response.json()["error"]["message"]
    assert len(client.get(f"/api/v1/projects/{project['id']}/code-versions").json()) == 1


def test_upload_not_python_is_refused(client: TestClient) -> None:
    project, _ = make_project(client)
    response = client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", b"def (:", "text/x-python")},
    )
    assert response.status_code == 422 and "not valid Python" in response.json()["error"]["message"]
    response = client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("data.csv", GOOD, "text/csv")},
    )
    assert response.status_code == 415 and "(.py)" in response.json()["error"]["message"]


def test_duplicate_project_name_conflicts(client: TestClient) -> None:
    make_project(client, name="p1")
    response = client.post("/api/v1/projects", json={"name": "p1"})
    assert response.status_code == 409 and response.json()["error"]["field"] == "name"


def test_unknown_example_lists_available(client: TestClient) -> None:
    project, _ = make_project(client)
    response = client.post(
        f"/api/v1/projects/{project['id']}/code-versions", json={"example": "nope"}
    )
    assert response.status_code == 422
    assert "mnist_cnn" in response.json()["error"]["message"]
