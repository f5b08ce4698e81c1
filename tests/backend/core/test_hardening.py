"""Bodies and headers: a body limit enforced before the body is read, security headers on
portal pages, what the OpenAPI document shows, private file modes, HTML or JSON errors."""

import asyncio
import sqlite3
import stat
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from tests.conftest import TOKEN, add_account

MB = 1024 * 1024


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_declared_huge_body_is_refused_before_any_of_it_is_read(client: TestClient) -> None:
    """200 MB declared on the login route: 413 at once, not one chunk taken from the body."""
    taken = 0

    def body():  # type: ignore[no-untyped-def]
        nonlocal taken
        for _ in range(200):
            taken += 1
            yield b"x" * MB

    answer = client.post(
        "/api/v1/auth/login",
        content=body(),
        headers={"Content-Length": str(200 * MB), "Content-Type": "application/json"},
    )
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "too_large"
    assert taken == 0


def _stream_to_app(
    app,
    path: str,
    chunks: int,
    chunk: bytes,  # type: ignore[no-untyped-def]
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> tuple[int, int]:
    """Send a body without Content-Length in `chunks` pieces straight to the ASGI app, as a
    chunked upload arrives; (status answered, pieces the app took)."""
    taken, status = 0, 0

    async def receive() -> dict:
        nonlocal taken
        taken += 1
        return {"type": "http.request", "body": chunk, "more_body": taken < chunks}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path.partition("?")[0],
        "raw_path": path.partition("?")[0].encode(),
        "root_path": "",
        "query_string": path.partition("?")[2].encode(),
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"transfer-encoding", b"chunked"),
            *headers,
        ],
    }
    asyncio.run(app(scope, receive, send))
    return status, taken


def test_a_streamed_body_is_cut_off_once_it_passes_the_limit(client: TestClient) -> None:
    """A chunked 200 MB login body: refused after about the 2 MiB limit, not read whole."""
    status, taken = _stream_to_app(client.app, "/api/v1/auth/login", 200, b"x" * MB)
    assert status == 413
    assert taken <= 3  # 2 MiB limit + 64 KiB upload allowance: the third chunk passes it


