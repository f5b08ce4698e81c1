"""Time to finish on every task (`eta_s`, `predicted_finish_at` on GET /api/v1/tasks/{id}):
from the pace of the attempt's measured steps, reported by the agents' progress reports."""

from datetime import datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.tasks import lifecycle, models, reports
from backend.tasks.models import Task, TaskStatus
from tests.backend.scheduling import group, running_task
from tests.conftest import agent_headers

pytestmark = pytest.mark.stack
T0 = datetime(2026, 11, 26, 8, 0, 0)


def _report(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, task: Task, at: datetime, progress: float
) -> None:
    monkeypatch.setattr(reports, "utcnow", lambda: at)
    response = client.post(
        f"/internal/v1/tasks/{task.id}/progress",
        headers=agent_headers(),
        json={"progress": progress, "epoch": 0},
    )
    assert response.status_code == 204, response.text


def _running(session: Session, **extra: Any) -> Task:
    """A RUNNING task across the groups cpu-a ×2 and cpu-b ×1, made here."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    return running_task(session, **extra)


def _read(client: TestClient, task: Task) -> dict:
    response = client.get(f"/api/v1/tasks/{task.id}")
    assert response.status_code == 200
    return dict(response.json())


def test_eta_follows_the_pace_of_measured_steps(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _running(session)
    assert _read(client, task)["eta_s"] is None  # no step measured yet
    _report(client, monkeypatch, task, T0, 0.10)  # the first step, long after the start
    assert _read(client, task)["eta_s"] is None  # one report: no pace yet
    _report(client, monkeypatch, task, T0 + timedelta(seconds=30), 0.25)
    _report(client, monkeypatch, task, T0 + timedelta(seconds=60), 0.40)
    # 0.30 of the task in 60 s: the remaining 0.60 take 120 s after the last report.
    monkeypatch.setattr(models, "utcnow", lambda: T0 + timedelta(seconds=90))  # the API's now
    read = _read(client, task)
    assert read["predicted_finish_at"] == "2026-11-26T08:03:00Z"
    assert read["eta_s"] == pytest.approx(90.0)
    session.refresh(task)
    eta, finish = task.finish_estimate(T0 + timedelta(seconds=90))
    assert eta == pytest.approx(90.0) and finish == T0 + timedelta(seconds=180)
    # Slower steps move the prediction: 0.10 more in 90 s, so 0.40 in 150 s since the first
    # step, and the remaining 0.50 take 187.5 s.
    _report(client, monkeypatch, task, T0 + timedelta(seconds=150), 0.50)
    session.refresh(task)
    assert task.finish_estimate(T0 + timedelta(seconds=150))[0] == pytest.approx(187.5)


def test_a_restart_starts_a_new_pace_and_an_ended_task_has_finished(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _running(session, max_restarts=1)
    _report(client, monkeypatch, task, T0, 0.10)
    _report(client, monkeypatch, task, T0 + timedelta(seconds=10), 0.20)
    session.refresh(task)  # the reports came through the API's own session
    assert lifecycle.restart_or_fail(session, task, "agent lost")
    session.commit()
    session.refresh(task)
    assert task.status is TaskStatus.QUEUED and task.finish_estimate(T0) == (None, None)
    assert task.pace_start_at is None
    task.status, task.finished_at = TaskStatus.SUCCEEDED, T0 + timedelta(seconds=99)
    session.commit()
    read = _read(client, task)
    assert read["eta_s"] == 0.0 and read["predicted_finish_at"] == "2026-11-26T08:01:39Z"


def test_a_late_report_of_an_earlier_attempt_is_ignored(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _running(session, max_restarts=1)
    assert lifecycle.restart_or_fail(session, task, "agent lost")
    session.commit()
    monkeypatch.setattr(reports, "utcnow", lambda: T0)
    response = client.post(
        f"/internal/v1/tasks/{task.id}/progress",
        headers=agent_headers(),
        json={"progress": 0.6, "epoch": 3, "attempt": 1},  # sent after the restart
    )
    assert response.status_code == 204
    session.refresh(task)
    assert task.attempt == 2 and task.progress != 0.6 and task.pace_start_at is None


def test_no_estimate_once_the_predicted_finish_has_passed_or_the_task_failed() -> None:
    task = Task(
        spec={},
        status=TaskStatus.RUNNING,
        progress=0.5,
        pace_start_at=T0,
        pace_start_progress=0.1,
        progress_at=T0 + timedelta(seconds=40),
    )
    assert task.finish_estimate(T0 + timedelta(seconds=50)) == (
        pytest.approx(40.0),
        T0 + timedelta(seconds=90),
    )
    # The reports stopped (an agent died, a long validation): no "0 s left" for ever.
    assert task.finish_estimate(T0 + timedelta(seconds=91)) == (None, None)
    task.status = TaskStatus.FAILED
    assert task.finish_estimate(T0) == (None, None)
