"""The audit log: every write through REST or the portal, allowed or refused, gives exactly
one event naming its actor, action, object and outcome; so does every refused read, and
allowed reads give none; only admins read it.

The endpoints are those of the authorization matrix (tests/backend/auth/test_authz.py), each tried
by everyone from an anonymous caller to an admin, so refusals (401, 404, 403) and allowed
writes are all covered.
"""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from backend.audit.models import AuditEvent
from backend.auth.models import ApiToken
from backend.core.db import get_sessionmaker, utcnow
from tests.backend.auth.test_authz import ADMIN_ONLY, PROJECT_SCOPED, _fill
from tests.backend.conftest import World
from tests.conftest import Account, agent_headers, with_csrf

pytestmark = pytest.mark.stack

WRITES = [(m, p, body) for m, p, body in PROJECT_SCOPED + ADMIN_ONLY if m != "get"]
READS = [p for m, p, _ in PROJECT_SCOPED + ADMIN_ONLY if m == "get"]

# What each write of the matrix is called in the log, and the object it names: a path
# parameter, or None. A create names the created object when it succeeds (CREATED).
EXPECTED: dict[tuple[str, str], tuple[str, str | None, str | None]] = {
    ("patch", "/api/v1/projects/{project_id}"): ("project.update", "project", "{project_id}"),
    ("post", "/api/v1/projects/{project_id}/archive"): (
        "project.archive",
        "project",
        "{project_id}",
    ),
    ("post", "/api/v1/projects/{project_id}/unarchive"): (
        "project.unarchive",
        "project",
        "{project_id}",
    ),
    ("post", "/api/v1/projects/{project_id}/members"): ("member.create", "project", "{project_id}"),
    ("delete", "/api/v1/projects/{project_id}/members/{user_id}"): (
        "member.delete",
        "user",
        "{user_id}",
    ),
    ("post", "/api/v1/projects/{project_id}/code-versions"): (
        "code_version.create",
        "project",
        "{project_id}",
    ),
    ("patch", "/api/v1/tasks/{task_id}"): ("task.update", "task", "{task_id}"),
    ("post", "/api/v1/tasks/{task_id}/cancel"): ("task.cancel", "task", "{task_id}"),
    ("post", "/api/v1/tasks/{task_id}/retry"): ("task.retry", "task", "{task_id}"),
    ("post", "/api/v1/resource-groups"): ("resource_group.create", None, None),
    ("patch", "/api/v1/resource-groups/cpu-a"): (
        "resource_group.update",
        "resource_group",
        "cpu-a",
    ),
    ("delete", "/api/v1/resource-groups/cpu-a"): (
        "resource_group.delete",
        "resource_group",
        "cpu-a",
    ),
    ("post", "/api/v1/users"): ("user.create", None, None),
    ("patch", "/api/v1/users/{user_id}"): ("user.update", "user", "{user_id}"),
}
# The matrix names the owner as the member to remove, who is none: refused for everyone
# (test_uploads_submissions_and_logins_are_recorded removes a real member).
ONLY_REFUSED = {("delete", "/api/v1/projects/{project_id}/members/{user_id}")}
# Retrying needs an ended task, and a group is deleted only when no task holds it.
END_THE_TASK_FIRST = {
    ("post", "/api/v1/tasks/{task_id}/retry"),
    ("delete", "/api/v1/resource-groups/cpu-a"),
}
CREATED = {
    "code_version.create": ("code_version", "id"),
    "resource_group.create": ("resource_group", "name"),
    "user.create": ("user", "id"),
}


def last_id() -> int:
    with get_sessionmaker()() as session:
        return session.scalar(select(func.max(AuditEvent.id))) or 0


def events_after(event_id: int) -> list[AuditEvent]:
    with get_sessionmaker()() as session:
        return list(
            session.scalars(
                select(AuditEvent).where(AuditEvent.id > event_id).order_by(AuditEvent.id)
            )
        )


def token_id(account: Account) -> int:
    """The id of the API token the test account sends (named `test` by `add_account`)."""
    with get_sessionmaker()() as session:
        found = session.scalar(
            select(ApiToken.id).where(ApiToken.user_id == account.id, ApiToken.name == "test")
        )
    assert found is not None
    return found


