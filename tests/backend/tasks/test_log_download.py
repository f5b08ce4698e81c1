"""The task log as a text file (`GET /tasks/{id}/logs.txt`): every line in order, read from
the database page by page, one node's lines, the attachment's name, who may download it, and
a node the task does not have."""

import pytest
from fastapi.testclient import TestClient

from backend.tasks import router, service
from tests.backend.conftest import World
from tests.conftest import agent_headers


def _add_lines(client: TestClient, task_id: int, count: int) -> None:
    """`count` lines after the world's own (`rank-1` seq 0), alternating rank-1 and rank-2."""
    lines = [
        {
            "node": f"rank-{1 + i % 2}",
            "seq": 1 + i,
            "time": f"2026-01-01T00:00:{i:02d}.25",
            "text": f"line {i} naïve ✓",
        }
        for i in range(count)
    ]
    client.post(
        f"/internal/v1/tasks/{task_id}/logs", headers=agent_headers(), json={"lines": lines}
    ).raise_for_status()


def test_every_line_in_order_across_database_pages(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, task_id = world.client, world.task["id"]
    _add_lines(client, task_id, 10)
    monkeypatch.setattr(router, "LOG_TEXT_PAGE", 3)
    pages: list[int] = []
    logs = service.logs

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        found = logs(*args, **kwargs)
        pages.append(len(found))
        return found

    monkeypatch.setattr(service, "logs", counted)
    response = client.get(f"/api/v1/tasks/{task_id}/logs.txt")
    assert response.status_code == 200
    assert pages == [3, 3, 3, 2]  # 11 lines, three per query
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    assert response.headers["content-disposition"] == (
        f'attachment; filename="task-{task_id}-logs.txt"'
    )
    lines = response.content.decode("utf-8").splitlines()
    assert lines[0] == "2026-01-01T00:00:00.000Z rank-1   secret line"
    assert lines[1] == "2026-01-01T00:00:00.250Z rank-1   line 0 naïve ✓"
    assert lines[2] == "2026-01-01T00:00:01.250Z rank-2   line 1 naïve ✓"
    assert [line.split(" ", 2)[2].strip() for line in lines] == ["secret line"] + [
        f"line {i} naïve ✓" for i in range(10)
    ]
    json_lines = client.get(f"/api/v1/tasks/{task_id}/logs").json()
    assert [line.split()[1] for line in lines] == [line["node"] for line in json_lines]


def test_one_node_and_its_file_name(world: World) -> None:
    client, task_id = world.client, world.task["id"]
    _add_lines(client, task_id, 6)
    response = client.get(f"/api/v1/tasks/{task_id}/logs.txt", params={"node": "rank-2"})
    assert response.status_code == 200
    assert response.headers["content-disposition"] == (
        f'attachment; filename="task-{task_id}-rank-2-logs.txt"'
    )
    lines = response.text.splitlines()
    assert [line.split(" ", 2)[1] for line in lines] == ["rank-2"] * 3
    texts = [line.split(" ", 2)[2].strip() for line in lines]
    assert texts == [f"line {i} naïve ✓" for i in (1, 3, 5)]


def test_a_spec_node_without_lines_gives_an_empty_file(world: World) -> None:
    response = world.client.get(f"/api/v1/tasks/{world.task['id']}/logs.txt?node=ps")
    assert response.status_code == 200 and response.content == b""


def test_an_unknown_node_is_404_naming_the_tasks_nodes(world: World) -> None:
    task_id = world.task["id"]
    response = world.client.get(f"/api/v1/tasks/{task_id}/logs.txt", params={"node": "rank-9"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["field"] == "node"
    assert error["message"] == (
        f"task {task_id} has no node 'rank-9' (its nodes: ps, rank-1, agent-cpu-a)"
    )


def test_only_who_may_see_the_task_downloads_its_log(world: World) -> None:
    client, task_id = world.client, world.task["id"]
    url = f"/api/v1/tasks/{task_id}/logs.txt"
    refused = client.get(url, headers=world.stranger.headers)
    as_json = client.get(f"/api/v1/tasks/{task_id}/logs", headers=world.stranger.headers)
    assert refused.status_code == as_json.status_code == 404
    assert refused.json() == as_json.json()  # as if the task did not exist
    # a node name gives nothing away either: the task is refused before the node is checked
    assert client.get(url, params={"node": "x"}, headers=world.stranger.headers).json() == (
        as_json.json()
    )
    member = client.get(url, headers=world.member.headers)
    assert member.status_code == 200 and member.text.endswith("rank-1   secret line\n")
    assert world.anonymous.get(url).status_code == 401
