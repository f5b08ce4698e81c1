"""Strict inputs: every request body refuses an unknown field by name, no string may hold a
NUL character (body, query, path or form), and checkpoint names are plain file names
that are never overwritten."""

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from backend.projects.code import EXAMPLES_DIR
from tests.backend.conftest import World
from tests.conftest import agent_headers

AGENT_BODY = {
    "name": "a1",
    "host": "h1",
    "resource_group": "cpu-a",
    "workers": 1,
    "hardware": {"cpu_cores": 2, "memory_bytes": 1},
}

# (method, path, a body the route takes); `{task}`, `{project}`, `{user}` are filled in.
REST_BODIES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/api/v1/auth/login", {"email": "x@example.org", "password": "whatever1"}),
    ("POST", "/api/v1/users/me/password", {"current_password": "a", "new_password": "b" * 9}),
    ("POST", "/api/v1/users/me/tokens", {"name": "cli"}),
    ("POST", "/api/v1/users", {"email": "new@example.org", "password": "p" * 9}),
    ("PATCH", "/api/v1/users/{user}", {"name": "Ada"}),
    ("POST", "/api/v1/projects", {"name": "other"}),
    ("PATCH", "/api/v1/projects/{project}", {"description": "d"}),
    ("POST", "/api/v1/projects/{project}/members", {"email": "member@example.org"}),
    ("POST", "/api/v1/projects/{project}/code-versions", {"example": "tiny_regression"}),
    ("POST", "/api/v1/resource-groups", {"name": "cpu-z", "device_type": "cpu", "capacity": 1}),
    ("PATCH", "/api/v1/resource-groups/cpu-a", {"capacity": 3}),
    (
        "POST",
        "/api/v1/tasks",
        {
            "project_id": 0,
            "code_version_id": 0,
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    ),
    ("PATCH", "/api/v1/tasks/{task}", {"priority": 3}),
    ("PATCH", "/api/v1/agents/{agent}", {"description": "rack 3"}),
]
INTERNAL_BODIES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/internal/v1/agents/register", AGENT_BODY),
    ("POST", "/internal/v1/agents/{agent}/heartbeat", {"running": []}),
    ("POST", "/internal/v1/sub-tasks/1/claim", {"agent_id": 1, "host": "h"}),
    ("POST", "/internal/v1/sub-tasks/1/finished", {"succeeded": False}),
    ("PUT", "/internal/v1/tasks/{task}/rendezvous", {"master_addr": "h", "master_port": 1}),
    ("POST", "/internal/v1/tasks/{task}/logs", {"lines": []}),
    ("POST", "/internal/v1/tasks/{task}/metrics", {"metrics": []}),
    ("POST", "/internal/v1/tasks/{task}/progress", {"progress": 0.5, "epoch": 0}),
    ("POST", "/internal/v1/tasks/{task}/report", {"lines": []}),
]


def _agent(world: World) -> int:
    response = world.client.post(
        "/internal/v1/agents/register", headers=agent_headers(), json=AGENT_BODY
    )
    response.raise_for_status()
    return int(response.json()["id"])


def _url(world: World, path: str) -> str:
    return path.format(
        task=world.task["id"],
        project=world.project["id"],
        user=world.member.id,
        agent=_agent(world) if "{agent}" in path else 0,
    )


def _refused(response: Any, field: str) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"], error
    return dict(error)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    REST_BODIES + INTERNAL_BODIES,
    ids=[f"{m} {p}" for m, p, _ in REST_BODIES + INTERNAL_BODIES],
)
def test_an_unknown_field_is_refused_by_name(
    world: World, method: str, path: str, body: dict[str, Any]
) -> None:
    headers = agent_headers() if path.startswith("/internal/") else world.admin.headers
    response = world.client.request(
        method, _url(world, path), headers=headers, json={**body, "bogus_field": 1}
    )
    error = _refused(response, "bogus_field")
    assert error["message"] == "bogus_field: unknown field (this request has no such field)"