def expected_object(
    action: str, obj: tuple[str | None, str | None], answer: Any, world: World
) -> tuple[str | None, str | None]:
    if action in CREATED and answer.status_code == 201:
        kind, key = CREATED[action]
        return kind, str(answer.json()[key])
    kind, template = obj
    return kind, _fill(template, world) if template else None


@pytest.mark.parametrize(
    ("method", "path", "body"), WRITES, ids=[f"{m} {p} {b}" for m, p, b in WRITES]
)
def test_each_write_gives_exactly_one_event(
    world: World, method: str, path: str, body: dict | None
) -> None:
    """Tried by anonymous, stranger, member, owner and admin in turn: one event per request,
    with the caller, the action, the object, the status and whether it was refused."""
    action, *obj = EXPECTED[(method, path)]
    if (method, path) in END_THE_TASK_FIRST:
        world.client.post(f"/api/v1/tasks/{world.task['id']}/cancel").raise_for_status()
    callers = [None, world.stranger, world.member, world.owner, world.admin]
    outcomes = set()
    for caller in callers:
        before = last_id()
        sender = world.anonymous if caller is None else world.client
        answer = sender.request(
            method.upper(), _fill(path, world), json=body, headers=caller.headers if caller else {}
        )
        events = events_after(before)
        assert len(events) == 1, (caller, answer.status_code, events)
        event = events[0]
        refused = answer.status_code >= 400
        outcomes.add(refused)
        assert (event.actor_user_id, event.actor_token_id) == (
            (caller.id, token_id(caller)) if caller else (None, None)
        )
        assert event.action == action
        assert (event.object_type, event.object_id) == expected_object(
            action, (obj[0], obj[1]), answer, world
        )
        assert event.status_code == answer.status_code
        assert event.outcome.value == ("refused" if refused else "ok")
        assert (event.method, event.path) == (method.upper(), _fill(path, world))
        assert event.client_address == "testclient"
        assert event.request_id == answer.headers["x-request-id"]
    # each endpoint was both refused and allowed
    assert outcomes == ({True} if (method, path) in ONLY_REFUSED else {True, False})


def test_allowed_reads_and_agent_telemetry_give_no_event(world: World) -> None:
    before = last_id()
    for path in READS:
        if not path.endswith("/stream"):  # the owner's stream lasts as long as the task
            assert world.client.get(_fill(path, world)).status_code == 200, path
    world.client.get("/api/v1/audit")
    assert world.client.get("/api/v1/audit", params={"limit": 0}).status_code == 422
    world.client.post(
        f"/internal/v1/tasks/{world.task['id']}/logs",
        headers=agent_headers(),
        json={
            "lines": [{"node": "rank-1", "seq": 1, "time": "2026-01-01T00:00:01", "text": "more"}]
        },
    ).raise_for_status()
    world.client.post(
        f"/internal/v1/tasks/{world.task['id']}/logs",
        headers=world.stranger.headers,
        json={"lines": []},
    )
    assert events_after(before) == []


def _read_object(path: str, world: World) -> tuple[str | None, str | None]:
    for param, kind in (
        ("{checkpoint_id}", "checkpoint"),
        ("{version_id}", "code_version"),
        ("{task_id}", "task"),
        ("{user_id}", "user"),
        ("{project_id}", "project"),
    ):
        if param in path:
            return kind, _fill(param, world)
    return None, None  # a list


