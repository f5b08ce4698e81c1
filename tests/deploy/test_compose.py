"""docker-compose.yml (no Docker engine here): its services and settings agree with the code.

Each service's environment is fed to the settings class that reads it, so a
misspelt variable, a wrong driver or an unreachable address fails here.
"""

import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from backend.core.config import Settings
from contracts.messaging import VISIBILITY_TIMEOUT_S
from polytrain.cli import multi_process_problem
from worker.config import AgentSettings
from worker.engine.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
AGENTS = {name: s for name, s in SERVICES.items() if name.startswith("agent-")}
PLACEHOLDER = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}")


def _env_names(settings_cls: type) -> set[str]:
    names = set()
    prefix = settings_cls.model_config["env_prefix"]
    for name, field in settings_cls.model_fields.items():
        names.add(f"{prefix}{name}".upper())
        alias = field.validation_alias
        names.update(getattr(alias, "choices", []) or [])
    return names


def _environment(service: str) -> dict[str, str]:
    """The service's variables with `${VAR:?...}` / `${VAR:-default}` given test values."""

    def value(match: re.Match[str]) -> str:
        default = re.search(r":-([^}]*)", match.group(0))
        return default.group(1) if default else f"test-{match.group(1).lower()}"

    return {k: PLACEHOLDER.sub(value, str(v)) for k, v in SERVICES[service]["environment"].items()}


def _settings(cls: type, service: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for name in _env_names(cls):
        monkeypatch.delenv(name, raising=False)
    for key, val in _environment(service).items():
        monkeypatch.setenv(key, val)
    return cls(_env_file=None)


def _groups() -> dict[str, dict[str, str]]:
    """Groups init-groups creates: name -> {device_type, capacity}."""
    found = re.findall(
        r"groups ensure (\S+) --device-type (\S+) --capacity (\d+)",
        SERVICES["init-groups"]["command"],
    )
    return {name: {"device_type": device, "capacity": capacity} for name, device, capacity in found}


def test_services_of_the_production_stack() -> None:
    assert {"postgres", "redis", "api", "init-groups"} <= set(SERVICES)
    assert set(AGENTS) == {f"agent-{g}" for g in _groups()}  # one agent per example group
    assert "db upgrade" in SERVICES["api"]["command"]
    for dependency in ("postgres", "redis"):
        assert SERVICES["api"]["depends_on"][dependency] == {"condition": "service_healthy"}
        assert "healthcheck" in SERVICES[dependency]


def test_every_variable_is_read_by_a_settings_class() -> None:
    known = _env_names(Settings) | _env_names(AgentSettings) | {"GLOO_SOCKET_IFNAME"}
    for name, service in SERVICES.items():
        if name in ("postgres", "redis"):
            continue
        unknown = set(service["environment"]) - known
        assert not unknown, f"{name} sets variables no settings class reads: {unknown}"


def test_api_settings_point_at_the_compose_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = _settings(Settings, "api", monkeypatch)
    database = urlsplit(settings.resolved_database_url())
    pg = _environment("postgres")
    assert database.scheme == "postgresql+psycopg" and database.hostname == "postgres"
    assert (database.username, database.password, database.path) == (
        pg["POSTGRES_USER"],
        pg["POSTGRES_PASSWORD"],
        f"/{pg['POSTGRES_DB']}",
    )
    broker = urlsplit(settings.resolved_broker_url())
    assert (broker.scheme, broker.hostname, broker.port) == ("redis", "redis", 6379)
    assert settings.heartbeat_timeout_s == 15.0 and settings.admin_password is not None
    assert str(settings.data_dir) == SERVICES["api"]["volumes"][0].split(":")[1]
    # Several API processes: allowed with these settings (PostgreSQL, shared login counters).
    # exec: the API, not sh, is PID 1 and gets `docker stop`'s SIGTERM (dash does not exec
    # the last command of a list itself).
    assert "&& exec polytrain api " in SERVICES["api"]["command"]
    args = shlex.split(SERVICES["api"]["command"])[-1].split()
    workers = int(args[args.index("--workers") + 1])
    assert workers > 1 and multi_process_problem(settings, workers) is None
    limits = urlsplit(settings.rate_limit_storage_url or "")
    assert (limits.scheme, limits.hostname, limits.path) == ("redis", "redis", "/1")


@pytest.mark.parametrize("service", sorted(AGENTS))
def test_agent_settings_agree_with_the_api(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _settings(AgentSettings, service, monkeypatch)
    api_env = _environment("api")
    assert agent.resolved_broker_url() == api_env["BROKER_URL"]
    assert agent.agent_token.get_secret_value() == api_env["POLYTRAIN_AGENT_TOKEN"]
    assert agent.api_url == "http://api:8000"
    assert agent.advertise_addr == service  # reachable by the other containers by name
    assert agent.heartbeat_interval_s * 3 < float(api_env["POLYTRAIN_HEARTBEAT_TIMEOUT_S"])
    assert "POLYTRAIN_ADMIN_PASSWORD" not in _environment(service)  # agents hold no admin secret
    args = shlex.split(AGENTS[service]["command"])
    group = _groups()[args[args.index("--resource-group") + 1]]
    assert int(args[args.index("--workers") + 1]) <= int(group["capacity"])
    assert group["device_type"] in ("cpu", "cuda", "npu")


def test_api_port_published() -> None:
    assert "8000:8000" in SERVICES["api"]["ports"]
    assert "--port 8000" in SERVICES["api"]["command"]


def test_redis_keeps_nothing_and_messages_outlast_runs() -> None:
    assert '--save ""' in SERVICES["redis"]["command"]
    assert VISIBILITY_TIMEOUT_S >= 24 * 3600


def _required(value: str, variable: str) -> bool:
    """`value` is exactly `${VARIABLE:?message}`: compose refuses to start without it."""
    return re.fullmatch(r"\$\{" + variable + r":\?[^}]+\}", value) is not None


def test_postgres_password_comes_from_the_environment() -> None:
    pg = SERVICES["postgres"]["environment"]
    assert _required(pg["POSTGRES_PASSWORD"], "POSTGRES_PASSWORD")
    for service in ("api", "init-groups"):
        url = SERVICES[service]["environment"]["DATABASE_URL"]
        password = re.fullmatch(
            r"postgresql\+psycopg://polytrain:(.+)@postgres:5432/polytrain", url
        )
        assert password and _required(password.group(1), "POSTGRES_PASSWORD"), url


def test_redis_requires_a_password_every_client_uses() -> None:
    redis = SERVICES["redis"]
    assert _required(redis["environment"]["REDIS_PASSWORD"], "REDIS_PASSWORD")
    assert '--requirepass "$$REDIS_PASSWORD"' in redis["command"]
    assert "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])  # the probe authenticates
    clients = {n for n, s in SERVICES.items() if "BROKER_URL" in s.get("environment", {})}
    assert {"api", *AGENTS} <= clients
    for name in clients:
        url = SERVICES[name]["environment"]["BROKER_URL"]
        password = re.fullmatch(r"redis://:(.+)@redis:6379/0", url)
        assert password and _required(password.group(1), "REDIS_PASSWORD"), (name, url)


def test_redis_command_refuses_clients_without_the_password(tmp_path: Path) -> None:
    """The compose command, run with this machine's redis-server: NOAUTH without the password,
    the broker URL of the services (host and port pointed here) is let in."""
    import os
    import shutil
    import subprocess
    import time

    import redis as redis_client

    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is missing: run `apt-get install -y redis-server` "
            "(`make test` does it when run as root)",
            pytrace=False,
        )
    port = free_port()
    args = shlex.split(SERVICES["redis"]["command"].replace("$$", "$"))
    args[-1] += f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    env = {**os.environ, "REDIS_PASSWORD": "s3cret-test-password"}
    server = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL)
    try:
        anonymous = redis_client.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                anonymous.ping()
                raise AssertionError("redis answered a client without the password")
            except redis_client.AuthenticationError:
                break  # NOAUTH: the server is up and wants the password
            except redis_client.ConnectionError:
                assert time.monotonic() < deadline and server.poll() is None, "redis did not start"
                time.sleep(0.1)
        broker = PLACEHOLDER.sub(
            lambda m: env.get(m.group(1), ""), str(SERVICES["api"]["environment"]["BROKER_URL"])
        )
        broker = broker.replace("@redis:6379", f"@127.0.0.1:{port}")
        assert redis_client.Redis.from_url(broker, socket_timeout=5).ping() is True
    finally:
        server.terminate()
        server.wait(timeout=30)


DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_image_runs_as_an_unprivileged_user() -> None:
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE, flags=re.MULTILINE)
    assert users and users[-1] not in ("root", "0", "0:0")
    assert re.search(rf"useradd\b[^\n]*(\\\n[^\n]*)*\b{users[-1]}\b", DOCKERFILE)
    # The user owns the data volume's mount point, so named volumes start out writable.
    assert re.search(rf"install -d -o {users[-1]} -g {users[-1]} -m 0700 /data", DOCKERFILE)
    assert "ENV POLYTRAIN_DATA_DIR=/data" in DOCKERFILE
    # Agents sandbox ranks (docs/security.md): bubblewrap and the unprivileged rank user.
    assert "bubblewrap" in DOCKERFILE and "iptables" in DOCKERFILE
    assert re.search(r"useradd\b[^\n]*(\\\n[^\n]*)*?\bpolytrain-run\b", DOCKERFILE)
    # The image runs the installed wheel (package data included), not a source tree.
    assert re.search(r"pip install --no-cache-dir /src && rm -rf /src", DOCKERFILE)


def test_only_agents_run_as_root_to_sandbox_their_ranks() -> None:
    """The API and the one-shot job keep the image's unprivileged user; an agent is root in
    its container (only root starts ranks as other uids) with the namespaces bwrap needs."""
    for name, service in SERVICES.items():
        if name in AGENTS:
            assert service["user"] == "root"
            assert {"SYS_ADMIN", "NET_ADMIN"} <= set(service["cap_add"])
            assert "seccomp=unconfined" in service["security_opt"]
        elif service.get("build"):
            assert "user" not in service and "cap_add" not in service, name
