"""One request for a reporter's logs, metrics and progress (`POST /internal/v1/tasks/{id}/report`):
all three stored in one transaction, a retried report stores its lines once."""

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.tasks.models import Task
from tests.backend.scheduling import group, running_task
from tests.conftest import agent_headers

pytestmark = pytest.mark.stack


@pytest.fixture
def task(session: Session) -> Task:
    """A running task of two groups, as an agent's reports meet it."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    return running_task(session)


def _line(seq: int, text: str, attempt: int = 1) -> dict:
    return {
        "attempt": attempt,
        "node": "rank-1",
        "seq": seq,
        "time": "2026-11-29T10:00:00",
        "text": text,
    }


def test_a_report_stores_logs_metrics_and_progress(client: TestClient, task: Task) -> None:
    url = f"/internal/v1/tasks/{task.id}/report"
    report = {
        "lines": [_line(0, "step 0"), _line(1, "step 1")],
        "metrics": [
            {"name": "loss", "value": 0.5, "step": 3, "epoch": 1, "rank": 1},
            {"name": "val_loss", "value": None, "nonfinite": "nan", "step": 3, "epoch": 1},
        ],
        "progress": {"progress": 0.25, "epoch": 1, "attempt": 1},
    }
    answer = client.post(url, headers=agent_headers(), json=report)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"stored": 2}
    assert client.post(url, headers=agent_headers(), json=report).json() == {"stored": 0}
    logs = client.get(f"/api/v1/tasks/{task.id}/logs").json()
    assert [(x["node"], x["seq"], x["text"]) for x in logs] == [
        ("rank-1", 0, "step 0"),
        ("rank-1", 1, "step 1"),
    ]
    metrics = client.get(f"/api/v1/tasks/{task.id}/metrics").json()
    assert {(m["name"], m["rank"], m["value"]) for m in metrics} >= {
        ("loss", 1, 0.5),
        ("val_loss", None, None),
    }
    read = client.get(f"/api/v1/tasks/{task.id}").json()
    assert (read["progress"], read["epoch"]) == (0.25, 1)
    # Only lines, or an earlier attempt's progress (ignored), are reports too.
    late = {"lines": [_line(2, "step 2")], "progress": {"progress": 0.9, "epoch": 2, "attempt": 7}}
    assert client.post(url, headers=agent_headers(), json=late).json() == {"stored": 1}
    assert client.get(f"/api/v1/tasks/{task.id}").json()["progress"] == 0.25


def test_a_report_is_refused_whole_when_a_part_is_malformed(client: TestClient, task: Task) -> None:
    bad = {"lines": [_line(0, "kept?")], "metrics": [{"name": "x", "value": None}]}
    answer = client.post(f"/internal/v1/tasks/{task.id}/report", headers=agent_headers(), json=bad)
    assert answer.status_code == 422
    assert client.get(f"/api/v1/tasks/{task.id}/logs").json() == []
    missing = client.post("/internal/v1/tasks/999999/report", headers=agent_headers(), json={})
    assert missing.status_code == 404


def _metric(seq: int | None, value: float, node: str = "ps", attempt: int = 1) -> dict:
    numbered = {"attempt": attempt, "node": node, "seq": seq} if seq is not None else {}
    return {"name": "step/train_loss", "value": value, "step": seq or 0, "epoch": 1, **numbered}


def test_a_report_sent_again_stores_each_numbered_metric_once(
    client: TestClient, task: Task
) -> None:
    url = f"/internal/v1/tasks/{task.id}/report"
    first = {"metrics": [_metric(0, 0.9), _metric(1, 0.8), _metric(0, 0.7, node="rank-1")]}
    for _ in range(2):  # its answer lost: the reporter sends the same report again
        assert client.post(url, headers=agent_headers(), json=first).status_code == 200
    # The next report carries one value again (a flush that failed midway) and a new one;
    # the next attempt's numbers start at 0 again and are other values.
    later = {"metrics": [_metric(1, 0.8), _metric(2, 0.6), _metric(0, 0.5, attempt=2)]}
    assert client.post(url, headers=agent_headers(), json=later).status_code == 200
    # The same line or value twice in one report is stored once, not refused with a 500.
    twice = {"lines": [_line(5, "again")] * 2, "metrics": [_metric(3, 0.55)] * 2}
    assert client.post(url, headers=agent_headers(), json=twice).json() == {"stored": 1}
    old_agent = {"metrics": [_metric(None, 0.4), _metric(None, 0.4)]}  # unnumbered: as sent
    assert client.post(url, headers=agent_headers(), json=old_agent).status_code == 200
    values = [
        m["value"]
        for m in client.get(f"/api/v1/tasks/{task.id}/metrics").json()
        if m["name"] == "step/train_loss"
    ]
    assert sorted(values) == [0.4, 0.4, 0.5, 0.55, 0.6, 0.7, 0.8, 0.9]


@pytest.mark.parametrize("given", [{"seq": 0}, {"seq": 0, "node": "ps"}, {"attempt": 1}])
def test_a_metric_numbered_in_part_is_refused_naming_the_field(
    client: TestClient, task: Task, given: dict
) -> None:
    metric = {"name": "loss", "value": 0.5, **given}
    answer = client.post(
        f"/internal/v1/tasks/{task.id}/report", headers=agent_headers(), json={"metrics": [metric]}
    )
    assert answer.status_code == 422
    assert "give attempt, node and seq together" in answer.text
    assert [
        m for m in client.get(f"/api/v1/tasks/{task.id}/metrics").json() if m["name"] == "loss"
    ] == []
