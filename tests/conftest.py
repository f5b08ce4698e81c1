"""Shared fixtures: a migrated database per test, an API client, a live stack of processes."""

import functools
import json
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

from backend.core import config, db
from backend.core.migrate import upgrade
from tests import production
from worker.engine import prefork

TOKEN = "test-agent-token"

# Passwords hash with argon2id's least memory and one pass in the tests and the stacks they
# start (which inherit this environment): at RFC 9106's profile, the default, each hash or
# login costs 0.2 s of CPU, and the suite hashes over a thousand times. One test keeps the
# default (tests/backend/auth/test_password_hashing.py).
os.environ.setdefault("POLYTRAIN_PASSWORD_HASH_TIME_COST", "1")
os.environ.setdefault("POLYTRAIN_PASSWORD_HASH_MEMORY_KIB", "32")
# The stacks' agents look for a message on the embedded broker every 0.5 s, not 0.1 s: an
# idle agent spent 0.75 s of CPU in 30 s looking, 0.19 s at 0.5 s, and a run keeps about
# nine agents alive at once (tests/worker/agent/test_main.py checks the default).
os.environ.setdefault("POLYTRAIN_BROKER_POLL_S", "0.5")


def _clear_caches() -> None:
    config.get_settings.cache_clear()
    db.get_engine.cache_clear()
    db.get_sessionmaker.cache_clear()
    from backend.scheduler.dispatch import producer_app

    producer_app.cache_clear()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stack: also run on PostgreSQL + Redis when configured")
    # Ranks of tasks run on 127.0.0.1 (launch_local) fork from one interpreter that imported
    # torch once: a fresh one per rank spent about 3 s of CPU before training (2026-11-27: a
    # tiny two-epoch task took 14.8 s of CPU and 8 s, forked 1.5 s and 1.5 s). The agents'
    # ranks (end-to-end tests) still start as users' do, in sandboxed interpreters.
    # POLYTRAIN_TEST_PREFORK=0 starts a fresh interpreter per rank everywhere.
    if os.environ.get("POLYTRAIN_TEST_PREFORK", "1") != "0":
        prefork.enable()