def test_the_split_typo_is_refused_and_nothing_is_queued(world: World) -> None:
    body = {
        "project_id": world.project["id"],
        "code_version_id": world.version["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 1}],
        "split": "weighted",
    }
    before = world.client.get("/api/v1/tasks", headers=world.admin.headers).json()
    _refused(world.client.post("/api/v1/tasks", headers=world.owner.headers, json=body), "split")
    assert world.client.get("/api/v1/tasks", headers=world.admin.headers).json() == before


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"platform": "Linux", "torch": "2.13.0", "gpu_model": "x"}, "hardware.gpu_model"),
        ({"cpu_cores": 2, "memory_bytes": 1, "extra": {"nested": 1}}, "hardware.extra"),
    ],
)
def test_agent_hardware_is_declared_field_by_field(
    world: World, extra: dict[str, Any], field: str
) -> None:
    body = {**AGENT_BODY, "hardware": {**AGENT_BODY["hardware"], **extra}}
    response = world.client.post("/internal/v1/agents/register", headers=agent_headers(), json=body)
    _refused(response, field)


def test_nul_in_a_json_string_is_refused_at_its_field(world: World) -> None:
    client, headers = world.client, world.owner.headers
    _refused(client.post("/api/v1/projects", headers=headers, json={"name": "a\x00b"}), "name")
    described = client.patch(
        f"/api/v1/projects/{world.project['id']}", headers=headers, json={"description": "fine\x00"}
    )
    assert _refused(described, "description")["message"] == (
        "description: must not contain NUL characters"
    )
    labels = client.post(
        "/api/v1/resource-groups",
        headers=world.admin.headers,
        json={"name": "cpu-z", "device_type": "cpu", "capacity": 1, "labels": {"zone": "a\x00"}},
    )
    assert "zone must not contain NUL" in _refused(labels, "labels")["message"]
    log = {"node": "rank-1", "seq": 9, "time": "2026-01-01T00:00:00", "text": "x\x00y"}
    refused = client.post(
        f"/internal/v1/tasks/{world.task['id']}/logs",
        headers=agent_headers(),
        json={"lines": [log]},
    )
    _refused(refused, "lines.0.text")
    names = [p["name"] for p in client.get("/api/v1/projects", headers=headers).json()]
    assert names == ["secret"]
    stored = client.get(f"/api/v1/tasks/{world.task['id']}/logs", headers=headers).json()
    assert [line["text"] for line in stored] == ["secret line"]


def test_nul_in_a_query_or_path_parameter_is_refused_by_name(world: World) -> None:
    client, headers = world.client, world.owner.headers
    logs = client.get(
        f"/api/v1/tasks/{world.task['id']}/logs", headers=headers, params={"node": "rank-1\x00"}
    )
    assert _refused(logs, "node")["message"] == "node: must not contain NUL characters"
    group = client.get("/api/v1/resource-groups/cpu%00a", headers=world.admin.headers)
    assert _refused(group, "name")["message"] == "name: must not contain NUL characters"
    checkpoint = client.post(
        f"/internal/v1/tasks/{world.task['id']}/checkpoints",
        headers=agent_headers(),
        content=b"w",
        params={"name": "e\x00.pt", "epoch": 0, "step": 1},
    )
    _refused(checkpoint, "name")


def test_nul_in_a_form_field_or_upload_name_is_refused_by_name(world: World) -> None:
    client, headers = world.client, world.owner.headers
    url = f"/api/v1/projects/{world.project['id']}/code-versions/upload"
    module = (
        b"def build_model(): ...\ndef build_datasets(): ...\n"
        b"def build_optimizer(p): ...\ndef loss_fn(o, t): ...\n"
    )
    # httpx escapes a NUL in a file name; a hand-made body carries it as a client may.
    body = (
        b'--B\r\nContent-Disposition: form-data; name="file"; filename="tr\x00ain.py"\r\n'
        b"Content-Type: text/x-python\r\n\r\n" + module + b"\r\n--B--\r\n"
    )
    named = client.post(
        url, headers={**headers, "Content-Type": "multipart/form-data; boundary=B"}, content=body
    )
    assert _refused(named, "file")["message"] == "file: must not contain NUL characters"
    entry = client.post(
        url, headers=headers, files={"file": ("train.py", module)}, data={"entrypoint": "a\x00"}
    )
    _refused(entry, "entrypoint")
    versions = client.get(
        f"/api/v1/projects/{world.project['id']}/code-versions", headers=headers
    ).json()
    assert len(versions) == 1


