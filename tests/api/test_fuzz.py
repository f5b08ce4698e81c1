"""Schemathesis against the served OpenAPI document, authenticated as an admin: no request
it generates makes the service fail (5xx), and answers match the documented schemas.
The internal agent API is fuzzed too, with the agent's credentials, from a document of
its own routes (it need not be in the public one)."""

import copy

import pytest
import schemathesis
from fastapi.openapi.utils import get_openapi
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import response_schema_conformance

from backend.internal.router import router as internal_router
from tests.api.conftest import World
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
    routes = [copy.copy(route) for route in internal_router.routes]
    for route in routes:
        route.include_in_schema = True  # type: ignore[attr-defined]
    document = get_openapi(title="polytrain internal", version="1", routes=routes)
    schema = schemathesis.openapi.from_dict(document)
    schema.app, schema.location = world.client.app, "/internal-openapi.json"
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(operation, session, headers: dict[str, str], errors: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Up to MAX_EXAMPLES generated calls of one operation; its first failure goes to `errors`."""

    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def run(case) -> None:  # type: ignore[no-untyped-def]
        response = case.call(session=session, headers=headers)
        case.validate_response(response, checks=[not_a_server_error,
                                                  response_schema_conformance])

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


@pytest.mark.timeout(240)
def test_generated_agent_requests_never_fail_the_service(world: World) -> None:
    """The internal API with the agent token: bad input is refused (4xx), never a 5xx."""
    operations = _internal_operations(world)
    assert len(operations) >= 14
    errors: list[str] = []
    with asgi.get_client(world.client.app) as session:
        for operation in operations:
            _fuzz(operation, session, agent_headers(), errors)
    assert not errors, "\n\n".join(errors)