def test_the_internal_api_has_its_own_body_limit(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from backend.core import config
    from backend.main import create_app

    monkeypatch.setenv("POLYTRAIN_MAX_INTERNAL_BODY_BYTES", str(4 * MB))
    config.get_settings.cache_clear()
    app = create_app(run_scheduler=False)
    agent = ((b"authorization", f"Bearer {TOKEN}".encode()),)
    url = "/internal/v1/tasks/999/checkpoints?name=a.pt&epoch=0&step=0"
    assert _stream_to_app(app, url, 5, b"x" * MB, agent)[0] == 413
    # 3 MiB passes the limit there and is read whole (then: no task 999)
    assert _stream_to_app(app, url, 3, b"x" * MB, agent) == (404, 3)


def test_portal_pages_carry_the_security_headers(client: TestClient) -> None:
    for url in ("/login", "/", "/account", "/resource-groups"):
        page = client.get(url)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, url
        assert "unsafe-inline" not in csp
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["referrer-policy"] == "same-origin"
        assert page.headers["cache-control"] == "no-store"
    api = client.get("/api/v1/projects")
    assert api.headers["x-content-type-options"] == "nosniff"


def test_templates_hold_no_inline_script_style_or_handler() -> None:
    """What the CSP would block: inline <script>, <style>, style="..." and on...= handlers."""
    import re

    from backend.web.templating import TEMPLATE_DIR

    inline = re.compile(r"<script(?![^>]*\bsrc=)|<style|\sstyle=|\son[a-z]+=", re.IGNORECASE)
    offenders = {p.name: inline.findall(p.read_text()) for p in TEMPLATE_DIR.glob("*.html")}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_session_cookies_are_secure_when_told(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from backend.core import config
    from backend.main import create_app
    from tests.backend.web.dom import parse
    from tests.conftest import PASSWORD

    monkeypatch.setenv("POLYTRAIN_COOKIE_SECURE", "true")
    config.get_settings.cache_clear()
    with TestClient(create_app(run_scheduler=False)) as app:
        add_account("ada@example.org")
        form = app.get("/login")
        assert "secure" in form.headers["set-cookie"].lower()
        csrf = parse(form.text).find("input", name="csrf_token").attrs["value"]
        app.cookies.set("polytrain_login_csrf", csrf)  # the test client keeps no Secure cookie
        done = app.post(
            "/login",
            follow_redirects=False,
            data={"email": "ada@example.org", "password": PASSWORD, "csrf_token": csrf},
        )
        assert done.status_code == 303
        session_cookie = [
            c for c in done.headers.get_list("set-cookie") if c.startswith("polytrain_session=")
        ]
        assert session_cookie and "secure" in session_cookie[0].lower()


def test_forwarded_headers_are_trusted_only_from_the_configured_proxies(  # type: ignore[no-untyped-def]
    service_env, monkeypatch
) -> None:
    from backend.core import config
    from backend.main import create_app

    monkeypatch.setenv("POLYTRAIN_FORWARDED_ALLOW_IPS", "testclient")
    config.get_settings.cache_clear()
    with TestClient(create_app(run_scheduler=False)) as app:
        page = app.get("/login", headers={"X-Forwarded-Proto": "https"})
        assert "secure" in page.headers["set-cookie"].lower()  # the proxy said HTTPS
    monkeypatch.delenv("POLYTRAIN_FORWARDED_ALLOW_IPS")
    config.get_settings.cache_clear()
    with TestClient(create_app(run_scheduler=False)) as app:
        page = app.get("/login", headers={"X-Forwarded-Proto": "https"})
        assert "secure" not in page.headers["set-cookie"].lower()  # nobody is trusted


def test_the_openapi_document_leaves_out_the_internal_api(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert any(p.startswith("/api/v1/") for p in paths)
    assert not [p for p in paths if p.startswith("/internal")]
    assert client.get("/docs").status_code == 200


def test_docs_can_be_turned_off(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from backend.core import config
    from backend.main import create_app

    monkeypatch.setenv("POLYTRAIN_DOCS_ENABLED", "false")
    config.get_settings.cache_clear()
    with TestClient(create_app(run_scheduler=False)) as app:
        for url in ("/docs", "/redoc", "/openapi.json"):
            assert app.get(url).status_code == 404, url
        assert app.get("/api/v1/health").status_code == 200


def test_the_data_dir_and_its_files_are_private(client: TestClient, service_env: Path) -> None:
    from backend.core.config import get_settings

    project = client.post("/api/v1/projects", json={"name": "p"}).json()
    module = (Path(__file__).parents[3] / "examples" / "tiny_regression.py").read_bytes()
    client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", module)},
    ).raise_for_status()
    settings = get_settings()
    assert _mode(settings.data_dir) == 0o700
    database = settings.data_dir / "polytrain.db"
    assert _mode(database) == 0o600
    code = list(settings.code_dir.iterdir())
    assert code and all(_mode(p) == 0o600 for p in code)


def test_the_first_admin_password_file_is_private(tmp_path: Path) -> None:
    from polytrain.stack import LocalStack

    stack = LocalStack(data_dir=tmp_path / "var" / "up", port=1, groups=[])
    stack._remembered_password()
    assert _mode(stack.data_dir) == 0o700
    assert _mode(stack.data_dir / "admin-password") == 0o600


@pytest.mark.parametrize("url", ["/no/such/page", "/projects/999999/nothing"])
def test_an_unknown_page_is_html_and_an_unknown_api_path_is_json(
    client: TestClient, url: str
) -> None:
    page = client.get(url)
    assert page.status_code == 404 and page.headers["content-type"].startswith("text/html")
    assert "Not found" in page.text and "content-security-policy" in page.headers
    api = client.get("/api/v1" + url)
    assert api.status_code == 404 and api.json()["error"]["code"] == "http_error"


def test_an_unexpected_failure_is_html_on_pages_and_json_on_the_api(  # type: ignore[no-untyped-def]
    client: TestClient, monkeypatch
) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("boom")

    quiet = TestClient(client.app, raise_server_exceptions=False)
    quiet.headers.update(client.headers)
    quiet.cookies = client.cookies
    monkeypatch.setattr("backend.auth.tokens.list_for", broken)
    page = quiet.get("/account")
    assert page.status_code == 500 and page.headers["content-type"].startswith("text/html")
    assert "boom" not in page.text and "internal error" in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    api = quiet.get("/api/v1/users/me/tokens")
    assert api.status_code == 500
    assert api.json() == {
        "error": {"code": "internal", "message": "internal error; it has been logged"}
    }


def test_the_internal_limit_needs_the_agent_token(client: TestClient) -> None:
    """Without the agent token an internal request gets the public limit: a 500 MB body is
    refused by its Content-Length before FastAPI reads it (which it does before the
    route's token check), and a streamed one is cut off after about 2 MiB."""
    status, taken = _stream_to_app(client.app, "/internal/v1/agents/register", 200, b"x" * MB)
    assert status == 413
    assert taken <= 3
    declared = client.post(
        "/internal/v1/agents/register", headers={"Content-Length": str(500 * MB)}, content=b""
    )
    assert declared.status_code == 413


def test_a_database_that_cannot_be_reached_is_a_503_to_retry_not_a_500(  # type: ignore[no-untyped-def]
    client: TestClient, monkeypatch, caplog
) -> None:
    """While PostgreSQL restarts every request fails to connect: each is answered 503 with
    Retry-After (the agent's client and a user's script retry a 5xx) and logged in one line,
    where it was a 500 and a logged traceback apiece."""

    def down(*_: object, **__: object) -> None:
        refused = psycopg.OperationalError("connection failed: connection refused\nrunning?")
        raise OperationalError("SELECT 1", {}, refused)

    quiet = TestClient(client.app, raise_server_exceptions=False)
    quiet.headers.update(client.headers)
    quiet.cookies = client.cookies
    monkeypatch.setattr("backend.auth.tokens.list_for", down)
    api = quiet.get("/api/v1/users/me/tokens")
    assert api.status_code == 503 and api.headers["retry-after"] == "5"
    assert api.json()["error"]["code"] == "database_unavailable"
    assert "try again" in api.json()["error"]["message"]
    page = quiet.get("/account")
    assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
    assert "try again" in page.text and page.headers["retry-after"] == "5"
    warned = [r for r in caplog.records if "database unavailable" in r.getMessage()]
    assert len(warned) == 2 and all(r.exc_info is None for r in warned)


def test_a_database_error_a_retry_would_meet_again_stays_a_logged_500(  # type: ignore[no-untyped-def]
    client: TestClient, monkeypatch, caplog
) -> None:
    def missing(*_: object, **__: object) -> None:
        raise OperationalError("SELECT 1", {}, sqlite3.OperationalError("no such table: x"))

    quiet = TestClient(client.app, raise_server_exceptions=False)
    quiet.headers.update(client.headers)
    monkeypatch.setattr("backend.auth.tokens.list_for", missing)
    api = quiet.get("/api/v1/users/me/tokens")
    assert api.status_code == 500 and api.json()["error"]["code"] == "internal"
    assert any(r.exc_info for r in caplog.records if r.getMessage() == "database error")


@pytest.mark.parametrize(
    ("orig", "unreachable"),
    [
        (psycopg.OperationalError("connection failed: connection refused"), True),
        (psycopg.OperationalError("consuming input failed: server closed the connection"), True),
        (psycopg.errors.AdminShutdown("terminating connection"), True),
        (psycopg.errors.CannotConnectNow("the database system is starting up"), True),
        (psycopg.errors.DiskFull("could not extend file"), False),
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), False),
        (psycopg.OperationalError("number of parameters must be between 0 and 65535"), False),
        (sqlite3.OperationalError("database is locked"), True),
        (sqlite3.OperationalError("no such table: sub_task"), False),
    ],
)
def test_only_an_unreachable_database_is_worth_a_retry(orig: Exception, unreachable: bool) -> None:
    from backend.core.errors import database_unreachable

    assert database_unreachable(OperationalError("SELECT 1", {}, orig)) is unreachable
