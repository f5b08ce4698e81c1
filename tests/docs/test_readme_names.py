"""The names the README gives hold in the code: its REST routes and its task options.

(a) Every route the README mentions, as `/api/v1/...` or `$API/...` (curl lines, inline code)
or as `METHOD /path` in its tables, is one the FastAPI app routes: matched by the app's own
routes (`route.matches`), so `/tasks/1` finds `/tasks/{task_id}`; a `{id}` in the README
stands for any value. A method written beside the path (`PATCH /api/v1/...`, `-XPOST
$API/...`) must be one the route takes.

(b) Every name the README shows in backticks as a task option, `name: value` or
`"name": value` or a bare snake_case name (`sync_period`), and every key of the task body
its curl script posts to `$API/tasks`, is a field of the task submission schema
(`TaskCreate`, nested models included) or of the engine's `RunSpec`; a value beside a
top-level field must be one that field takes (`sync_strategy: diloco`). The README's other
snake_case names (response fields, metrics, query parameters) are listed in NOT_OPTIONS,
each of which the code must still define.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.routing import BaseRoute, Match

from backend.tasks.schemas import TaskCreate
from worker.engine.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]
API = "/api/v1"
METHODS = "GET|POST|PUT|PATCH|DELETE"
PATH_CHARS = r"[A-Za-z0-9_\-.{}/]"

# `/api/v1/...` or `$API/...`, after an optional method (`PATCH /api/v1/...`, `-XPOST $API/...`)
# and an optional origin (`http://127.0.0.1:8000/api/v1/...`).
ROUTE = re.compile(
    rf"(?:\b(?P<method>{METHODS}) |-X ?(?P<flag>{METHODS}) )?(?:https?://[^/\s`'\"]+)?"
    rf"(?:/api/v1|\$API)(?P<path>/{PATH_CHARS}*)"
)
# `GET /tasks/{id}/logs` in inline code: a path under /api/v1 written without the prefix.
RELATIVE_ROUTE = re.compile(rf"`(?P<method>{METHODS}) (?P<path>/(?!api/){PATH_CHARS}*)")

SNAKE = r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+"
BARE_NAME = re.compile(rf"^{SNAKE}$")
SETTING = re.compile(r"^(?P<name>[a-z][a-z0-9_]*): (?P<value>[^\s:]+)$")  # `guard: true`
JSON_PAIR = re.compile(r'^"(?P<name>[a-z][a-z0-9_]*)": (?P<value>[^,{}\[\]]+)$')
TASK_BODY = re.compile(r"\$API/tasks -H [^\n]*?-d '(?P<body>[^']*)'")  # the body may span lines

# Snake_case names in the README's backticks that are not task options, and what they are.
NOT_OPTIONS = {
    "eta_s": "task field",
    "predicted_finish_at": "task field",
    "finished_at": "task field",
    "task_request": "plan field",
    "after_id": "query parameter of the task log and a task's metrics",
    "max_points": "query parameter of a task's metrics",
    "startup_s": "metric",
    "rank_cpu_percent": "metric",
    "rank_rss_mb": "metric",
    "rank_gpu_util": "metric",
    "rank_gpu_mem_mb": "metric",
    "polytrain_rank_cpu_percent": "Prometheus gauge",
    "polytrain_rank_memory_rss_mib": "Prometheus gauge",
    "polytrain_rank_gpu_utilization_percent": "Prometheus gauge",
    "polytrain_rank_gpu_memory_mib": "Prometheus gauge",
    "polytrain_scheduler_leader": "Prometheus gauge",
    "value": "metric field",
    "nonfinite": "metric field",
    "field": "error field",
}
EXTERNAL = {"max_connections"}  # PostgreSQL's setting, not ours


def readme() -> str:
    return (REPO / "README.md").read_text()


# --- (a) routes -------------------------------------------------------------------------


def mentioned_routes(text: str) -> set[tuple[str | None, str]]:
    """(method or None, path under /api/v1 without its query) of every route `text` names."""
    found: set[tuple[str | None, str]] = set()
    for match in ROUTE.finditer(text):
        path = match["path"].rstrip("./")
        if path:
            found.add((match["method"] or match["flag"], path))
    for match in RELATIVE_ROUTE.finditer(text):
        found.add((match["method"], match["path"].rstrip("./")))
    return found


@pytest.fixture(scope="module")
def routes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[BaseRoute]]:
    """The app's routes (the app is built, not started: no database, no scheduler)."""
    from backend.core import config, db

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POLYTRAIN_DATA_DIR", str(tmp_path_factory.mktemp("var")))
        patch.setenv("POLYTRAIN_AGENT_TOKEN", "test-agent-token")
        config.get_settings.cache_clear()
        from backend.main import create_app

        yield list(create_app(run_scheduler=False).routes)
        config.get_settings.cache_clear()
        db.get_engine.cache_clear()
        db.get_sessionmaker.cache_clear()