def test_nul_in_an_archive_member_name_is_refused(world: World) -> None:
    import io
    import tarfile

    module = (
        b"def build_model(): ...\ndef build_datasets(): ...\n"
        b"def build_optimizer(p): ...\ndef loss_fn(o, t): ...\n"
    )
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz", format=tarfile.PAX_FORMAT) as archive:
        member = tarfile.TarInfo("train.py")
        member.size, member.pax_headers = len(module), {"path": "tr\x00ain.py"}
        archive.addfile(member, io.BytesIO(module))
    url = f"/api/v1/projects/{world.project['id']}/code-versions/upload"
    refused = world.client.post(
        url, headers=world.owner.headers, files={"file": ("code.tar.gz", packed.getvalue())}
    )
    assert "unsafe path" in _refused(refused, "file")["message"]


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../escape.pt", "a/b.pt", ".hidden", "/abs.pt", "x" * 201]
)
def test_a_checkpoint_name_that_is_no_file_name_is_refused(
    world: World, service_env: Path, name: str
) -> None:
    task_id = world.task["id"]
    before = sorted(p for p in service_env.rglob("*") if p.is_file())
    response = world.client.post(
        f"/internal/v1/tasks/{task_id}/checkpoints",
        headers=agent_headers(),
        content=b"other weights",
        params={"name": name, "epoch": 0, "step": 2},
    )
    _refused(response, "name")
    assert sorted(p for p in service_env.rglob("*") if p.is_file()) == before
    listed = world.client.get(
        f"/api/v1/tasks/{task_id}/checkpoints", headers=world.owner.headers
    ).json()
    assert [c["id"] for c in listed] == [world.checkpoint["id"]]


def test_a_repeated_checkpoint_name_never_overwrites(world: World) -> None:
    task_id, client = world.task["id"], world.client
    url = f"/internal/v1/tasks/{task_id}/checkpoints"
    params = {"name": "epoch-0.pt", "epoch": 0, "step": 1}
    other = client.post(url, headers=agent_headers(), content=b"other weights", params=params)
    assert other.status_code == 409, other.text
    assert other.json()["error"]["field"] == "name"
    retried = client.post(url, headers=agent_headers(), content=b"weights", params=params)
    assert retried.status_code == 200, retried.text
    assert retried.json()["id"] == world.checkpoint["id"]
    listed = client.get(f"/api/v1/tasks/{task_id}/checkpoints", headers=world.owner.headers)
    assert [c["id"] for c in listed.json()] == [world.checkpoint["id"]]
    download = client.get(
        f"/api/v1/tasks/{task_id}/checkpoints/{world.checkpoint['id']}/download",
        headers=world.owner.headers,
    )
    assert download.content == b"weights"
    later = client.post(
        url,
        headers=agent_headers(),
        content=b"w2",
        params={**params, "name": "epoch-1.pt", "epoch": 1, "step": 2},
    )
    assert later.status_code == 200 and later.json()["id"] != world.checkpoint["id"]


@pytest.mark.parametrize(
    "example",
    ["../backend/main", str(EXAMPLES_DIR.parent / "backend" / "main"), "__init__", "mnist_cnn.py"],
)
def test_only_a_listed_example_becomes_a_code_version(world: World, example: str) -> None:
    url = f"/api/v1/projects/{world.project['id']}/code-versions"
    response = world.client.post(url, headers=world.owner.headers, json={"example": example})
    _refused(response, "example")
    assert len(world.client.get(url, headers=world.owner.headers).json()) == 1


def test_example_resolution_takes_names_from_the_list_only() -> None:
    from backend.core.errors import Invalid
    from backend.projects.code import example_path, list_examples

    assert example_path("mnist_cnn") == EXAMPLES_DIR / "mnist_cnn.py"
    assert "mnist_cnn" in list_examples()
    outside = str(EXAMPLES_DIR.parent / "backend" / "main")
    for name in ("../backend/main", outside, "", ".", "__init__", "mnist_cnn\x00"):
        with pytest.raises(Invalid) as refused:
            example_path(name)
        assert refused.value.field == "example"


