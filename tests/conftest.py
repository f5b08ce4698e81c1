"""Shared fixtures: a migrated database per test, an API client, a live stack of processes."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.core import config, db
from backend.core.migrate import upgrade

TOKEN = "test-agent-token"


def _clear_caches() -> None:
    config.get_settings.cache_clear()
    db.get_engine.cache_clear()
    db.get_sessionmaker.cache_clear()
    from backend.scheduler.dispatch import producer_app

    producer_app.cache_clear()


@pytest.fixture
def service_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point the service at a fresh SQLite database and data dir under tmp_path, migrated."""
    monkeypatch.setenv("POLYTRAIN_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("POLYTRAIN_AGENT_TOKEN", TOKEN)
    for name in ("DATABASE_URL", "BROKER_URL", "POLYTRAIN_DATABASE_URL", "POLYTRAIN_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    _clear_caches()
    upgrade()
    yield tmp_path / "var"
    db.get_engine().dispose()
    _clear_caches()


@pytest.fixture
def client(service_env: Path) -> Iterator[TestClient]:
    """A client of the app without its scheduler thread."""
    from backend.main import create_app

    with TestClient(create_app(run_scheduler=False)) as test_client:
        yield test_client


@pytest.fixture
def session(service_env: Path) -> Iterator[db.Session]:
    with db.get_sessionmaker()() as s:
        yield s


def make_group(client: TestClient, name: str = "cpu-a", capacity: int = 2,
               device_type: str = "cpu") -> dict:
    response = client.post("/api/v1/resource-groups",
                           json={"name": name, "device_type": device_type, "capacity": capacity})
    assert response.status_code == 201, response.text
    return response.json()


def make_project(client: TestClient, name: str = "mnist", example: str = "mnist_cnn"
                 ) -> tuple[dict, dict]:
    project = client.post("/api/v1/projects", json={"name": name})
    assert project.status_code == 201, project.text
    version = client.post(f"/api/v1/projects/{project.json()['id']}/code-versions",
                          json={"example": example})
    assert version.status_code == 201, version.text
    return project.json(), version.json()


def agent_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


os.environ.setdefault("POLYTRAIN_AGENT_TOKEN", TOKEN)
