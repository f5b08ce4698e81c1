"""Action names derived from routes (docs/audit.md's table): REST and portal agree."""

import pytest

from backend.audit.actions import Described, describe

ME = 4
# (method, route template, path params, answer body, Location) -> what the log says
CASES = [
    ("POST", "/auth/login", {}, None, None, Described("auth.login")),
    ("POST", "/login", {}, None, "/", Described("auth.login")),
    ("POST", "/logout", {}, None, "/login", Described("auth.logout")),
    ("POST", "/users/me/password", {}, None, None,
     Described("user.change_password", "user", "4")),
    ("POST", "/account/password", {}, None, "/account",
     Described("user.change_password", "user", "4")),
    ("POST", "/users/me/tokens", {}, b'{"id": 9, "name": "ci"}', None,
     Described("token.create", "token", "9")),
    ("POST", "/account/tokens", {}, None, None, Described("token.create", "user", "4")),
    ("DELETE", "/users/me/tokens/{token_id}", {"token_id": "9"}, None, None,
     Described("token.delete", "token", "9")),
    ("POST", "/account/tokens/{token_id}/revoke", {"token_id": "9"}, None, "/account",
     Described("token.delete", "token", "9")),
    ("POST", "/admin/users", {}, None, "/admin/users", Described("user.create")),
    ("POST", "/admin/users/{user_id}", {"user_id": "3"}, None, "/admin/users",
     Described("user.update", "user", "3")),
    ("PATCH", "/users/{user_id}", {"user_id": "3"}, None, None,
     Described("user.update", "user", "3")),
    ("POST", "/projects", {}, None, "/projects/7", Described("project.create", "project", "7")),
    ("POST", "/projects", {}, b'{"id": 7}', None, Described("project.create", "project", "7")),
    ("POST", "/projects/{project_id}/edit", {"project_id": "7"}, None, "/projects/7",
     Described("project.update", "project", "7")),
    ("POST", "/projects/{project_id}/members/{user_id}/remove",
     {"project_id": "7", "user_id": "3"}, None, "/projects/7",
     Described("member.delete", "user", "3")),
    ("POST", "/projects/{project_id}/code-versions/upload", {"project_id": "7"}, None,
     "/projects/7", Described("code_version.create", "project", "7")),
    ("POST", "/projects/{project_id}/tasks", {"project_id": "7"}, None, "/tasks/12",
     Described("task.create", "task", "12")),
    ("POST", "/tasks/{task_id}/retry", {"task_id": "12"}, b'{"id": 13}', None,
     Described("task.retry", "task", "12")),
    ("POST", "/resource-groups", {}, b'{"id": 2, "name": "cpu-a"}', None,
     Described("resource_group.create", "resource_group", "cpu-a")),
    ("POST", "/resource-groups/{name}/state", {"name": "cpu-a"}, None, "/resource-groups",
     Described("resource_group.update", "resource_group", "cpu-a")),
    ("POST", "/resource-groups/agents/{agent_id}/edit", {"agent_id": "5"}, None,
     "/resource-groups", Described("agent.update", "agent", "5")),
    ("PATCH", "/api/v1/agents/{agent_id}", {"agent_id": "5"}, None, None,
     Described("agent.update", "agent", "5")),
    ("GET", "/users", {}, None, None, Described("user.list")),
    ("GET", "/projects/{project_id}", {"project_id": "7"}, None, None,
     Described("project.read", "project", "7")),
    ("GET", "/tasks/{task_id}/logs/stream", {"task_id": "12"}, None, None,
     Described("log.stream", "task", "12")),
    ("GET", "/tasks/{task_id}/checkpoints/{checkpoint_id}/download",
     {"task_id": "12", "checkpoint_id": "3"}, None, None,
     Described("checkpoint.download", "checkpoint", "3")),
    ("POST", None, {}, None, None, Described("unknown")),
]


@pytest.mark.parametrize(("method", "template", "params", "body", "location", "expected"),
                         CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_actions_are_named_from_the_route(method: str, template: str | None, params: dict,
                                          body: bytes | None, location: str | None,
                                          expected: Described) -> None:
    assert describe(method, template, params, actor=ME, body=body,
                    location=location) == expected
