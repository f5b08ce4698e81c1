"""One request for a reporter's logs, metrics and progress (`POST /internal/v1/tasks/{id}/report`):
all three stored in one transaction, a retried report stores its lines once."""

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from tests.backend.scheduling import group, running_task
from tests.conftest import agent_headers

pytestmark = pytest.mark.stack


def _line(seq: int, text: str, attempt: int = 1) -> dict:
    return {
        "attempt": attempt,
        "node": "rank-1",
        "seq": seq,
        "time": "2026-11-29T10:00:00",
        "text": text,
    }


def test_a_report_stores_logs_metrics_and_progress(client: TestClient, session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
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


def test_a_report_is_refused_whole_when_a_part_is_malformed(
    client: TestClient, session: Session
) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    bad = {"lines": [_line(0, "kept?")], "metrics": [{"name": "x", "value": None}]}
    answer = client.post(f"/internal/v1/tasks/{task.id}/report", headers=agent_headers(), json=bad)
    assert answer.status_code == 422
    assert client.get(f"/api/v1/tasks/{task.id}/logs").json() == []
    missing = client.post("/internal/v1/tasks/999999/report", headers=agent_headers(), json={})
    assert missing.status_code == 404
