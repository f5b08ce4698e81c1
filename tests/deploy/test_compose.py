"""docker-compose.yml (no Docker engine here): its services and settings agree with the code."""

import re
import shlex
from pathlib import Path

import yaml

from backend.core.config import Settings
from worker.config import AgentSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _env_names(settings_cls: type) -> set[str]:
    names = set()
    prefix = settings_cls.model_config["env_prefix"]
    for name, field in settings_cls.model_fields.items():
        names.add(f"{prefix}{name}".upper())
        alias = field.validation_alias
        names.update(getattr(alias, "choices", []) or [])
    return names


def test_services_of_the_production_stack() -> None:
    services = COMPOSE["services"]
    assert {"postgres", "redis", "api", "agent-cpu-a", "agent-cpu-b"} <= set(services)
    api_env = services["api"]["environment"]
    assert api_env["DATABASE_URL"].startswith("postgresql+psycopg://")
    assert api_env["BROKER_URL"].startswith("redis://redis:")
    assert "db upgrade" in services["api"]["command"]


def test_every_variable_is_read_by_a_settings_class() -> None:
    known = _env_names(Settings) | _env_names(AgentSettings) | {"GLOO_SOCKET_IFNAME"}
    for name, service in COMPOSE["services"].items():
        if name in ("postgres", "redis"):
            continue
        unknown = set(service["environment"]) - known
        assert not unknown, f"{name} sets variables no settings class reads: {unknown}"


def test_agents_serve_groups_that_are_created() -> None:
    services = COMPOSE["services"]
    created = set(re.findall(r"groups ensure (\S+)", services["init-groups"]["command"]))
    for name, service in services.items():
        if name.startswith("agent-"):
            args = shlex.split(service["command"])
            group = args[args.index("--resource-group") + 1]
            assert group in created
            assert service["environment"]["POLYTRAIN_API_URL"] == "http://api:8000"


def test_api_port_published() -> None:
    assert "8000:8000" in COMPOSE["services"]["api"]["ports"]
    assert "--port 8000" in COMPOSE["services"]["api"]["command"]
