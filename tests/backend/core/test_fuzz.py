"""Schemathesis against the served OpenAPI document, authenticated as an admin: no request
it generates makes the service fail (5xx), and answers match the documented schemas.
The internal agent API is fuzzed too, with the agent's credentials, from a document of
its own routes (it need not be in the public one)."""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from fastapi.openapi.utils import get_openapi
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import response_schema_conformance
from sqlalchemy import select

from backend.agent_api.router import router as agent_api_router
from backend.core.db import get_sessionmaker
from backend.scheduler.service import schedule_next
from backend.tasks.models import SubTask
from tests.backend.conftest import World
from tests.conftest import agent_headers

MAX_EXAMPLES = 20
# Streams never end for a running task; logout and revoking tokens would end the fuzzer's login.
SKIPPED = r"logs/stream|/auth/logout|/me/tokens/\{token_id\}"


def _operations(world: World) -> list:
    schema = schemathesis.openapi.from_asgi("/openapi.json", world.client.app)
    schema = schema.include(path_regex="^/api/v1/").exclude(path_regex=SKIPPED)
    return [result.ok() for result in schema.get_all_operations()]


def _internal_operations(world: World) -> list:
    """Every /internal/v1 operation, from an OpenAPI document of the internal router's own
    routes (listed whether or not the public document shows them)."""
    routes = [copy.copy(route) for route in agent_api_router.routes]
    for route in routes:
        route.include_in_schema = True  # type: ignore[attr-defined]
    document = get_openapi(title="polytrain internal", version="1", routes=routes)
    schema = schemathesis.openapi.from_dict(document)
    schema.app, schema.location = world.client.app, "/internal-openapi.json"
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(
    operation,
    session,
    headers: dict[str, str],
    errors: list[str],  # type: ignore[no-untyped-def]
    pin: Callable[[Any], None] = lambda case: None,
) -> None:
    """Up to MAX_EXAMPLES generated calls of one operation; its first failure goes to `errors`.
    `pin` may change a generated case before it is sent (e.g. point it at existing rows)."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    def run(case) -> None:  # type: ignore[no-untyped-def]
        pin(case)
        response = case.call(session=session, headers=headers)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

    try:
        run()
    except Exception as exc:  # every operation is fuzzed; the failures are reported together
        errors.append(f"{operation.label}: {type(exc).__name__}: {exc}")


@pytest.mark.timeout(240)
def test_generated_requests_never_fail_the_service(world: World) -> None:
    operations = _operations(world)
    assert len(operations) >= 30
    errors: list[str] = []
    with asgi.get_client(world.client.app) as session:  # one in-process client for every call
        for operation in operations:
            _fuzz(operation, session, world.admin.headers, errors)
    assert not errors, "\n\n".join(errors)


def _agent_world(world: World) -> dict[str, int]:
    """Rows the internal API acts on: a registered agent and the world's task scheduled
    onto it (so it has a sub-task), besides the task's checkpoint."""
    registered = world.client.post(
        "/internal/v1/agents/register",
        headers=agent_headers(),
        json={
            "name": "fuzz-agent",
            "host": "h",
            "workers": 2,
            "resource_group": "cpu-a",
            "hardware": {"cpu_cores": 2, "memory_bytes": 1},
        },
    )
    registered.raise_for_status()
    with get_sessionmaker()() as session:
        assert schedule_next(session) == world.task["id"]
        sub_task_id = session.scalars(
            select(SubTask.id).where(SubTask.task_id == world.task["id"])
        ).first()
    assert sub_task_id is not None
    return {
        "agent_id": registered.json()["id"],
        "task_id": world.task["id"],
        "sub_task_id": sub_task_id,
        "checkpoint_id": world.checkpoint["id"],
    }


@pytest.mark.timeout(240)
def test_generated_agent_requests_never_fail_the_service(world: World) -> None:
    """The internal API with the agent token: bad input is refused (4xx), never a 5xx.

    Path ids point at existing rows (random ids would only ever find nothing), and a
    registration names the existing group, so the bodies and query strings reach the
    services that store them."""
    operations = _internal_operations(world)
    assert len(operations) >= 14
    ids = _agent_world(world)

    def pin(case: Any) -> None:
        case.path_parameters = {
            **(case.path_parameters or {}),
            **{k: v for k, v in ids.items() if k in (case.path_parameters or {})},
        }
        if case.operation.path.endswith("/register") and isinstance(case.body, dict):
            case.body = {**case.body, "resource_group": "cpu-a"}

    errors: list[str] = []
    with asgi.get_client(world.client.app) as session:
        for operation in operations:
            _fuzz(operation, session, agent_headers(), errors, pin)
    assert not errors, "\n\n".join(errors)