def test_an_agent_reports_through_the_strict_schemas(world: World, tmp_path: Path) -> None:
    """The agent's own payloads (registration with detected hardware, heartbeat, logs with
    a NUL from user output, metrics, progress, a checkpoint) all pass the strict schemas."""
    import queue

    from worker.agent.client import InternalApi
    from worker.agent.hardware import detect_hardware
    from worker.agent.reporter import Reporter
    from worker.engine.report import PREFIX

    api = InternalApi("http://testserver", "unused", retries=0)
    api._http = TestClient(
        world.client.app, base_url="http://testserver/internal/v1", headers=agent_headers()
    )
    agent_id = api.register(
        name="probe", host="h", resource_group="cpu-a", workers=1, hardware=detect_hardware()
    )
    api.heartbeat(agent_id, [{"task_id": world.task["id"], "ranks": [1]}])
    task_id = world.task["id"]
    (tmp_path / "checkpoints").mkdir()
    checkpoint = tmp_path / "checkpoints" / "epoch-1.pt"  # rank 0's own checkpoint folder
    checkpoint.write_bytes(b"weights 1")
    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    lines.put(("rank-2", "user printed \x00 a NUL"))
    lines.put(
        (
            "rank-1",
            PREFIX + '{"type":"metric","name":"loss","value":0.5,"step":3,"epoch":1,"rank":1}',
        )
    )
    lines.put(
        ("rank-0", PREFIX + '{"type":"progress","epoch":1,"step":3,"steps_per_epoch":2,"epochs":2}')
    )
    lines.put(
        ("rank-0", PREFIX + f'{{"type":"checkpoint","path":"{checkpoint}","step":3,"epoch":1}}')
    )
    reporter = Reporter(api, task_id, group="cpu-a")
    reporter.rank_dirs["rank-0"] = tmp_path
    reporter.pump(lines)
    reporter.flush()
    headers = world.owner.headers
    logs = world.client.get(f"/api/v1/tasks/{task_id}/logs", headers=headers).json()
    assert "user printed \ufffd a NUL" in [line["text"] for line in logs]
    metrics = world.client.get(f"/api/v1/tasks/{task_id}/metrics", headers=headers).json()
    assert ("loss", 0.5) in [(m["name"], m["value"]) for m in metrics]
    assert world.client.get(f"/api/v1/tasks/{task_id}", headers=headers).json()["progress"] == 0.75
    names = [
        c["epoch"]
        for c in world.client.get(f"/api/v1/tasks/{task_id}/checkpoints", headers=headers).json()
    ]
    assert sorted(names) == [0, 1]


def test_malformed_rank_output_never_stops_the_agent_reporting(world: World) -> None:
    """Rank output is untrusted: events with missing keys or a metric the API would refuse
    are logged as ignored, and every good line around them still arrives."""
    import queue

    from worker.agent.client import InternalApi
    from worker.agent.reporter import Reporter
    from worker.engine.report import PREFIX

    api = InternalApi("http://testserver", "unused", retries=0)
    api._http = TestClient(
        world.client.app, base_url="http://testserver/internal/v1", headers=agent_headers()
    )
    task_id = world.task["id"]
    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    for text in (
        '{"type":"metric","value":1.0}',
        '{"type":"progress","step":1}',
        '{"type":"metric","name":"' + "n" * 300 + '","value":1.0}',
        '{"type":"metric","name":"loss","value":null,"nonfinite":"bogus"}',
        '{"type":"checkpoint","path":"/x/checkpoints/a.pt"}',
        '{"type":"metric","name":"loss","value":0.25,"step":1,"epoch":0}',
    ):
        lines.put(("rank-1", PREFIX + text))
    lines.put(("rank-2", "a plain line"))
    reporter = Reporter(api, task_id, group="cpu-a")
    reporter.pump(lines)
    reporter.flush()
    headers = world.owner.headers
    texts = [
        line["text"]
        for line in world.client.get(f"/api/v1/tasks/{task_id}/logs", headers=headers).json()
    ]
    assert len([t for t in texts if t.startswith("ignored a malformed")]) == 4, texts
    assert "a plain line" in texts
    assert any(t.startswith("refused checkpoint") for t in texts)
    metrics = world.client.get(f"/api/v1/tasks/{task_id}/metrics?name=loss", headers=headers).json()
    assert [(m["name"], m["value"]) for m in metrics] == [("loss", 0.25)]
