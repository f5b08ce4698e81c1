"""A whole polytrain deployment on one host's loopback: the API and one agent per group.

Used by `polytrain up`, `polytrain demo` and the end-to-end tests. Every part
is a separate process speaking to the others as it would across hosts: the
agents reach the API over HTTP and the broker, never the database.
"""

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class GroupSetup:
    """A resource group to create and the workers of the one agent that serves it."""

    name: str
    workers: int
    device_type: str = "cpu"
    description: str = ""


@dataclass
class LocalStack:
    data_dir: Path
    port: int = 8000
    host: str = "127.0.0.1"
    groups: list[GroupSetup] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    extra_env: dict[str, str] = field(default_factory=dict)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "BROKER_URL") or k in self.extra_env}
        env.update({
            "POLYTRAIN_DATA_DIR": str(self.data_dir), "POLYTRAIN_AGENT_TOKEN": self.token,
            "POLYTRAIN_API_URL": self.url, "POLYTRAIN_ADVERTISE_ADDR": self.host,
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"), "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra_env)
        return env

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.data_dir / f"{log_name}.log", "ab")  # noqa: SIM115 (owned by the child)
        proc = subprocess.Popen([sys.executable, "-m", "backend.cli", *args], env=self.env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(proc)
        return proc

    def start(self, timeout_s: float = 60.0) -> None:
        """Migrate, start the API, create the groups, start their agents and wait for them."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "backend.cli", "db", "upgrade"], env=self.env(),
                       check=True)
        self._spawn(["api", "--host", self.host, "--port", str(self.port)], "api")
        self._wait_http("/api/v1/health", timeout_s)
        for group in self.groups:
            self._ensure_group(group)
            self.start_agent(group)
        self.wait_agents(timeout_s)

    def start_agent(self, group: GroupSetup, name: str | None = None) -> subprocess.Popen[bytes]:
        name = name or f"agent-{group.name}"
        return self._spawn(["agent", "--resource-group", group.name,
                            "--workers", str(group.workers), "--name", name], name)

    def _ensure_group(self, group: GroupSetup) -> None:
        response = httpx.post(f"{self.url}/api/v1/resource-groups", json={
            "name": group.name, "device_type": group.device_type,
            "capacity": group.workers, "description": group.description})
        if response.status_code not in (201, 409):
            raise RuntimeError(f"creating group {group.name}: {response.text}")

    def _wait_http(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url}{path} did not answer within {timeout_s:.0f} s")

    def wait_agents(self, timeout_s: float) -> None:
        """Wait until every group has an online agent."""
        deadline = time.monotonic() + timeout_s
        wanted = {g.name for g in self.groups}
        while time.monotonic() < deadline:
            self._check_alive()
            groups = httpx.get(f"{self.url}/api/v1/resource-groups").json()
            if all(g["agents_online"] > 0 for g in groups if g["name"] in wanted):
                return
            time.sleep(0.3)
        raise TimeoutError(f"agents did not come online within {timeout_s:.0f} s; "
                           f"see {self.data_dir}/agent-*.log")

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, proc.args))} exited with "
                                   f"{proc.returncode}; see the logs in {self.data_dir}")

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process this stack started (agents first, then the API)."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
