"""A checkpoint whose optimizer state its sharded group's workers keep (contracts/sharded_state.py),
at the backend: the files of its state folder arrive beside it, in any order, each from the
worker that wrote it; until all are stored it is neither resumed from nor downloadable; its
download is one consolidated state dict, the same as a whole run's; a tampered folder is
refused, never run."""

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.scheduler.dispatch import last_checkpoint
from backend.tasks.models import Task, TaskStatus
from contracts import sharded_state
from tests.backend.scheduling import finish, group, running_task
from tests.backend.tasks.test_nonfinite_metrics import _agent_api
from tests.conftest import agent_headers
from tests.worker.engine.conftest import build_spec
from tests.worker.engine.reference import TIMEOUT_S
from worker.engine.local import launch_local

pytestmark = pytest.mark.stack

GROUPS = [
    {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
    {"name": "b", "device_type": "cpu", "workers": 1},
]
FILES = [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One epoch of the same task with group a sharded and whole: their checkpoint folders."""
    found = {}
    for sharding in ("fsdp", "none"):
        folder = tmp_path_factory.mktemp(sharding)
        groups = [{**g, "sharding": sharding} if g["name"] == "a" else g for g in GROUPS]
        spec = build_spec(folder, epochs=1, groups=groups)
        run = launch_local(spec, timeout_s=TIMEOUT_S)
        assert run.ok, run.text(0)[-2000:]
        found[sharding] = Path(spec.checkpoint_dir)
    return found


def _running(session: Session) -> Task:
    """A task running on cpu-a x 2 and cpu-b x 1 (groups made here)."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    return running_task(session)


def _upload(client: TestClient, task_id: int, source: Path, parts: list[str]) -> int:
    """As the agent uploads it (worker.agent.client.AgentClient.checkpoint): the file and its
    parts' names in one multipart form."""
    response = client.post(
        f"/internal/v1/tasks/{task_id}/checkpoints",
        headers=agent_headers(),
        params={"name": source.name, "epoch": 0, "step": 23},
        files={"checkpoint": (source.name, source.read_bytes(), "application/octet-stream")},
        data={"parts": json.dumps(parts)},
    )
    response.raise_for_status()
    return int(response.json()["id"])


def _upload_part(client: TestClient, task_id: int, part: str, body: bytes) -> int:
    return client.post(
        f"/internal/v1/tasks/{task_id}/checkpoint-parts",
        headers=agent_headers(),
        params={"part": part},
        content=body,
    ).status_code


def test_a_sharded_checkpoint_is_whole_once_its_parts_arrive_and_downloads_as_one(
    client: TestClient, session: Session, runs: dict[str, Path]
) -> None:
    task = _running(session)
    folder = runs["fsdp"] / "epoch-0.pt.dcp"
    parts = [f"epoch-0.pt.dcp/{f}" for f in FILES]
    assert _upload_part(client, task.id, parts[2], (folder / FILES[2]).read_bytes()) == 200
    checkpoint = _upload(client, task.id, runs["fsdp"] / "epoch-0.pt", parts)
    assert _upload_part(client, task.id, parts[0], (folder / FILES[0]).read_bytes()) == 200

    listed = client.get(
        f"/internal/v1/tasks/{task.id}/checkpoints/{checkpoint}/parts", headers=agent_headers()
    ).json()
    assert listed == {"parts": parts, "missing": [parts[1]]}
    session.expire_all()
    assert last_checkpoint(session, task_id=task.id) is None  # not resumable yet
    (row,) = client.get(f"/api/v1/tasks/{task.id}/checkpoints").json()
    assert (row["sharded_files"], row["complete"]) == (3, False)
    assert "Arriving…" in client.get(f"/tasks/{task.id}").text
    url = f"/api/v1/tasks/{task.id}/checkpoints/{checkpoint}/download"
    early = client.get(url)
    assert early.status_code == 409 and "1 of its 3 files are not stored yet" in early.text

    assert _upload_part(client, task.id, parts[1], (folder / FILES[1]).read_bytes()) == 200
    # Sent again (a retried upload): kept; other bytes under a stored name: refused.
    assert _upload_part(client, task.id, parts[1], (folder / FILES[1]).read_bytes()) == 200
    assert _upload_part(client, task.id, parts[1], b"other") == 409
    session.expire_all()
    resumable = last_checkpoint(session, task_id=task.id)
    assert resumable is not None and resumable.id == checkpoint
    fetched = client.get(
        f"/internal/v1/tasks/{task.id}/checkpoints/{checkpoint}/parts/{parts[2]}",
        headers=agent_headers(),
    )
    assert fetched.content == (folder / FILES[2]).read_bytes()

    downloaded = client.get(url)
    assert downloaded.status_code == 200, downloaded.text
    got = torch.load(io.BytesIO(downloaded.content), weights_only=True)
    # The whole run's source worker wrote its optimizer state beside its checkpoint too.
    sharded_state.consolidate(runs["none"] / "epoch-0.pt", runs["none"] / "whole.pt")
    whole = torch.load(runs["none"] / "whole.pt", weights_only=True)
    assert "sharded_state" not in got["optimizer"]
    assert got["optimizer"]["param_groups"] == whole["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == whole["optimizer"]["state"].keys()
    for key, state in whole["optimizer"]["state"].items():
        for name, value in state.items():  # sync with fsdp steps as one process does
            torch.testing.assert_close(
                got["optimizer"]["state"][key][name], value, atol=1e-5, rtol=0
            )
    for name, value in whole["model"].items():
        torch.testing.assert_close(got["model"][name], value, atol=1e-5, rtol=0)
    assert client.get(url).content == downloaded.content  # built once, kept
    (row,) = client.get(f"/api/v1/tasks/{task.id}/checkpoints").json()
    assert (row["sharded_files"], row["complete"]) == (3, True)
    stored = sum((folder / f).stat().st_size for f in FILES)
    assert row["state_bytes"] == stored  # the size shown is the file's and these together
    page = client.get(f"/tasks/{task.id}")
    assert page.status_code == 200 and "Arriving…" not in page.text
    assert f"/checkpoints/{checkpoint}/download" in page.text


def test_a_checkpoint_lists_a_thousand_state_files_and_refuses_a_malformed_list(
    client: TestClient, session: Session
) -> None:
    """The names travel in the upload's form, not its query string, where a proxy's 8 KiB
    request line held some 180 (these are 36 KB); the agent's own client sends them."""
    task = _running(session)
    parts = [f"epoch-0.pt.g{g}.dcp/__{m}_0.distcp" for g in range(250) for m in range(4)]
    stored = _agent_api(client).checkpoint(
        task.id, name="epoch-0.pt", epoch=0, step=3, body=b"an outline", parts=parts
    )
    url = f"/internal/v1/tasks/{task.id}/checkpoints"
    listed = client.get(f"{url}/{stored}/parts", headers=agent_headers()).json()
    assert listed["parts"] == parts and listed["missing"] == parts
    params = {"name": "epoch-1.pt", "epoch": 1, "step": 6}
    outline = {"checkpoint": ("epoch-1.pt", b"an outline", "application/octet-stream")}
    for files, data, field in [
        (outline, {"parts": "not json"}, "parts"),
        (outline, {"parts": json.dumps({"a": "b"})}, "parts"),
        (outline, {"parts": "[" * 200_000}, "parts"),  # too deep for the JSON parser
        (outline, {"parts": json.dumps(["epoch-1.pt.dcp/../../secret"])}, "parts"),
        ({"model": ("x", b"x", "application/octet-stream")}, {"parts": "[]"}, "checkpoint"),
    ]:
        refused = client.post(url, headers=agent_headers(), params=params, files=files, data=data)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["field"] == field
    # An agent older than the portal, sending them in the query string: refused, not stored
    # as a checkpoint whose state it does not know of.
    old = client.post(
        url, headers=agent_headers(), params={**params, "parts": parts[:2]}, content=b"x"
    )
    assert old.status_code == 422 and old.json()["error"]["field"] == "parts"
    assert len(client.get(f"/api/v1/tasks/{task.id}/checkpoints").json()) == 1  # none stored
    # A form without `parts`: a checkpoint whose file holds everything.
    whole = client.post(url, headers=agent_headers(), params=params, files=outline)
    assert whole.status_code == 200 and whole.json()["sharded_files"] == 0


def test_a_checkpoint_whose_state_never_arrived_says_so_once_the_task_ended(
    client: TestClient, session: Session, runs: dict[str, Path]
) -> None:
    task = _running(session)
    parts = [f"epoch-0.pt.dcp/{f}" for f in FILES]
    _upload(client, task.id, runs["fsdp"] / "epoch-0.pt", parts)  # no part ever comes
    finish(session, task, TaskStatus.FAILED)
    page = client.get(f"/tasks/{task.id}").text
    assert "Incomplete" in page and "download an earlier checkpoint" in page
    assert "Arriving…" not in page


class _Run:
    def __reduce__(self) -> tuple:
        import os

        return (os.system, ("touch /tmp/polytrain-pwned",))


@pytest.mark.parametrize("bad", ["a part name", "code in its metadata"])
def test_a_tampered_state_folder_is_refused(
    bad: str, client: TestClient, session: Session, runs: dict[str, Path]
) -> None:
    task = _running(session)
    folder = runs["fsdp"] / "epoch-0.pt.dcp"
    if bad == "a part name":
        response = client.post(
            f"/internal/v1/tasks/{task.id}/checkpoint-parts",
            headers=agent_headers(),
            params={"part": "epoch-0.pt.dcp/../../secret"},
            content=b"x",
        )
        assert response.status_code == 422 and "'.metadata' or '__<n>_<m>.distcp'" in response.text
        return
    parts = [f"epoch-0.pt.dcp/{f}" for f in FILES]
    checkpoint = _upload(client, task.id, runs["fsdp"] / "epoch-0.pt", parts)
    for part, name in zip(parts, FILES, strict=True):
        body = pickle.dumps(_Run()) if name == ".metadata" else (folder / name).read_bytes()
        assert _upload_part(client, task.id, part, body) == 200
    Path("/tmp/polytrain-pwned").unlink(missing_ok=True)
    response = client.get(f"/api/v1/tasks/{task.id}/checkpoints/{checkpoint}/download")
    assert response.status_code == 422, response.text
    said = response.json()["error"]
    assert said["field"] == "checkpoint_id" and "download an earlier checkpoint" in said["message"]
    assert "may not name posix.system" in said["message"]
    assert str(runs["fsdp"]) not in said["message"] and "/checkpoints/" not in said["message"]
    assert not Path("/tmp/polytrain-pwned").exists()