def routed(routes: list[BaseRoute], method: str | None, path: str) -> bool:
    """True when the app routes `path` (its `{...}` parts any value), with `method` if given."""
    concrete = API + re.sub(r"\{[^}/]*\}", "1", path)
    for verb in [method] if method else ["GET", "POST", "PUT", "PATCH", "DELETE"]:
        scope = {"type": "http", "method": verb, "path": concrete, "root_path": ""}
        if any(route.matches(scope)[0] is Match.FULL for route in routes):
            return True
    return False


def unknown_routes(routes: list[BaseRoute], text: str) -> list[str]:
    return sorted(
        f"{method or 'any method'} {API}{path}"
        for method, path in mentioned_routes(text)
        if not routed(routes, method, path)
    )


def test_every_route_the_readme_names_is_routed(routes: list[BaseRoute]) -> None:
    mentioned = mentioned_routes(readme())
    assert len(mentioned) >= 20, sorted(mentioned)  # the extraction still finds them
    assert ("POST", "/plans") in mentioned and ("GET", "/tasks/{id}/logs.txt") in mentioned
    missing = unknown_routes(routes, readme())
    assert not missing, f"README names routes the API does not have: {missing}"


@pytest.mark.parametrize(
    "line",
    [
        'curl -s -H "$H" $API/tasks/1/bogus     # no such route',
        "`GET /api/v1/tasks/{id}/nothing`",
        "`DELETE /api/v1/projects` (no DELETE there)",
        "curl -s -XPUT $API/tasks -d '{}'",
        "`PATCH /tasks/{id}/events`",
    ],
)
def test_a_route_the_api_lacks_is_named(routes: list[BaseRoute], line: str) -> None:
    assert unknown_routes(routes, readme() + "\n" + line + "\n"), line


# --- (b) task options -------------------------------------------------------------------


