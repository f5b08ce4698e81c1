"""A whole polytrain deployment on one host's loopback: the API and one agent per group.

Used by `polytrain up`, `polytrain demo` and the end-to-end tests. Every part
is a separate process speaking to the others as it would across hosts: the
agents reach the API over HTTP and the broker, never the database.
"""

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from backend.core.config import private_dir, private_file

log = logging.getLogger(__name__)
# A child that dies is restarted after 1, 2, 4 ... s, at most this long; one that ran
# for STABLE_S before dying starts again from the shortest delay.
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0


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
    admin_email: str = "admin@polytrain.local"
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    admin_token: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    database_url: str | None = None
    broker_url: str | None = None
    _children: dict[str, "_Child"] = field(default_factory=dict)  # API and agents, by name

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "BROKER_URL") or k in self.extra_env
        }
        env.update(
            {
                "POLYTRAIN_DATA_DIR": str(self.data_dir),
                "POLYTRAIN_AGENT_TOKEN": self.token,
                "POLYTRAIN_API_URL": self.url,
                "POLYTRAIN_ADVERTISE_ADDR": self.host,
                "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
                "PYTHONUNBUFFERED": "1",
                "POLYTRAIN_ADMIN_EMAIL": self.admin_email,
                "POLYTRAIN_ADMIN_PASSWORD": self.admin_password,
            }
        )
        env.update(self.extra_env)
        if self.database_url:
            env["DATABASE_URL"] = self.database_url
        if self.broker_url:
            env["BROKER_URL"] = self.broker_url
        return env

    def agent_env(self) -> dict[str, str]:
        """An agent's environment: no database URL and no admin credentials (it needs neither)."""
        return {
            k: v
            for k, v in self.env().items()
            if k
            not in (
                "DATABASE_URL",
                "POLYTRAIN_DATABASE_URL",
                "POLYTRAIN_ADMIN_PASSWORD",
                "POLYTRAIN_ADMIN_EMAIL",
                "POLYTRAIN_SECRET_KEY",
            )
        }

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        env = self.agent_env() if args[0] == "agent" else self.env()
        with open(self.data_dir / f"{log_name}.log", "ab") as out:  # the child keeps its copy
            private_file(self.data_dir / f"{log_name}.log")
            proc = subprocess.Popen(
                [sys.executable, "-m", "polytrain.cli", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._children[log_name] = _Child(log_name, args, proc, time.monotonic())
        return proc

    def supervise(self) -> list[str]:
        """Restart each child (API or agent) that died, with backoff; names restarted now.

        A dead child is logged and started again after 1, 2, 4 ... s (at most
        MAX_BACKOFF_S; back to 1 s once it ran STABLE_S). Called periodically by
        `polytrain up`; the other children keep running meanwhile.
        """
        restarted = []
        now = time.monotonic()
        for child in list(self._children.values()):
            code = child.proc.poll()
            if code is None:
                continue
            if child.due is None:
                ran = now - child.started
                child.delay = 1.0 if ran >= STABLE_S else min(child.delay * 2, MAX_BACKOFF_S)
                child.due = now + child.delay
                log.warning(
                    "%s exited with status %s after %.0f s; restarting it in %.0f s (log: %s)",
                    child.name,
                    code,
                    ran,
                    child.delay,
                    self.data_dir / f"{child.name}.log",
                )
            if now < child.due:
                continue
            proc = self._spawn(child.args, child.name)
            self._children[child.name].delay = child.delay
            log.warning("%s restarted (pid %s)", child.name, proc.pid)
            restarted.append(child.name)
        return restarted

    def start(self, timeout_s: float = 60.0) -> None:
        """Migrate, start the API, create the groups, start their agents and wait for them."""
        self.admin_password = self._remembered_password()
        subprocess.run(
            [sys.executable, "-m", "polytrain.cli", "db", "upgrade"], env=self.env(), check=True
        )
        self.start_api(timeout_s)
        self.admin_token = self.login(self.admin_email, self.admin_password)
        for group in self.groups:
            self._ensure_group(group)
            self.start_agent(group)
        self.wait_agents(timeout_s)

    def start_api(self, timeout_s: float = 60.0) -> None:
        """Start the API (with its scheduler) and wait until it answers.

        Raises:
            TimeoutError: /api/v1/health did not answer within `timeout_s` seconds.
        """
        self._spawn(["api", "--host", self.host, "--port", str(self.port)], "api")
        self._wait_http("/api/v1/health", timeout_s)

    def stop_api(self, grace_s: float = 10.0) -> None:
        """Stop the API (SIGTERM, SIGKILL after `grace_s` s) as an operator restarting it
        would; the agents keep running. `start_api` brings it back."""
        self._terminate([self._children.pop("api").proc], grace_s)

    def start_agent(self, group: GroupSetup, name: str | None = None) -> subprocess.Popen[bytes]:
        name = name or f"agent-{group.name}"
        return self._spawn(
            [
                "agent",
                "--resource-group",
                group.name,
                "--workers",
                str(group.workers),
                "--name",
                name,
            ],
            name,
        )

    def kill_agent(self, name: str) -> int:
        """SIGKILL agent `name` (no clean deregistration), as a crashed host would; its pid."""
        proc = self._children.pop(name).proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return proc.pid

    def _remembered_password(self) -> str:
        """The first admin's password, kept in the data dir (0700; the file 0600): the admin
        is created once, so a stack restarted on the same data dir must log in with it."""
        path = private_dir(self.data_dir) / "admin-password"
        if path.is_file():
            return path.read_text().strip()
        path.touch(mode=0o600)
        path.write_text(self.admin_password)
        return self.admin_password

    @property
    def headers(self) -> dict[str, str]:
        """Authorization of the stack's first admin (created from the settings at start)."""
        return {"Authorization": f"Bearer {self.admin_token}"}

    def login(self, email: str, password: str) -> str:
        """A new API token for `email` (POST /api/v1/auth/login)."""
        response = httpx.post(
            f"{self.url}/api/v1/auth/login",
            timeout=30,
            json={"email": email, "password": password, "token_name": "local stack"},
        )
        if response.status_code != 201:
            raise RuntimeError(f"login of {email} refused: {response.text}")
        return str(response.json()["token"])

    def _ensure_group(self, group: GroupSetup) -> None:
        response = httpx.post(
            f"{self.url}/api/v1/resource-groups",
            headers=self.headers,
            json={
                "name": group.name,
                "device_type": group.device_type,
                "capacity": group.workers,
                "description": group.description,
            },
        )
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
            groups = httpx.get(f"{self.url}/api/v1/resource-groups", headers=self.headers).json()
            if all(g["agents_online"] > 0 for g in groups if g["name"] in wanted):
                return
            time.sleep(0.3)
        raise TimeoutError(
            f"agents did not come online within {timeout_s:.0f} s; see {self.data_dir}/agent-*.log"
        )

    def _check_alive(self) -> None:
        for proc in (child.proc for child in self._children.values()):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{proc.args!r} exited with {proc.returncode}; see the logs in {self.data_dir}"
                )

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process this stack started: the agents first (they deregister while
        the API still answers), then the API."""
        children = list(self._children.values())
        self._terminate([c.proc for c in reversed(children) if c.is_agent], grace_s)
        self._terminate([c.proc for c in children if not c.is_agent], grace_s)
        self._children.clear()

    @staticmethod
    def _terminate(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
        """SIGTERM each process group, SIGKILL what is left after `grace_s` seconds."""
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> "LocalStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class _Child:
    """A supervised child process: what started it, when, and its restart backoff."""

    name: str
    args: list[str]
    proc: subprocess.Popen[bytes]
    started: float
    delay: float = 0.5
    due: float | None = None

    @property
    def is_agent(self) -> bool:
        return self.args[0] == "agent"


def _signal_group(pgid: int, signum: int) -> None:
    """Signal a child's process group; it may have ended meanwhile."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
