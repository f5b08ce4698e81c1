"""`polytrain up` supervises its children and stops them all when its process group is told to.

Started in its own process group on a free port with a temporary data dir,
as a service manager (or `make up` in a terminal) would run it: a child that
dies comes back while the others keep running; SIGTERM to the group leaves no
child and frees the port.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from worker.engine.ranks import free_port

REPO = Path(__file__).resolve().parents[2]


def _children(pid: int) -> dict[int, str]:
    """Live child processes of `pid`: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(entry.name)] = cmdline
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _wait(condition, what: str, timeout_s: float = 180.0, up: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up is not None and up.poll() is not None:
            raise AssertionError(f"polytrain up exited ({up.returncode}) while waiting: {what}")
        result = condition()
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting: {what}")


def _child(up: subprocess.Popen, role: str) -> int | None:
    """The pid of up's child whose command line contains `role` (e.g. ' api ')."""
    pids = [pid for pid, cmd in _children(up.pid).items() if role in cmd]
    return pids[0] if len(pids) == 1 else None


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("POLYTRAIN_") and k not in ("DATABASE_URL", "BROKER_URL")
    }
    data_dir = tmp_path / "up"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polytrain.cli",
            "up",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ],
        cwd=REPO,
        env=env,
        start_new_session=True,  # its own process group, like `make up`
        stdout=open(tmp_path / "up.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc, f"http://127.0.0.1:{port}", data_dir
    finally:
        if proc.poll() is None:
            children = _children(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in children:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()


def _agents_online(url: str, token: str) -> dict[str, dict]:
    response = httpx.get(
        f"{url}/api/v1/agents", headers={"Authorization": f"Bearer {token}"}, timeout=10
    )
    return (
        {a["name"]: a for a in response.json() if a["online"]}
        if response.status_code == 200
        else {}
    )


def test_up_restarts_a_dead_child_and_stops_all_on_sigterm_to_its_group(up) -> None:
    proc, url, data_dir = up

    def health() -> bool:
        try:
            return httpx.get(f"{url}/api/v1/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    _wait(lambda: health() and (data_dir / "admin-password").is_file(), "the API", up=proc)
    token = httpx.post(
        f"{url}/api/v1/auth/login",
        timeout=30,
        json={
            "email": "admin@polytrain.local",
            "password": (data_dir / "admin-password").read_text(),
            "token_name": "test",
        },
    ).json()["token"]
    _wait(
        lambda: {"agent-cpu-a", "agent-cpu-b"} <= set(_agents_online(url, token)),
        "both agents online",
        up=proc,
    )
    _wait(
        lambda: "polytrain portal:" in (data_dir.parent / "up.log").read_text(),
        "up reporting the portal ready",
        up=proc,
    )

    # The API dies: it is started again, the agents keep running.
    api_pid = _child(proc, " api ")
    agent_pids = {pid for pid, cmd in _children(proc.pid).items() if " agent " in cmd}
    assert api_pid is not None and len(agent_pids) == 2
    os.killpg(api_pid, signal.SIGKILL)
    new_api = _wait(
        lambda: (pid := _child(proc, " api ")) not in (None, api_pid) and pid,
        "a new API process",
        up=proc,
    )
    _wait(health, "the restarted API answering", up=proc)
    assert all(_alive(pid) for pid in agent_pids)

    # An agent dies: it comes back under its own name (same instance id) and heartbeats.
    agent_b = _child(proc, "agent-cpu-b")
    assert agent_b is not None
    os.killpg(agent_b, signal.SIGKILL)
    new_b = _wait(
        lambda: (pid := _child(proc, "agent-cpu-b")) not in (None, agent_b) and pid,
        "a new agent-cpu-b process",
        up=proc,
    )
    before = _agents_online(url, token)["agent-cpu-b"]["last_heartbeat_at"]
    _wait(
        lambda: (
            _agents_online(url, token).get("agent-cpu-b", {}).get("last_heartbeat_at", before)
            > before
        ),
        "agent-cpu-b heartbeating again",
        up=proc,
    )
    assert "agent refused:" not in (data_dir / "agent-cpu-b.log").read_text()  # its name
    assert _alive(new_api) and _alive(new_b) and proc.poll() is None

    # SIGTERM to the whole process group (a service manager stopping `make up`).
    children = _children(proc.pid)
    assert len(children) == 3
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.5)  # a second signal while it stops (make passes one on) cuts nothing short
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    assert not [pid for pid in children if _alive(pid)]
    with socket.socket() as sock:  # the port is free again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