def _models(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models inside an annotation (list[...], unions, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def _field_names(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[str]:
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for inner in _models(field.annotation):
            names |= _field_names(inner, seen)
    return names


@cache
def option_names() -> frozenset[str]:
    """Every field of TaskCreate and RunSpec, at any depth (groups, data options, steps)."""
    seen: set[type[BaseModel]] = set()
    return frozenset(_field_names(TaskCreate, seen) | _field_names(RunSpec, seen))


def _inline_code(text: str) -> list[str]:
    outside_fences = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.findall(r"`([^`]+)`", outside_fences)


def _parsed(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # `sync_strategy: diloco`: a bare word is a string


def mentioned_options(text: str) -> tuple[set[str], list[tuple[str, Any]], set[str]]:
    """(names in backticks, (name, value) settings, keys of the task body posted to $API/tasks)."""
    names: set[str] = set()
    settings: list[tuple[str, Any]] = []
    for span in _inline_code(text):
        span = " ".join(span.split())
        if BARE_NAME.match(span):
            names.add(span)
        elif setting := SETTING.match(span) or JSON_PAIR.match(span):
            names.add(setting["name"])
            settings.append((setting["name"], _parsed(setting["value"])))
    body_keys: set[str] = set()
    for match in TASK_BODY.finditer(text):
        body_keys |= set(_keys(json.loads(match["body"])))
    return names, settings, body_keys


def _keys(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key
            yield from _keys(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _keys(inner)


def _value_problem(name: str, value: Any) -> str | None:
    """Why `value` is not one the top-level option `name` takes (None: it is, or `name` is
    only a nested field, whose value is not checked here)."""
    for model in (TaskCreate, RunSpec):
        field = model.model_fields.get(name)
        if field is None:
            continue
        annotation: Any = field.annotation
        if field.metadata:  # its bounds (ge, le, max_length)
            annotation = typing.Annotated[(annotation, *field.metadata)]
        try:
            TypeAdapter(annotation).validate_python(value)
        except ValidationError as exc:
            return f"{name}: {value!r} ({exc.errors()[0]['msg']})"
        return None
    return None


@cache
def code_names() -> frozenset[str]:
    """The names the backend, worker and contracts sources define: quoted strings (metric
    names, keys) and annotated attributes (schema fields)."""
    found: set[str] = set()
    for folder in ("backend", "worker", "contracts"):
        for path in (REPO / folder).rglob("*.py"):
            source = path.read_text()
            found |= set(re.findall(rf"[\"'`]({SNAKE}|[a-z]+)[\"'`]", source))
            found |= set(re.findall(rf"^\s+({SNAKE}|[a-z]+): ", source, re.MULTILINE))
    return frozenset(found)


def option_problems(text: str) -> list[str]:
    names, settings, body_keys = mentioned_options(text)
    options = option_names()
    problems = [
        f"`{name}` is no field of TaskCreate or RunSpec (and not in NOT_OPTIONS)"
        for name in sorted(names - options - NOT_OPTIONS.keys() - EXTERNAL)
    ]
    problems += [
        f"the task body posted to $API/tasks has `{key}`, no field of TaskCreate"
        for key in sorted(body_keys - _field_names(TaskCreate, set()))
    ]
    problems += [
        f"`{problem}`" for name, value in settings if (problem := _value_problem(name, value))
    ]
    return problems


def test_every_task_option_the_readme_names_is_a_spec_field() -> None:
    names, settings, body_keys = mentioned_options(readme())
    options = names & option_names()
    # the extraction still finds them: settings, bare names and the curl task body
    assert {"sync_strategy", "sync_period", "on_group_loss", "agreement_every"} <= options, names
    assert ("sync_strategy", "diloco") in settings, settings
    assert {"global_batch_size", "resource_groups", "workers"} <= body_keys, body_keys
    problems = option_problems(readme())
    assert not problems, f"README names task options the code does not have: {problems}"


def test_the_readme_names_outside_the_options_are_the_codes() -> None:
    """NOT_OPTIONS stays true: each name is still in the README and defined in the code."""
    names, _, _ = mentioned_options(readme())
    assert not (NOT_OPTIONS.keys() | EXTERNAL) - names, "no longer in the README: drop them"
    assert not NOT_OPTIONS.keys() & option_names(), "a task option is not a non-option"
    undefined = sorted(NOT_OPTIONS.keys() - code_names())
    assert not undefined, f"NOT_OPTIONS names the code does not define: {undefined}"


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("with `sync_periods` = H steps a round", "`sync_periods`"),
        ("(`diloco_exchange: asynchronous`: each group's update", "diloco_exchange"),
        ('unless the task sets `"on_nonfinite": "ignore"`', "on_nonfinite"),
        ("`split_strategy: weighted` shares by speed", "`split_strategy`"),
        (
            "curl -s -H \"$H\" -XPOST $API/tasks -H 'content-type: application/json' "
            '-d \'{"project_id": 1, "resource_groups": [{"name": "a", "gpus": 1}]}\'',
            "`gpus`",
        ),
    ],
)
def test_an_option_the_code_lacks_is_named(line: str, named: str) -> None:
    problems = option_problems(readme() + "\n" + line + "\n")
    assert any(named in problem for problem in problems), problems


def test_option_names_reach_nested_models() -> None:
    assert {"max_local_batch", "num_workers", "speed_factor", "placement"} <= option_names()
