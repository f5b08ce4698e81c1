"""What several benchmarks set up alike: the PostgreSQL server, a throw-away Redis and a project
with example code."""

import os

import httpx

PG_SERVER = (
    os.environ.get("POLYTRAIN_BENCH_DATABASE_URL")
    or os.environ.get("POLYTRAIN_TEST_DATABASE_URL")
    or "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
"""The PostgreSQL server the benchmarks make their throw-away databases on."""


def redis_server(port: int, *extra: str) -> list[str]:
    """The command of a throw-away `redis-server` on 127.0.0.1:`port`, without persistence
    (no snapshots, no append-only file); `extra` arguments are appended."""
    return [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        *extra,
    ]


def example_project(api: httpx.Client, name: str) -> tuple[dict, dict]:
    """A new project `name` with the `tiny_regression` example as its code, through the
    REST API (`api`: an admin's client); `(project, code version)` as the API answers them.

    Raises:
        httpx.HTTPStatusError: the API refused either.
    """
    project = api.post("/api/v1/projects", json={"name": name}).raise_for_status().json()
    version = (
        api.post(
            f"/api/v1/projects/{project['id']}/code-versions",
            json={"example": "tiny_regression"},
        )
        .raise_for_status()
        .json()
    )
    return project, version
