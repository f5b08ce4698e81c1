"""`polytrain api --workers N`: several API processes on one port, refused where unsafe,
and each process's scheduler stopped at the first exit signal."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from backend.scheduler import loop
from tests import production
from worker.engine.ranks import free_port


def _api(port: int, workers: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "polytrain.cli", "api", "--port", str(port)]
        + (["--workers", str(workers)] if workers else []),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the supervisor and its processes: one group to kill
    )


def _refusal(env: dict[str, str]) -> tuple[int, str]:
    refused = _api(free_port(), 0, env)
    out, _ = refused.communicate(timeout=60)
    return refused.returncode, out


@pytest.mark.stack
def test_several_processes_need_postgresql_and_shared_login_counters(
    service_env: Path, db_backend: str
) -> None:
    env = dict(os.environ)
    env.pop("POLYTRAIN_RATE_LIMIT_STORAGE_URL", None)
    env["WEB_CONCURRENCY"] = "3"  # uvicorn's variable, read as --workers
    code, out = _refusal(env)
    assert code == 2, out
    if db_backend == "sqlite":
        assert "--workers 3 (or WEB_CONCURRENCY=3) needs PostgreSQL (set DATABASE_URL)" in out
        return
    assert "needs POLYTRAIN_RATE_LIMIT_STORAGE_URL set to a shared store" in out
    code, out = _refusal({**env, "POLYTRAIN_RATE_LIMIT_STORAGE_URL": "memory://"})
    assert code == 2 and "shared store" in out, out
    # Checked before the processes start (the supervisor would restart them without end).
    code, out = _refusal(
        {**env, "POLYTRAIN_RATE_LIMIT_STORAGE_URL": f"redis://127.0.0.1:{free_port()}/1"}
    )
    assert code == 3, out
    assert "POLYTRAIN_RATE_LIMIT_STORAGE_URL" in out and "cannot be reached" in out


@pytest.mark.stack(only="postgresql")
def test_two_processes_serve_one_port_and_stop_on_sigterm(service_env: Path) -> None:
    port = free_port()
    env = {**os.environ, "POLYTRAIN_RATE_LIMIT_STORAGE_URL": production.fresh_broker()}
    api = _api(port, 2, env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert api.poll() is None and time.monotonic() < deadline, api.stdout.read()  # type: ignore[union-attr]
            time.sleep(0.2)
        servers = [
            child
            for child in psutil.Process(api.pid).children()
            if "spawn_main" in " ".join(child.cmdline())
        ]
        assert len(servers) == 2
        # One of them, elected, runs the scheduler.
        deadline = time.monotonic() + 60
        while (leader := production.leader_pid(os.environ["DATABASE_URL"])) is None:
            assert time.monotonic() < deadline, "no process took the scheduler's lock"
            time.sleep(0.1)
        assert leader in {s.pid for s in servers}
        answered = {
            httpx.get(f"http://127.0.0.1:{port}/api/v1/health").status_code for _ in range(20)
        }
        assert answered == {200}
        api.send_signal(signal.SIGTERM)
        assert api.wait(timeout=30) == 0
        assert not any(s.is_running() and s.status() != psutil.STATUS_ZOMBIE for s in servers)
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGKILL)
            api.wait()


def test_exit_signal_stops_schedulers_before_the_servers_handler() -> None:
    calls: list[str] = []

    class Loop:
        def request_stop(self) -> None:
            calls.append("scheduler stopped")

    def server_handler(signum: int, frame: object) -> None:
        calls.append(f"server saw {signal.Signals(signum).name}")

    saved = {sig: signal.getsignal(sig) for sig in loop.EXIT_SIGNALS}
    stub = Loop()
    loop._started.add(stub)  # type: ignore[arg-type]
    try:
        signal.signal(signal.SIGTERM, server_handler)
        loop.stop_at_exit_signal()
        loop.stop_at_exit_signal()  # a second lifespan start does not stop twice
        signal.raise_signal(signal.SIGTERM)
        assert calls == ["scheduler stopped", "server saw SIGTERM"]
    finally:
        loop._started.discard(stub)  # type: ignore[arg-type]
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("how", ["--workers", "WEB_CONCURRENCY"])
def test_zero_processes_are_refused_saying_why(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from polytrain.cli import app

    monkeypatch.delenv("WEB_CONCURRENCY", raising=False)
    if how == "WEB_CONCURRENCY":
        monkeypatch.setenv("WEB_CONCURRENCY", "0")
    refused = CliRunner().invoke(app, ["api"] + (["--workers", "0"] if how == "--workers" else []))
    assert refused.exit_code == 2, refused.output
    assert (
        "error: --workers 0 (or WEB_CONCURRENCY=0) starts no API process: at least 1 must "
        "serve requests and run the scheduler"
    ) in refused.output


def test_a_second_api_process_on_the_embedded_sqlite_database_is_refused(
    service_env: Path,
) -> None:
    """The embedded default runs one API process: another `polytrain api` on the same SQLite
    database exits with status 2 before it serves anything, naming the one that runs."""
    from typer.testing import CliRunner

    from backend.core.config import get_settings
    from backend.scheduler.leader import hold_sqlite
    from polytrain.cli import app

    running = hold_sqlite(get_settings().resolved_database_url())  # the first process's lock
    assert running is not None
    try:
        refused = CliRunner().invoke(app, ["api", "--port", str(free_port())])
    finally:
        os.close(running)
    assert refused.exit_code == 2, refused.output
    assert f"another API process (pid {os.getpid()}) serves the SQLite database" in refused.output
    assert "the embedded default runs one API process" in refused.output
    assert "use PostgreSQL (DATABASE_URL) for several" in refused.output