def test_each_refused_read_gives_one_event(world: World) -> None:
    """Reads are recorded when refused: another user's project (404), an admin's list (403),
    no login (401), the audit log itself for a member (403)."""
    for path in READS:
        before = last_id()
        answer = world.client.get(_fill(path, world), headers=world.stranger.headers)
        [event] = events_after(before)
        assert answer.status_code in (403, 404), path
        assert (event.actor_user_id, event.status_code, event.outcome.value) == (
            world.stranger.id,
            answer.status_code,
            "refused",
        )
        assert (event.object_type, event.object_id) == _read_object(path, world)
    before = last_id()
    world.anonymous.get("/api/v1/tasks")
    world.client.get("/api/v1/users", headers=world.member.headers)
    world.client.get("/api/v1/audit", headers=world.owner.headers)
    world.client.get(
        f"/api/v1/tasks/{world.task['id']}/logs/stream", headers=world.stranger.headers
    )
    assert [(e.action, e.actor_user_id, e.status_code) for e in events_after(before)] == [
        ("task.list", None, 401),
        ("user.list", world.member.id, 403),
        ("audit.list", world.owner.id, 403),
        ("log.stream", world.stranger.id, 404),
    ]


def test_uploads_submissions_and_logins_are_recorded(world: World) -> None:
    pid, as_owner = world.project["id"], world.owner.headers
    before = last_id()
    upload = world.client.post(
        f"/api/v1/projects/{pid}/code-versions/upload",
        headers=as_owner,
        files={"file": ("t.py", b"x = 1")},
    )
    submitted = world.client.post(
        "/api/v1/tasks",
        headers=as_owner,
        json={
            "project_id": pid,
            "code_version_id": world.version["id"],
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    )
    assert submitted.status_code == 201, submitted.text
    login = world.anonymous.post(
        "/api/v1/auth/login", json={"email": world.owner.email, "password": "correct horse battery"}
    )
    wrong = world.anonymous.post(
        "/api/v1/auth/login", json={"email": world.owner.email, "password": "wrong password!"}
    )
    assert (login.status_code, wrong.status_code) == (201, 401)
    world.client.delete(
        f"/api/v1/projects/{pid}/members/{world.member.id}", headers=as_owner
    ).raise_for_status()
    rows = [
        (e.action, e.object_type, e.object_id, e.actor_user_id, e.outcome.value)
        for e in events_after(before)
    ]
    assert rows == [
        (
            "code_version.create",
            *(
                ("code_version", str(upload.json()["id"]))
                if upload.status_code == 201
                else ("project", str(pid))
            ),
            world.owner.id,
            "ok" if upload.status_code < 400 else "refused",
        ),
        ("task.create", "task", str(submitted.json()["id"]), world.owner.id, "ok"),
        ("auth.login", None, None, world.owner.id, "ok"),
        ("auth.login", None, None, None, "refused"),
        ("member.delete", "user", str(world.member.id), world.owner.id, "ok"),
    ]


def test_unknown_routes_and_methods_are_recorded_as_refused(client: TestClient) -> None:
    before = last_id()
    assert client.post("/api/v1/nothing-here").status_code == 404
    assert client.put("/api/v1/projects").status_code == 405
    assert [(e.action, e.status_code, e.outcome.value) for e in events_after(before)] == [
        ("unknown", 404, "refused"),
        ("unknown", 405, "refused"),
    ]


def test_refusals_of_the_outer_layers_are_recorded_with_the_proxied_address(
    service_env: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a trusted proxy the client is the forwarded address; a body over the limit
    (413, refused before routing: `unknown`, with its path) and a rate-limited login (429)
    are events too."""
    from backend.core import config
    from backend.main import create_app

    for key, value in {
        "FORWARDED_ALLOW_IPS": "testclient",
        "MAX_BODY_BYTES": "2048",
        "MAX_UPLOAD_BYTES": "1024",
        "LOGIN_RATE_PER_ADDRESS": "1/minute",
    }.items():
        monkeypatch.setenv(f"POLYTRAIN_{key}", value)
    config.get_settings.cache_clear()
    proxied = {"X-Forwarded-For": "203.0.113.9"}
    with TestClient(create_app(run_scheduler=False)) as app:
        before = last_id()
        big = app.post("/api/v1/projects", content=b"x" * 128 * 1024, headers=proxied)
        logins = [
            app.post(
                "/api/v1/auth/login",
                headers=proxied,
                json={"email": "nobody@example.org", "password": "guess guess"},
            ).status_code
            for _ in range(2)
        ]
    assert (big.status_code, logins) == (413, [401, 429])
    assert [
        (e.action, e.status_code, e.outcome.value, e.client_address) for e in events_after(before)
    ] == [
        ("unknown", 413, "refused", "203.0.113.9"),  # refused before routing
        ("auth.login", 401, "refused", "203.0.113.9"),
        ("auth.login", 429, "refused", "203.0.113.9"),
    ]


def test_a_nul_in_the_path_does_not_escape_the_log(client: TestClient) -> None:
    """PostgreSQL refuses NUL in text: the event keeps the path with the NUL replaced."""
    before = last_id()
    answers = [
        client.post("/api/v1/projects/%00/archive").status_code,
        client.delete("/api/v1/resource-groups/a%00b").status_code,
    ]
    events = events_after(before)
    assert [(e.path, e.object_id, e.status_code) for e in events] == [
        ("/api/v1/projects/\ufffd/archive", "\ufffd", answers[0]),
        ("/api/v1/resource-groups/a\ufffdb", "a\ufffdb", answers[1]),
    ]
    assert all(400 <= status < 500 for status in answers)


def test_members_cannot_read_the_audit_log(world: World) -> None:
    for member in (world.owner, world.member, world.stranger):
        refused = world.client.get("/api/v1/audit", headers=member.headers)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
    assert world.anonymous.get("/api/v1/audit").status_code == 401
    assert world.client.get("/api/v1/audit").status_code == 200


def _listed(client: TestClient, **params: Any) -> list[dict]:
    answer = client.get("/api/v1/audit", params=params)
    assert answer.status_code == 200, answer.text
    assert int(answer.headers["x-total-count"]) >= len(answer.json())
    return list(answer.json())


def test_filters_narrow_the_log(world: World) -> None:
    pid, tid = world.project["id"], world.task["id"]
    start = utcnow().isoformat()
    world.client.post(f"/api/v1/projects/{pid}/archive", headers=world.member.headers)  # 403
    world.client.patch(
        f"/api/v1/projects/{pid}", headers=world.owner.headers, json={"description": "audited"}
    )
    world.client.post(
        f"/api/v1/tasks/{tid}/cancel", headers={**world.owner.headers, "X-Request-ID": "req-42"}
    )

    refused = _listed(world.client, outcome="refused", object_type="project", object_id=str(pid))
    assert [(e["action"], e["status_code"], e["actor_user_id"]) for e in refused] == [
        ("project.archive", 403, world.member.id)
    ]
    mine = _listed(world.client, actor_user_id=world.owner.id, since=start)
    assert [e["action"] for e in mine] == ["task.cancel", "project.update"]  # newest first
    assert (
        _listed(world.client, actor_token_id=token_id(world.member), since=start)[0]["action"]
        == "project.archive"
    )
    assert [e["action"] for e in _listed(world.client, action="project.*", since=start)] == [
        "project.update",
        "project.archive",
    ]
    assert [e["object_id"] for e in _listed(world.client, action="task.cancel")] == [str(tid)]
    assert _listed(world.client, request_id="req-42")[0]["action"] == "task.cancel"
    assert _listed(world.client, status_code=403, since=start)[0]["action"] == "project.archive"
    assert _listed(world.client, client_address="elsewhere") == []
    assert _listed(world.client, until=start, action="task.cancel") == []
    page = world.client.get("/api/v1/audit", params={"since": start, "limit": 1, "offset": 1})
    assert page.headers["x-total-count"] == "3"
    assert [e["action"] for e in page.json()] == ["project.update"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"outcome": "maybe"}, "outcome"),
        ({"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until"),
        ({"since": "yesterday"}, "since"),
        ({"limit": 0}, "limit"),
    ],
)
def test_bad_filters_are_refused_naming_the_field(
    client: TestClient, params: dict, field: str
) -> None:
    answer = client.get("/api/v1/audit", params=params)
    assert answer.status_code == 422
    assert answer.json()["error"]["field"] == field


def test_a_callers_request_id_is_kept_and_a_bad_one_replaced(client: TestClient) -> None:
    kept = client.post("/api/v1/projects", json={"name": "a"}, headers={"X-Request-ID": "abc-1"})
    replaced = client.post(
        "/api/v1/projects", json={"name": "b"}, headers={"X-Request-ID": "not a token\t"}
    )
    assert kept.headers["x-request-id"] == "abc-1"
    fresh = replaced.headers["x-request-id"]
    assert len(fresh) == 32 and fresh != "abc-1"
    assert [e["request_id"] for e in _listed(client, action="project.create")] == [fresh, "abc-1"]


def test_portal_forms_are_recorded_with_the_session_user(world: World) -> None:
    """A portal form: the user, no token; refusals of the CSRF check and of a missing
    session too (the latter a redirect to the login page)."""
    portal = TestClient(world.client.app, follow_redirects=False)
    portal.cookies.set("polytrain_session", world.owner.cookie)
    before = last_id()
    created = portal.post("/projects", data={"name": "from-form", "csrf_token": world.owner.csrf})
    forged = portal.post("/projects", data={"name": "forged", "csrf_token": "wrong"})
    anonymous = TestClient(world.client.app, follow_redirects=False).post(
        "/projects", data={"name": "nobody"}
    )
    assert (created.status_code, forged.status_code, anonymous.status_code) == (303, 403, 303)
    new_id = created.headers["location"].rsplit("/", 1)[1]
    rows = [
        (
            e.actor_user_id,
            e.actor_token_id,
            e.action,
            e.object_type,
            e.object_id,
            e.status_code,
            e.outcome.value,
        )
        for e in events_after(before)
    ]
    assert rows == [
        (world.owner.id, None, "project.create", "project", new_id, 303, "ok"),
        (world.owner.id, None, "project.create", None, None, 403, "refused"),
        (None, None, "project.create", None, None, 303, "refused"),
    ]


def test_a_cookie_call_without_its_csrf_header_names_its_actor(world: World) -> None:
    """The portal's scripts call REST with the session cookie; the CSRF refusal is the user's."""
    browser = TestClient(world.client.app)
    browser.cookies.set("polytrain_session", world.member.cookie)
    before = last_id()
    assert browser.post("/api/v1/projects", json={"name": "x"}).status_code == 403
    assert (
        browser.post(
            "/api/v1/projects", json={"name": "x"}, headers={"X-CSRF-Token": world.member.csrf}
        ).status_code
        == 201
    )
    assert [(e.actor_user_id, e.actor_token_id, e.status_code) for e in events_after(before)] == [
        (world.member.id, None, 403),
        (world.member.id, None, 201),
    ]


def test_a_portal_refusal_shown_as_a_flash_is_refused(world: World) -> None:
    """Cancelling a task that has ended redirects back with an error message: refused."""
    tid = world.task["id"]
    world.client.post(f"/api/v1/tasks/{tid}/cancel").raise_for_status()
    before = last_id()
    again = world.client.post(
        f"/tasks/{tid}/cancel", data=with_csrf(world.client, {}), follow_redirects=False
    )
    assert again.status_code == 303
    [event] = events_after(before)
    assert (event.action, event.object_id, event.outcome.value) == (
        "task.cancel",
        str(tid),
        "refused",
    )


def test_a_request_that_crashes_is_recorded_once_as_failed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backend.projects import service as projects

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(projects, "create", crash)
    before = last_id()
    plain = TestClient(world.client.app, raise_server_exceptions=False)
    answer = plain.post("/api/v1/projects", json={"name": "boom"}, headers=world.owner.headers)
    assert answer.status_code == 500
    assert [
        (e.action, e.actor_user_id, e.status_code, e.outcome.value) for e in events_after(before)
    ] == [("project.create", world.owner.id, 500, "failed")]


def test_a_failed_audit_write_is_logged_and_the_answer_kept(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from backend.audit import service

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("database gone")

    monkeypatch.setattr(service, "record", broken)
    answer = client.post("/api/v1/projects", json={"name": "kept"})
    assert answer.status_code == 201
    assert client.get(f"/api/v1/projects/{answer.json()['id']}").status_code == 200
    logged = [r for r in caplog.records if "AUDIT EVENT NOT RECORDED" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelname == "ERROR"
    assert '"action":"project.create"' in logged[0].getMessage()
