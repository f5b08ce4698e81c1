"""Code versions from uploads: modules and archives checked against the contract, refused
with the reason and the HTTP status it deserves, nothing stored when refused."""

import io
import tarfile
import zipfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.projects.code import loader_module
from tests.backend.web.dom import parse
from tests.conftest import with_csrf

MODEL = b"""
import torch
from helpers import make_data

def build_model():
    return torch.nn.Linear(4, 1)

def build_datasets():
    return make_data(16), make_data(4)

def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output.squeeze(-1), target)
"""
HELPERS = b"""
import torch

def make_data(n):
    x = torch.randn(n, 4)
    return [(x[i], x[i].sum()) for i in range(n)]
"""


def _zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def _tgz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


@pytest.fixture
def upload(client: TestClient):  # type: ignore[no-untyped-def]
    project = client.post("/api/v1/projects", json={"name": "p"}).json()
    url = f"/api/v1/projects/{project['id']}/code-versions"

    def send(name: str, content: bytes, **data: str):  # type: ignore[no-untyped-def]
        return client.post(f"{url}/upload", files={"file": (name, content)}, data=data)

    send.versions = lambda: client.get(url).json()  # type: ignore[attr-defined]
    return send


def test_zip_with_a_folder_and_helpers_is_a_version(upload) -> None:  # type: ignore[no-untyped-def]
    response = upload("job.zip", _zip({"job/train.py": MODEL, "job/helpers.py": HELPERS}))
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["filename"], body["entrypoint"], body["source"]) == (
        "job.zip",
        "train.py",
        "archive",
    )


def test_tar_gz_with_a_named_entrypoint(upload) -> None:  # type: ignore[no-untyped-def]
    files = {"src/model_def.py": MODEL, "src/helpers.py": HELPERS, "README": b"hi"}
    response = upload("job.tar.gz", _tgz(files), entrypoint="src/model_def.py")
    assert response.status_code == 201, response.text
    assert response.json()["entrypoint"] == "src/model_def.py"


@pytest.mark.parametrize(
    ("name", "content", "data", "status", "field", "words"),
    [
        (
            "job.zip",
            _zip({"a.py": MODEL, "b.py": HELPERS}),
            {},
            422,
            "entrypoint",
            "name the entrypoint module",
        ),
        ("job.zip", _zip({"train.py": HELPERS}), {}, 422, "file", "missing def build_model"),
        ("job.zip", _zip({"../evil.py": MODEL}), {}, 422, "file", "unsafe path"),
        ("job.zip", b"not a zip at all", {}, 422, "file", "not a readable archive"),
        (
            "job.zip",
            _zip({"train.py": MODEL}),
            {"entrypoint": "nope.py"},
            422,
            "entrypoint",
            "has no 'nope.py'",
        ),
        (
            "train.py",
            MODEL + b"\nclass Stream(torch.utils.data.IterableDataset):\n    pass\n",
            {},
            422,
            "file",
            "defines Stream as an IterableDataset",
        ),
        ("train.py", b"def (:", {}, 422, "file", "not valid Python"),
        ("train.py", b"\xff\xfe binary", {}, 422, "file", "not valid Python"),
        ("data.csv", MODEL, {}, 415, "file", "neither a Python module"),
        ("train.py", b"#" * 1_000_001, {}, 413, "file", "over the limit of 1000000 bytes"),
    ],
)
def test_bad_uploads_are_refused_with_the_reason(  # type: ignore[no-untyped-def]
    upload, name: str, content: bytes, data: dict, status: int, field: str, words: str
) -> None:
    response = upload(name, content, **data)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and words in error["message"]
    assert upload.versions() == []


def test_archive_loader_module_satisfies_the_engine(tmp_path: Path) -> None:
    """What agents receive for an archive loads with the engine's own contract loader."""
    from worker.engine.contract import load_training_code

    archive = _zip({"train.py": MODEL, "helpers.py": HELPERS})
    path = tmp_path / "code-0.py"
    path.write_bytes(loader_module(archive, entrypoint="train.py", filename="job.zip"))
    code = load_training_code(str(path))
    train, _ = code.build_datasets()
    assert len(train) == 16 and code.metrics is None
    assert code.build_model()(train[0][0].unsqueeze(0)).shape == (1, 1)


def test_agents_get_the_loader_for_an_archive_version(client: TestClient, upload) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import agent_headers, make_group

    version = upload("job.zip", _zip({"train.py": MODEL, "helpers.py": HELPERS})).json()
    make_group(client, "cpu-a", capacity=1)
    task = client.post(
        "/api/v1/tasks",
        json={
            "project_id": version["project_id"],
            "code_version_id": version["id"],
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    ).json()
    code = client.get(f"/internal/v1/tasks/{task['id']}/code", headers=agent_headers())
    assert code.status_code == 200 and b"_ARCHIVE = base64.b64decode(" in code.content
    compile(code.content, "code-0.py", "exec")


def test_portal_upload_too_large_is_413_inline(client: TestClient) -> None:
    project = client.post("/api/v1/projects", json={"name": "p"}).json()
    response = client.post(
        f"/projects/{project['id']}/code-versions/upload",
        data=with_csrf(client, {}),
        files={"file": ("train.py", b"#" * 1_000_001)},
    )
    assert response.status_code == 413
    assert "over the limit" in parse(response.text).find(data_field="file").text()
    none = client.post(
        f"/projects/{project['id']}/code-versions/upload", data=with_csrf(client, {})
    )
    assert none.status_code == 422 and parse(none.text).find(data_field="file")
