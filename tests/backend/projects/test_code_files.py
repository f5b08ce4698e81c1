"""A code version's files over REST: a module's one file, an archive's every file, each
readable as text; unsafe, missing, binary and oversized ones refused with the reason; the
uploader recorded."""

import pytest
from fastapi.testclient import TestClient

from backend.core.errors import Invalid
from backend.projects import files
from backend.projects.code import EXAMPLES_DIR
from tests.backend.conftest import World
from tests.backend.projects.test_code_uploads import HELPERS, MODEL
from tests.backend.projects.test_code_uploads import _zip as zip_of

README = "# Job\n\nCaf\u00e9 <b>data</b>\n".encode()
BLOB = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
LATIN1 = "caf\u00e9 = 1\n".encode("latin-1")


ARCHIVE = {
    "job/train.py": MODEL,
    "job/helpers.py": HELPERS,
    "job/docs/README.md": README,
    "job/data/logo.png": BLOB,
    "job/data/latin1.py": LATIN1,
}


@pytest.fixture
def project(client: TestClient) -> dict:
    response = client.post("/api/v1/projects", json={"name": "files"})
    assert response.status_code == 201, response.text
    return dict(response.json())


def _upload(client: TestClient, project: dict, name: str, content: bytes) -> dict:
    response = client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": (name, content)},
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def _files_url(version: dict) -> str:
    return f"/api/v1/projects/{version['project_id']}/code-versions/{version['id']}/files"


def test_a_module_is_one_file_read_as_text(client: TestClient, project: dict) -> None:
    version = _upload(client, project, "train.py", MODEL)
    assert version["uploaded_by_id"] == client.account.id  # type: ignore[attr-defined]
    listing = client.get(_files_url(version))
    assert listing.status_code == 200, listing.text
    assert listing.json() == [{"path": "train.py", "size_bytes": len(MODEL)}]
    assert listing.headers["x-total-count"] == "1"
    text = client.get(f"{_files_url(version)}/train.py")
    assert text.status_code == 200
    assert text.headers["content-type"] == "text/plain; charset=utf-8"
    assert text.headers["x-content-type-options"] == "nosniff"  # never sniffed as HTML
    assert text.content == MODEL


def test_an_example_version_shows_the_bundled_module(client: TestClient, project: dict) -> None:
    version = client.post(
        f"/api/v1/projects/{project['id']}/code-versions", json={"example": "tiny_regression"}
    ).json()
    assert version["uploaded_by_id"] == client.account.id  # type: ignore[attr-defined]
    source = (EXAMPLES_DIR / "tiny_regression.py").read_bytes()
    assert client.get(_files_url(version)).json() == [
        {"path": "tiny_regression.py", "size_bytes": len(source)}
    ]
    assert client.get(f"{_files_url(version)}/tiny_regression.py").content == source


def test_an_archive_lists_every_file_and_each_is_readable(
    client: TestClient, project: dict
) -> None:
    version = _upload(client, project, "job.zip", zip_of(ARCHIVE))
    listing = client.get(_files_url(version)).json()
    expected = {name.removeprefix("job/"): content for name, content in ARCHIVE.items()}
    assert listing == [
        {"path": path, "size_bytes": len(expected[path])} for path in sorted(expected)
    ]
    paged = client.get(_files_url(version), params={"offset": 1, "limit": 2})
    assert [f["path"] for f in paged.json()] == sorted(expected)[1:3]
    assert paged.headers["x-total-count"] == str(len(expected))
    for path in ("train.py", "helpers.py", "docs/README.md"):
        answer = client.get(f"{_files_url(version)}/{path}")
        assert answer.status_code == 200, (path, answer.text)
        assert answer.content == expected[path]


