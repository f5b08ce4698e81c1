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
    client: TestClient,
    monkeypatch: pytest.MonkeyPatch,
    task: Task,
    at: datetime,
    progress: float,
    epoch: int = 0,
) -> None:
    monkeypatch.setattr(reports, "utcnow", lambda: at)
    response = client.post(
        f"/internal/v1/tasks/{task.id}/progress",
        headers=agent_headers(),
        json={"progress": progress, "epoch": epoch},
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


def test_once_an_epoch_has_ended_the_pace_spans_whole_epochs_with_their_ends(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 epochs of 10 s of steps each, and each epoch's end (validation, checkpoint) 6 s:
    the pace of steps alone would say 10 s an epoch; the task's rest takes 16 s an epoch."""
    task = _running(session, epochs=4)
    _report(client, monkeypatch, task, T0, 0.025)  # the first step of epoch 0
    _report(client, monkeypatch, task, T0 + timedelta(seconds=9), 0.25)  # epoch 0's last step
    # Epoch 0's end took 6 s; the first report of epoch 1 comes 1 s of steps later.
    _report(client, monkeypatch, task, T0 + timedelta(seconds=16), 0.275, epoch=1)
    _report(client, monkeypatch, task, T0 + timedelta(seconds=20), 0.375, epoch=1)
    session.refresh(task)
    assert (task.pace_epoch_at, task.pace_epoch_progress) == (T0 + timedelta(seconds=16), 0.275)
    # 0.25 of the task (one epoch and its end) in 16 s: the remaining 0.625 take 40 s from
    # the latest report (a pace of steps alone, 0.35 in 20 s, would say 35.7 s).
    now = T0 + timedelta(seconds=20)
    assert task.finish_estimate(now)[0] == pytest.approx(40.0)
    # A later report in the same epoch does not move the mark; the next epoch's first does.
    _report(client, monkeypatch, task, T0 + timedelta(seconds=24), 0.475, epoch=1)
    _report(client, monkeypatch, task, T0 + timedelta(seconds=33), 0.525, epoch=2)
    session.refresh(task)
    assert task.pace_epoch_progress == 0.525
    assert task.finish_estimate(now + timedelta(seconds=13))[0] == pytest.approx(33 / 0.5 * 0.475)


def test_a_pace_started_mid_epoch_starts_again_at_the_next_epoch(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumed at 90 % of epoch 0 of 4: the span to epoch 1's first report holds a tenth of
    an epoch's steps and a whole epoch's end, which would make every epoch look 4 times as
    long; the pace starts again at that report instead."""
    task = _running(session, epochs=4)
    _report(client, monkeypatch, task, T0, 0.225)  # 90 % of epoch 0 (0.25 of the task)
    _report(client, monkeypatch, task, T0 + timedelta(seconds=7), 0.26, epoch=1)
    session.refresh(task)
    assert task.pace_epoch_at is None and task.pace_start_progress == 0.26
    _report(client, monkeypatch, task, T0 + timedelta(seconds=11), 0.36, epoch=1)
    session.refresh(task)
    # 0.10 in 4 s: the remaining 0.64 take 25.6 s (the steps' pace until the next mark)
    assert task.finish_estimate(T0 + timedelta(seconds=11))[0] == pytest.approx(25.6)


def test_remaining_s_takes_the_pace_to_the_latest_epoch_mark_or_else_the_latest_report() -> None:
    assert models.remaining_s((0.0, 0.1), (10.0, 0.3)) == pytest.approx(35.0)
    assert models.remaining_s((0.0, 0.1), (10.0, 0.3), 8.0, 0.2) == pytest.approx(56.0)
    # A mark at or before the first report (the pace restarted after it) is not a span.
    assert models.remaining_s((5.0, 0.2), (15.0, 0.4), 4.0, 0.2) == pytest.approx(30.0)


def test_a_restart_starts_a_new_pace_and_an_ended_task_has_finished(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = _running(session, max_restarts=1, epochs=10)
    _report(client, monkeypatch, task, T0, 0.10)
    _report(client, monkeypatch, task, T0 + timedelta(seconds=10), 0.20, epoch=1)
    session.refresh(task)  # the reports came through the API's own session
    assert task.pace_epoch_at == T0 + timedelta(seconds=10)
    assert lifecycle.restart_or_fail(session, task, "agent lost")
    session.commit()
    session.refresh(task)
    assert task.status is TaskStatus.QUEUED and task.finish_estimate(T0) == (None, None)
    assert task.pace_start_at is None and task.pace_epoch_at is None
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