def pytest_sessionstart(session: pytest.Session) -> None:
    """With the production stack configured, unreachable servers fail the run (no skip)."""
    if production.enabled() and (problem := production.check_reachable()):
        pytest.exit(f"production stack configured but not usable: {problem}", returncode=3)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _migrated_sqlite.cache_info().currsize:
        shutil.rmtree(_migrated_sqlite().parent, ignore_errors=True)
    if production.enabled():
        production.drop_template()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run `stack`-marked tests on every configured backend (`db_backend`);
    `stack(only="postgresql")` tests run on PostgreSQL alone (when configured)."""
    marker = metafunc.definition.get_closest_marker("stack")
    if "db_backend" in metafunc.fixturenames and marker:
        only = marker.kwargs.get("only")
        backends = [b for b in production.backends() if only in (None, b)]
        metafunc.parametrize("db_backend", backends, indirect=True)


@pytest.fixture
def db_backend(request: pytest.FixtureRequest) -> str:
    """`sqlite` (the embedded default) or `postgresql` (a `stack` test's second run)."""
    return str(getattr(request, "param", "sqlite"))


@functools.cache
def _migrated_sqlite() -> Path:
    """A SQLite database migrated to head once per run (Alembic's batch steps rebuild tables,
    about a second each time); every test gets a copy."""
    path = Path(tempfile.mkdtemp(prefix="polytrain-tpl-")) / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


def _copy_migrated_sqlite(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(_migrated_sqlite()) as source, sqlite3.connect(target) as copy:
        source.backup(copy)
    source.close()
    copy.close()


@pytest.fixture
def service_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_backend: str) -> Iterator[Path]:
    """Point the service at a fresh migrated database (SQLite under tmp_path, or a
    PostgreSQL database of its own) and a data dir under tmp_path."""
    monkeypatch.setenv("POLYTRAIN_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("POLYTRAIN_AGENT_TOKEN", TOKEN)
    for name in ("DATABASE_URL", "BROKER_URL", "POLYTRAIN_DATABASE_URL", "POLYTRAIN_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    url = production.fresh_database() if db_backend == "postgresql" else None
    if url:
        monkeypatch.setenv("DATABASE_URL", url)
    _clear_caches()
    if not url:
        _copy_migrated_sqlite(tmp_path / "var" / "polytrain.db")
    yield tmp_path / "var"
    db.get_engine().dispose()
    _clear_caches()
    if url:
        production.drop_database(url)


@pytest.fixture(scope="session")
def registry_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """uv's cache for this run's `registry` tests (never shared between runs), once the
    package index (`POLYTRAIN_INDEX_URL`, default PyPI) is known to answer.

    An index out of reach skips the tests that need it, with the reason; on CI (`CI` or
    `POLYTRAIN_CI` set, as `.ci/run` does) it fails them instead.
    """
    index_url = config.Settings().index_url  # type: ignore[call-arg]
    try:
        answer = httpx.get(f"{index_url.rstrip('/')}/pip/", timeout=10, follow_redirects=True)
        problem = f"HTTP {answer.status_code}" if answer.status_code >= 500 else None
    except httpx.HTTPError as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        reason = f"the package index {index_url} cannot be reached ({problem})"
        if os.environ.get("CI") or os.environ.get("POLYTRAIN_CI"):
            pytest.fail(f"{reason}: registry tests must run on CI", pytrace=False)
        pytest.skip(reason)
    return tmp_path_factory.mktemp("uv-cache")


@pytest.fixture
def registry(service_env: Path, registry_cache: Path) -> Path:
    """The service resolves requirements against the real package index, with uv's cache
    of this run (`registry_cache`) in place of its data dir's; tests marked `registry`."""
    (service_env / "uv-cache").symlink_to(registry_cache, target_is_directory=True)
    return registry_cache


@functools.cache
def _app_of(fingerprint: str) -> FastAPI:
    from backend.main import create_app

    return create_app(run_scheduler=False)


def served_app() -> FastAPI:
    """The app without its scheduler thread for the current settings, with new state
    (`backend.main.reset_state`).

    Building the app (FastAPI builds every route's validators) cost 0.27 s of CPU, and the
    `client` fixture serves hundreds of tests: one app serves every test whose settings are
    the same but for the data directory and database, which the app reads per request (the
    cache's key is every other setting, secrets included)."""
    from backend.main import reset_state

    settings = config.get_settings()
    shown = {
        name: value.get_secret_value() if isinstance(value, SecretStr) else value
        for name, value in settings
        if name not in ("data_dir", "database_url")
    }
    app = _app_of(json.dumps(shown, sort_keys=True, default=str))
    reset_state(app, settings)
    return app


@pytest.fixture
def client(service_env: Path) -> Iterator[TestClient]:
    """A client of the app without its scheduler thread, logged in as an admin: REST with
    the admin's API token, portal pages with the admin's session cookie
    (`client.account.csrf` is the session's CSRF token for forms)."""
    with TestClient(served_app()) as test_client:
        login_as(test_client, add_account(ADMIN_EMAIL, admin=True))
        yield test_client


@pytest.fixture
def session(service_env: Path) -> Iterator[db.Session]:
    with db.get_sessionmaker()() as s:
        yield s


ADMIN_EMAIL = "admin@example.org"
PASSWORD = "correct horse battery"


@dataclass(frozen=True)
class Account:
    """A user made for a test, with an API token and a logged-in web session."""

    id: int
    email: str
    token: str
    cookie: str
    csrf: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@functools.cache
def password_hash() -> str:
    """The argon2 hash of PASSWORD, computed once per run (hashing is slow on purpose)."""
    from backend.auth.security import hash_password

    return hash_password(PASSWORD)


def add_account(email: str, *, admin: bool = False) -> Account:
    """Create a user (password PASSWORD) with an API token and a web session."""
    from backend.auth import tokens
    from backend.auth.models import User, UserRole

    with db.get_sessionmaker()() as s:
        user = User(
            email=email,
            password_hash=password_hash(),
            role=UserRole.ADMIN if admin else UserRole.MEMBER,
        )
        s.add(user)
        s.commit()
        _, token = tokens.issue(s, user=user, name="test", expires_in_days=None)
        web, cookie = tokens.start_session(s, user=user)
        return Account(user.id, email, token, cookie, web.csrf_token)


def login_as(test_client: TestClient, account: Account) -> TestClient:
    """Make `test_client` act as `account` on REST and on portal pages."""
    from backend.auth.dependencies import SESSION_COOKIE

    test_client.headers["Authorization"] = f"Bearer {account.token}"
    test_client.cookies.set(SESSION_COOKIE, account.cookie)
    test_client.account = account  # type: ignore[attr-defined]
    return test_client


def with_csrf(test_client: TestClient, data: dict) -> dict:
    """A portal form's data with the session's CSRF token added."""
    return {**data, "csrf_token": test_client.account.csrf}  # type: ignore[attr-defined]


def make_group(
    client: TestClient, name: str = "cpu-a", capacity: int = 2, device_type: str = "cpu"
) -> dict:
    response = client.post(
        "/api/v1/resource-groups",
        json={"name": name, "device_type": device_type, "capacity": capacity},
    )
    assert response.status_code == 201, response.text
    return response.json()


def task_request(version: dict, **overrides: object) -> dict:
    """A `POST /api/v1/tasks` body for code `version` across cpu-a ×2 and cpu-b ×1, 2 epochs of
    global batch 32; `overrides` replace or add fields."""
    return {
        "project_id": version["project_id"],
        "code_version_id": version["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        "epochs": 2,
        "global_batch_size": 32,
        **overrides,
    }


def make_project(
    client: TestClient, name: str = "mnist", example: str = "mnist_cnn"
) -> tuple[dict, dict]:
    project = client.post("/api/v1/projects", json={"name": name})
    assert project.status_code == 201, project.text
    version = client.post(
        f"/api/v1/projects/{project.json()['id']}/code-versions", json={"example": example}
    )
    assert version.status_code == 201, version.text
    return project.json(), version.json()


def agent_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def register_agent(
    client: TestClient,
    group: str,
    hardware: dict,
    *,
    name: str = "a1",
    workers: int = 2,
    host: str = "10.77.0.3",
) -> httpx.Response:
    """The internal API's answer to agent `name` on `host` registering with `group`."""
    return client.post(
        "/internal/v1/agents/register",
        headers=agent_headers(),
        json={
            "name": name,
            "host": host,
            "resource_group": group,
            "workers": workers,
            "hardware": hardware,
        },
    )


os.environ.setdefault("POLYTRAIN_AGENT_TOKEN", TOKEN)