@pytest.mark.parametrize("path", ["data/logo.png", "data/latin1.py"])
def test_a_binary_file_is_refused(client: TestClient, project: dict, path: str) -> None:
    version = _upload(client, project, "job.zip", zip_of(ARCHIVE))
    answer = client.get(f"{_files_url(version)}/{path}")
    assert answer.status_code == 415, answer.text
    error = answer.json()["error"]
    assert error["code"] == "unsupported_type" and error["field"] == "path"
    assert path in error["message"] and "binary" in error["message"]


def test_a_missing_file_is_404_naming_the_path(client: TestClient, project: dict) -> None:
    module = _upload(client, project, "train.py", MODEL)
    archive = _upload(client, project, "job.zip", zip_of(ARCHIVE))
    for version, path in ((module, "other.py"), (archive, "docs/nope.md"), (archive, "docs")):
        answer = client.get(f"{_files_url(version)}/{path}")
        assert answer.status_code == 404, (path, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "not_found" and f"'{path}'" in error["message"]


@pytest.mark.parametrize(
    "path",
    [
        "..%2Ftrain.py",
        "%2E%2E/%2E%2E/etc/passwd",
        "docs/..%2F..%2Ftrain.py",
        "%2Fetc%2Fpasswd",
        "docs%5C..%5Ctrain.py",
        "%2E/train.py",
        "docs//README.md",
    ],
)
def test_a_path_leaving_the_version_is_refused(
    client: TestClient, project: dict, path: str
) -> None:
    version = _upload(client, project, "job.zip", zip_of(ARCHIVE))
    answer = client.get(f"{_files_url(version)}/{path}")
    assert answer.status_code == 422, (path, answer.text)
    error = answer.json()["error"]
    assert error["field"] == "path" and "not a file path inside" in error["message"]


@pytest.mark.parametrize(
    "path",
    [
        "",
        ".",
        "../x.py",
        "a/../../x.py",
        "/etc/passwd",
        "a//b.py",
        "a/./b.py",
        "a\\b.py",
        "a\x00.py",
        "a/",
    ],
)
def test_unsafe_paths_are_refused_before_any_lookup(path: str) -> None:
    with pytest.raises(Invalid):
        files.check_path(path)


def test_safe_paths_are_kept() -> None:
    assert files.check_path("pkg/sub/model.py") == "pkg/sub/model.py"
    assert files.check_path("..hidden/x..py") == "..hidden/x..py"


def test_a_file_over_the_cap_is_refused(
    client: TestClient, project: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = b"# " + b"x" * files.MAX_SHOWN_BYTES + b"\n"
    version = _upload(client, project, "job.zip", zip_of({"train.py": MODEL, "big.py": big}))
    answer = client.get(f"{_files_url(version)}/big.py")
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert error["code"] == "too_large" and "'big.py'" in error["message"]
    assert "1 MiB" in error["message"]
    module = _upload(client, project, "train.py", MODEL)
    monkeypatch.setattr(files, "MAX_SHOWN_BYTES", 100)
    assert client.get(f"{_files_url(module)}/train.py").status_code == 413


def test_a_version_is_read_only_under_its_own_project(client: TestClient, project: dict) -> None:
    version = _upload(client, project, "train.py", MODEL)
    other = client.post("/api/v1/projects", json={"name": "other"}).json()
    url = f"/api/v1/projects/{other['id']}/code-versions/{version['id']}/files"
    for answer in (client.get(url), client.get(f"{url}/train.py")):
        assert answer.status_code == 404 and answer.json()["error"]["field"] == "version_id"
    assert client.get(f"{_files_url({**version, 'id': 99999})}").status_code == 404


def test_only_those_who_see_the_project_read_its_files(world: World) -> None:
    url = _files_url(world.version)
    for account, status in (
        (world.stranger, 404),
        (world.member, 200),
        (world.owner, 200),
        (world.admin, 200),
    ):
        for path in (url, f"{url}/tiny_regression.py"):
            answer = world.client.get(path, headers=account.headers)
            assert answer.status_code == status, (account.email, path, answer.text)
    assert world.version["uploaded_by_id"] == world.owner.id
    assert world.anonymous.get(url).status_code == 401
