"""Every endpoint authorizes: who may read and change projects, code, tasks, logs,
checkpoints (owners, members, admins), and who manages groups, agents and users (admins)."""

import pytest

from tests.backend.conftest import World

pytestmark = pytest.mark.stack  # on SQLite, and on PostgreSQL when configured

OPEN = {("post", "/api/v1/auth/login"), ("get", "/api/v1/health")}


def _paths(world: World) -> list[tuple[str, str]]:
    paths = world.client.get("/openapi.json").json()["paths"]
    return [
        (method, path)
        for path, ops in paths.items()
        if path.startswith("/api/v1")
        for method in ops
    ]


def _fill(path: str, world: World) -> str:
    return (
        path.replace("{project_id}", str(world.project["id"]))
        .replace("{task_id}", str(world.task["id"]))
        .replace("{version_id}", str(world.version["id"]))
        .replace("{path}", "tiny_regression.py")
        .replace("{checkpoint_id}", str(world.checkpoint["id"]))
        .replace("{user_id}", str(world.owner.id))
        .replace("{token_id}", "1")
        .replace("{name}", "cpu-a")
    )


def test_every_api_endpoint_needs_a_login(world: World) -> None:
    """Anonymous calls to anything but login and health get 401 in the shared error shape."""
    checked = 0
    for method, path in _paths(world):
        if (method, path) in OPEN:
            continue
        response = world.anonymous.request(method.upper(), _fill(path, world))
        assert response.status_code == 401, (method, path, response.text)
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
        checked += 1
    assert checked >= 30


# (method, path, json body) of everything scoped to the owner's project
PROJECT_SCOPED = [
    ("get", "/api/v1/projects/{project_id}", None),
    ("patch", "/api/v1/projects/{project_id}", {"description": "mine now"}),
    ("post", "/api/v1/projects/{project_id}/archive", None),
    ("post", "/api/v1/projects/{project_id}/unarchive", None),
    ("get", "/api/v1/projects/{project_id}/members", None),
    ("post", "/api/v1/projects/{project_id}/members", {"email": "stranger@example.org"}),
    ("delete", "/api/v1/projects/{project_id}/members/{user_id}", None),
    ("get", "/api/v1/projects/{project_id}/code-versions", None),
    ("post", "/api/v1/projects/{project_id}/code-versions", {"example": "mnist_cnn"}),
    ("get", "/api/v1/projects/{project_id}/code-versions/{version_id}/files", None),
    ("get", "/api/v1/projects/{project_id}/code-versions/{version_id}/files/{path}", None),
    ("get", "/api/v1/tasks/{task_id}", None),
    ("patch", "/api/v1/tasks/{task_id}", {"priority": 5}),
    ("post", "/api/v1/tasks/{task_id}/cancel", None),
    ("post", "/api/v1/tasks/{task_id}/retry", None),
    ("get", "/api/v1/tasks/{task_id}/events", None),
    ("get", "/api/v1/tasks/{task_id}/allocations", None),
    ("get", "/api/v1/tasks/{task_id}/sub-tasks", None),
    ("get", "/api/v1/tasks/{task_id}/metrics", None),
    ("get", "/api/v1/tasks/{task_id}/logs", None),
    ("get", "/api/v1/tasks/{task_id}/logs/stream", None),
    ("get", "/api/v1/tasks/{task_id}/logs.txt", None),
    ("get", "/api/v1/tasks/{task_id}/checkpoints", None),
    ("get", "/api/v1/tasks/{task_id}/provenance", None),
    ("get", "/api/v1/tasks/{task_id}/throughput", None),
    ("get", "/api/v1/tasks/{task_id}/checkpoints/{checkpoint_id}/download", None),
]


def test_matrix_covers_every_project_scoped_endpoint(world: World) -> None:
    scoped = {(m, p) for m, p in _paths(world) if "{project_id}" in p or "{task_id}" in p}
    covered = {(m, p) for m, p, _ in PROJECT_SCOPED} | {
        ("post", "/api/v1/projects/{project_id}/code-versions/upload")
    }
    assert scoped <= covered, f"classify these endpoints in the matrix: {scoped - covered}"


