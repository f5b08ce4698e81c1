"""Fixtures of the CLI tests: the API served over real HTTP, and the `polytrain` command run
against it with a credentials file of its own."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from typer.testing import CliRunner

from polytrain.cli import app as cli
from worker.engine.ranks import free_port


@pytest.fixture
def server(service_env: Path) -> Iterator[str]:
    """The API on a free loopback port, served by uvicorn in a thread."""
    from backend.main import create_app

    port = free_port()
    config = uvicorn.Config(create_app(run_scheduler=False), port=port, log_level="warning")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    while not running.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


@pytest.fixture
def run(server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("POLYTRAIN_CONFIG", str(tmp_path / "credentials.json"))
    monkeypatch.setenv("POLYTRAIN_API_URL", server)
    monkeypatch.delenv("POLYTRAIN_TOKEN", raising=False)
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None):  # type: ignore[no-untyped-def]
        return runner.invoke(cli, list(args), input=input, catch_exceptions=False)

    return invoke
