"""A code version's own Python packages: declared beside a module or inside an archive,
resolved at upload with uv against the real package index into a lock of exact pins with
hashes; refused, with nothing stored, when a requirement would replace a platform package,
names no package on the index, has no wheel, or is no package name at all."""

import hashlib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.core.errors import Invalid
from backend.projects.requirements import declared_requirements, requirement_lines
from contracts.packages import pins, platform_packages
from tests.backend.projects.test_code_uploads import _tgz, _zip
from tests.backend.web.dom import parse
from tests.conftest import with_csrf

MODULE = b"""
import torch

def build_model():
    return torch.nn.Linear(4, 1)

def build_datasets():
    return [], []

def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""
PYPROJECT = b"""
[project]
name = "job"
version = "0.1"
dependencies = ["einops>=0.8", "torch"]
"""


@pytest.fixture
def project(client: TestClient) -> dict:
    return client.post("/api/v1/projects", json={"name": "p"}).json()


def _upload(client: TestClient, project: dict, name: str, content: bytes, **data: str):  # type: ignore[no-untyped-def]
    return client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": (name, content)},
        data=data,
    )


def _versions(client: TestClient, project: dict) -> list[dict]:
    return client.get(f"/api/v1/projects/{project['id']}/code-versions").json()


def _nothing_stored(client: TestClient, project: dict, data_dir: Path) -> None:
    assert _versions(client, project) == []
    assert not (data_dir / "code").exists() or not any((data_dir / "code").iterdir())


# ---- refused before the index is asked (no registry needed) ----


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("-e ./pkg", "a pip option (-e)"),
        ("-r other.txt", "a pip option (-r)"),
        ("--index-url https://example.org/simple", "a pip option (--index-url)"),
        ("einops==0.8.2 --hash=sha256:00", "a pip option (--hash)"),
        ("git+https://github.com/arogozhnikov/einops", "a URL"),
        ("https://example.org/einops-0.8.2-py3-none-any.whl", "a URL"),
        ("einops @ https://example.org/einops.whl", "a direct reference (name @ url)"),
        ("./vendor/einops", "a local path"),
        ("einops-0.8.2-py3-none-any.whl", "a local archive"),
    ],
)
def test_lines_that_are_no_index_package_are_refused(line: str, kind: str) -> None:
    with pytest.raises(Invalid) as refused:
        requirement_lines(f"# my packages\neinops\n\n{line}\n")
    assert refused.value.field == "requirements"
    assert "requirements name packages on the index" in refused.value.message
    assert f"{kind} is refused" in refused.value.message
    assert f"line 4: {line!r}" in refused.value.message


def test_lines_keep_names_specs_extras_and_markers() -> None:
    text = 'einops>=0.8  # tensors\n\ntimm[hub] ; python_version >= "3.11"\nfoo \\\n  ==1.0\n'
    assert requirement_lines(text) == [
        "einops>=0.8",
        'timm[hub] ; python_version >= "3.11"',
        "foo    ==1.0",
    ]


def test_declared_requirements_of_an_archive() -> None:
    assert declared_requirements({"train.py": b""}) is None
    assert declared_requirements(
        {"requirements.txt": b"einops\n", "pyproject.toml": PYPROJECT}
    ) == ("einops\n")
    assert declared_requirements({"pyproject.toml": PYPROJECT}) == "einops>=0.8\ntorch\n"
    assert declared_requirements({"pyproject.toml": b"[tool.x]\na = 1\n"}) is None
    with pytest.raises(Invalid, match="not valid TOML"):
        declared_requirements({"pyproject.toml": b"[project\n"})


def test_url_and_editable_lines_refused_at_upload(
    client: TestClient, project: dict, service_env: Path
) -> None:
    for text in ("einops\n-e git+https://github.com/x/y#egg=y\n", "https://example.org/x.whl\n"):
        response = _upload(client, project, "train.py", MODULE, requirements=text)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == "requirements"
        assert "requirements name packages on the index" in error["message"]
    _nothing_stored(client, project, service_env)


def test_examples_and_plain_modules_have_no_requirements(client: TestClient, project: dict) -> None:
    example = client.post(
        f"/api/v1/projects/{project['id']}/code-versions", json={"example": "mnist_cnn"}
    ).json()
    plain = _upload(client, project, "train.py", MODULE, requirements="  \n").json()
    for version in (example, plain):
        assert (version["requirements"], version["lock"], version["lock_hash"]) == (
            None,
            None,
            None,
        )
        assert version["packages"] == []


def test_an_archive_with_a_requirements_field_must_agree(client: TestClient, project: dict) -> None:
    """A field beside an archive that declares none, or other ones, is refused before any
    resolution, saying which to use."""
    bare = _upload(client, project, "job.zip", _zip({"train.py": MODULE}), requirements="einops")
    assert bare.status_code == 422
    assert "put them in its requirements.txt" in bare.json()["error"]["message"]
    other = _upload(
        client,
        project,
        "job.zip",
        _zip({"train.py": MODULE, "requirements.txt": b"einops\n"}),
        requirements="einops==0.8.2",
    )
    assert other.status_code == 422
    message = other.json()["error"]["message"]
    assert "requirements.txt declares other requirements" in message
    assert "leave the field empty" in message


# ---- resolved against the real index ----


@pytest.mark.registry
@pytest.mark.usefixtures("registry")
def test_a_module_with_requirements_gets_a_lock(client: TestClient, project: dict) -> None:
    response = _upload(client, project, "train.py", MODULE, requirements="einops\n")
    assert response.status_code == 201, response.text
    version = response.json()
    assert version["requirements"] == "einops\n"
    lock = version["lock"]
    assert set(pins(lock)) == {"einops"}
    assert "--hash=sha256:" in lock
    assert version["lock_hash"] == hashlib.sha256(lock.encode()).hexdigest()
    assert version["packages"] == [{"name": "einops", "version": pins(lock)["einops"]}]
    assert _versions(client, project)[0]["lock_hash"] == version["lock_hash"]

    page = parse(client.get(f"/projects/{project['id']}").text)
    details = page.by_id(f"lock-{version['version']}")
    assert f"einops=={pins(lock)['einops']}" in details.find("summary").text()
    assert "--hash=sha256:" in details.find("pre").text()


@pytest.mark.registry
@pytest.mark.usefixtures("registry")
def test_archives_declare_requirements_in_requirements_txt_or_pyproject(
    client: TestClient, project: dict
) -> None:
    zipped = _upload(
        client,
        project,
        "job.zip",
        _zip({"job/train.py": MODULE, "job/requirements.txt": b"einops>=0.8\n"}),
    )
    assert zipped.status_code == 201, zipped.text
    assert zipped.json()["requirements"] == "einops>=0.8\n"
    assert [p["name"] for p in zipped.json()["packages"]] == ["einops"]

    # torch is the platform's: declared, met, never in the lock.
    tarred = _upload(
        client, project, "job.tar.gz", _tgz({"train.py": MODULE, "pyproject.toml": PYPROJECT})
    )
    assert tarred.status_code == 201, tarred.text
    assert tarred.json()["requirements"] == "einops>=0.8\ntorch\n"
    assert set(pins(tarred.json()["lock"])) == {"einops"}
    assert tarred.json()["lock_hash"] == zipped.json()["lock_hash"]  # the same environment

    same = _upload(
        client,
        project,
        "job.zip",
        _zip({"train.py": MODULE, "requirements.txt": b"einops>=0.8\n"}),
        requirements="einops>=0.8  # the archive's, too\n",
    )
    assert same.status_code == 201, same.text


@pytest.mark.registry
@pytest.mark.usefixtures("registry")
def test_pinning_a_platform_package_is_refused_naming_it(
    client: TestClient, project: dict, service_env: Path
) -> None:
    platform_torch = platform_packages()["torch"]
    response = _upload(client, project, "train.py", MODULE, requirements="torch==2.12.0\n")
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "requirements"
    assert f"torch==2.12.0 would replace the platform's torch {platform_torch}" in error["message"]
    assert "drop the pin" in error["message"]
    _nothing_stored(client, project, service_env)

    # The portal's form shows the refusal beside the field and keeps what was typed.
    form = client.post(
        f"/projects/{project['id']}/code-versions/upload",
        data=with_csrf(client, {"requirements": "einops\ntorch==2.12.0\n"}),
        files={"file": ("train.py", MODULE)},
    )
    assert form.status_code == 422
    page = parse(form.text)
    assert "torch==2.12.0 would replace" in page.find(data_field="requirements").text()
    assert page.by_id("requirements").text() == "einops torch==2.12.0"
    _nothing_stored(client, project, service_env)


@pytest.mark.registry
@pytest.mark.usefixtures("registry")
def test_an_unknown_package_is_refused_naming_it(client: TestClient, project: dict) -> None:
    response = _upload(
        client, project, "train.py", MODULE, requirements="einops\npolytrain-no-such-pkg-zzqq\n"
    )
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert "(polytrain-no-such-pkg-zzqq) cannot be resolved on" in message
    assert "was not found in the package registry" in message
    assert _versions(client, project) == []


@pytest.mark.registry
@pytest.mark.usefixtures("registry")
def test_a_package_without_a_wheel_is_refused_when_wheels_only(
    client: TestClient, project: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docopt 0.6.2, its last release, is a source distribution only."""
    from backend.core.config import get_settings

    monkeypatch.setenv("POLYTRAIN_WHEELS_ONLY", "true")
    get_settings.cache_clear()
    response = _upload(client, project, "train.py", MODULE, requirements="docopt\n")
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("docopt has no wheel")
    assert "only wheels are accepted" in message
    assert _versions(client, project) == []