def test_a_stranger_cannot_read_or_change_another_users_project(world: World) -> None:
    """Project, code, tasks, logs, metrics, checkpoints: 404 as if they did not exist."""
    answers = {}
    for method, path, body in PROJECT_SCOPED:
        response = world.client.request(
            method.upper(), _fill(path, world), headers=world.stranger.headers, json=body
        )
        answers[(method, path)] = (response.status_code, response.json()["error"]["code"])
    assert set(answers.values()) == {(404, "not_found")}, answers


def test_a_stranger_cannot_upload_code_or_submit_tasks(world: World) -> None:
    as_stranger = world.stranger.headers
    upload = world.client.post(
        f"/api/v1/projects/{world.project['id']}/code-versions/upload",
        headers=as_stranger,
        files={"file": ("t.py", b"x = 1")},
    )
    assert upload.status_code == 404
    submit = world.client.post(
        "/api/v1/tasks",
        headers=as_stranger,
        json={
            "project_id": world.project["id"],
            "code_version_id": world.version["id"],
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    )
    assert submit.status_code == 404
    assert submit.json()["error"]["field"] == "project_id"


def test_a_stranger_lists_nothing_of_the_owners(world: World) -> None:
    as_stranger = world.stranger.headers
    assert world.client.get("/api/v1/projects", headers=as_stranger).json() == []
    tasks = world.client.get("/api/v1/tasks", headers=as_stranger)
    assert tasks.json() == [] and tasks.headers["x-total-count"] == "0"
    assert (
        world.client.get(
            f"/api/v1/tasks?project_id={world.project['id']}", headers=as_stranger
        ).json()
        == []
    )


def test_a_stranger_may_reuse_the_owners_project_name(world: World) -> None:
    """Names are unique per owner: a taken name says nothing about other users' projects."""
    mine = world.client.post(
        "/api/v1/projects", headers=world.stranger.headers, json={"name": world.project["name"]}
    )
    assert mine.status_code == 201


def test_a_member_reads_and_submits_but_does_not_manage(world: World) -> None:
    as_member, pid = world.member.headers, world.project["id"]
    tid = world.task["id"]
    assert world.client.get(f"/api/v1/projects/{pid}", headers=as_member).status_code == 200
    logs = world.client.get(f"/api/v1/tasks/{tid}/logs", headers=as_member).json()
    assert [line["text"] for line in logs] == ["secret line"]
    blob = world.client.get(
        f"/api/v1/tasks/{tid}/checkpoints/{world.checkpoint['id']}/download", headers=as_member
    )
    assert blob.status_code == 200 and blob.content == b"weights"
    added = world.client.post(
        f"/api/v1/projects/{pid}/code-versions", headers=as_member, json={"example": "mnist_cnn"}
    )
    assert added.status_code == 201
    for method, path, body in [
        ("patch", f"/api/v1/projects/{pid}", {"name": "x"}),
        ("post", f"/api/v1/projects/{pid}/archive", None),
        ("post", f"/api/v1/projects/{pid}/members", {"email": "stranger@example.org"}),
    ]:
        refused = world.client.request(method.upper(), path, headers=as_member, json=body)
        assert refused.status_code == 403, (path, refused.text)
    assert world.client.post(f"/api/v1/tasks/{tid}/cancel", headers=as_member).status_code == 200


def test_the_owner_manages_and_an_admin_sees_everything(world: World) -> None:
    pid = world.project["id"]
    renamed = world.client.patch(
        f"/api/v1/projects/{pid}", headers=world.owner.headers, json={"description": "renamed"}
    )
    assert renamed.status_code == 200 and renamed.json()["description"] == "renamed"
    names = [
        p["name"] for p in world.client.get("/api/v1/projects", headers=world.admin.headers).json()
    ]
    assert "secret" in names
    assert (
        world.client.get(
            f"/api/v1/tasks/{world.task['id']}/logs", headers=world.admin.headers
        ).status_code
        == 200
    )


ADMIN_ONLY = [
    ("post", "/api/v1/resource-groups", {"name": "gpu-x", "device_type": "cuda", "capacity": 1}),
    ("patch", "/api/v1/resource-groups/cpu-a", {"capacity": 4}),
    ("patch", "/api/v1/resource-groups/cpu-a", {"state": "draining"}),
    ("delete", "/api/v1/resource-groups/cpu-a", None),
    ("get", "/api/v1/users", None),
    ("post", "/api/v1/users", {"email": "x@example.org", "password": "long enough"}),
    ("get", "/api/v1/users/{user_id}", None),
    ("patch", "/api/v1/users/{user_id}", {"role": "admin"}),
]


def test_only_admins_manage_groups_agents_and_users(world: World) -> None:
    for method, path, body in ADMIN_ONLY:
        for member in (world.owner, world.stranger):
            response = world.client.request(
                method.upper(), _fill(path, world), headers=member.headers, json=body
            )
            assert response.status_code == 403, (method, path, response.text)
            assert response.json()["error"]["code"] == "forbidden"
        allowed = world.client.request(
            method.upper(), _fill(path, world), headers=world.admin.headers, json=body
        )
        assert allowed.status_code < 400 or allowed.status_code == 409, allowed.text


def test_every_agent_and_group_write_is_admin_only(world: World) -> None:
    """Whatever writes the cluster routers gain, a member is refused them (router-wide rule)."""
    for method, path in _paths(world):
        if method == "get" or not path.startswith(("/api/v1/resource-groups", "/api/v1/agents")):
            continue
        response = world.client.request(
            method.upper(),
            _fill(path, world).replace("{agent_id}", "1"),
            headers=world.owner.headers,
            json={},
        )
        assert response.status_code == 403, (method, path, response.text)


def test_members_read_the_cluster(world: World) -> None:
    as_member = world.stranger.headers
    assert world.client.get("/api/v1/resource-groups", headers=as_member).status_code == 200
    assert world.client.get("/api/v1/agents", headers=as_member).status_code == 200


def test_sharing_with_an_unknown_email_answers_like_a_known_one(world: World) -> None:
    """No email enumeration: the status and body differ only by the email sent back."""
    url = f"/api/v1/projects/{world.project['id']}/members"
    known = world.client.post(
        url, headers=world.owner.headers, json={"email": world.stranger.email}
    )
    unknown = world.client.post(
        url, headers=world.owner.headers, json={"email": "nobody@example.org"}
    )
    again = world.client.post(
        url, headers=world.owner.headers, json={"email": world.stranger.email}
    )
    assert known.status_code == unknown.status_code == again.status_code == 202
    assert known.json() == again.json() == {**unknown.json(), "email": world.stranger.email}
    emails = [m["email"] for m in world.client.get(url, headers=world.owner.headers).json()]
    assert world.stranger.email in emails and "nobody@example.org" not in emails


def test_depends_on_another_users_task_answers_like_a_missing_one(world: World) -> None:
    """PATCH depends_on tells a member nothing about a task of a project they cannot see."""
    as_stranger = world.stranger.headers
    theirs = world.client.post(
        "/api/v1/projects", headers=as_stranger, json={"name": "hidden"}
    ).json()
    version = world.client.post(
        f"/api/v1/projects/{theirs['id']}/code-versions",
        headers=as_stranger,
        json={"example": "tiny_regression"},
    ).json()
    hidden = world.client.post(
        "/api/v1/tasks",
        headers=as_stranger,
        json={
            "project_id": theirs["id"],
            "code_version_id": version["id"],
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    ).json()
    world.client.post(f"/api/v1/tasks/{hidden['id']}/cancel", headers=as_stranger)
    missing_id = hidden["id"] + 1000

    def patch(dep: int) -> tuple[int, dict]:
        answer = world.client.patch(
            f"/api/v1/tasks/{world.task['id']}",
            headers=world.member.headers,
            json={"depends_on": [dep]},
        )
        return answer.status_code, answer.json()

    status, body = patch(hidden["id"])
    missing_status, missing_body = patch(missing_id)
    assert (status, body["error"]["code"], body["error"]["field"]) == (
        404,
        "not_found",
        "depends_on.0",
    )
    assert status == missing_status
    assert body == {
        "error": {
            **missing_body["error"],
            "message": missing_body["error"]["message"].replace(str(missing_id), str(hidden["id"])),
        }
    }
