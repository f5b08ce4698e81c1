"""The lifecycle is the one place a status changes: the booking's QUEUED -> SCHEDULED is its
change, sub-tasks move by its rules, and its after-commit waker is how the scheduler wakes."""

import ast
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.core.errors import Conflict
from backend.scheduler.service import schedule_next
from backend.tasks import fate, lifecycle
from backend.tasks import service as tasks
from backend.tasks.models import SubTask, SubTaskStatus, TaskEvent, TaskStatus
from contracts.agent_api import Claim, Finished, Ready
from tests.backend.scheduling import agent_named, group, running_task, submit, version

REPO = Path(__file__).resolve().parents[3]


def test_a_change_the_lifecycle_does_not_allow_is_refused_naming_both_statuses() -> None:
    with pytest.raises(Conflict, match="task 7 is SUCCEEDED; it cannot become RUNNING"):
        lifecycle.change(7, TaskStatus.SUCCEEDED, TaskStatus.RUNNING, "late claim")
    scheduled = lifecycle.change(7, TaskStatus.QUEUED, TaskStatus.SCHEDULED, "placed")
    assert not scheduled.has_side_effects
    assert lifecycle.change(7, TaskStatus.RUNNING, TaskStatus.FAILED, "x").releases


def test_the_booked_event_is_the_lifecycle_change(session: Session) -> None:
    group(session, "cpu-a", 2)
    task = submit(session, version(session), [{"name": "cpu-a", "workers": 2}])
    assert schedule_next(session) == task.id
    event = session.scalars(
        select(TaskEvent).where(
            TaskEvent.task_id == task.id, TaskEvent.to_status == TaskStatus.SCHEDULED
        )
    ).one()
    assert (event.from_status, event.kind.value) == (TaskStatus.QUEUED, "status")
    assert event.reason == "attempt 1: allocated parameter server and 2 workers: cpu-a×2"
    session.refresh(task)
    assert (task.status, task.status_reason) == (TaskStatus.SCHEDULED, event.reason)


def test_a_sub_task_moves_only_forward(session: Session) -> None:
    group(session, "cpu-a", 1)
    task = submit(session, version(session), [{"name": "cpu-a", "workers": 1}])
    schedule_next(session)
    sub = session.scalars(select(SubTask).where(SubTask.task_id == task.id)).one()
    lifecycle.move_sub_task(sub, SubTaskStatus.RUNNING)
    lifecycle.move_sub_task(sub, SubTaskStatus.SUCCEEDED, detail="x" * 5000)
    assert len(sub.detail) == 4000
    with pytest.raises(Conflict, match="is SUCCEEDED; it cannot become RUNNING"):
        lifecycle.move_sub_task(sub, SubTaskStatus.RUNNING)
    assert set(lifecycle.ABORTABLE) == {SubTaskStatus.PENDING, SubTaskStatus.RUNNING}


def test_submitting_cancelling_and_retrying_wake_the_scheduler_once_each(session: Session) -> None:
    group(session, "cpu-a", 1)
    woken: list[int] = []
    lifecycle.add_waker(lambda: woken.append(1))
    try:
        task = submit(session, version(session), [{"name": "cpu-a", "workers": 1}])
        assert len(woken) == 1
        tasks.cancel(session, task=task)
        assert len(woken) == 2
        tasks.retry(session, task=task)
        assert len(woken) == 3
    finally:
        lifecycle._wakers.clear()


def _calls(path: Path, names: set[str]) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(
        isinstance(node, ast.Attribute)
        and node.attr in names
        or isinstance(node, ast.Name)
        and node.id in names
        for node in ast.walk(tree)
    )


def test_only_dispatch_publishes_and_only_the_lifecycle_wakes_the_scheduler() -> None:
    backend = sorted((REPO / "backend").rglob("*.py"))
    publishers = [
        str(p.relative_to(REPO)) for p in backend if _calls(p, {"send_task", "apply_async"})
    ]
    assert publishers == ["backend/scheduler/dispatch.py"]
    wakers = [str(p.relative_to(REPO)) for p in backend if _calls(p, {"wake"})]
    # loop.py registers its `wake` with the lifecycle, which calls it after a commit.
    assert wakers == ["backend/scheduler/loop.py", "backend/tasks/lifecycle.py"]


@pytest.mark.parametrize("succeeded", [True, False])
def test_the_same_finished_report_again_changes_nothing(session: Session, succeeded: bool) -> None:
    """The agent's client sends a report again when its answer was lost: the second one is
    answered like the first and changes no status."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    first, second = session.scalars(
        select(SubTask).where(SubTask.task_id == task.id).order_by(SubTask.group_index)
    ).all()
    report = Finished(succeeded=succeeded, cause="user", detail="done" if succeeded else "boom")
    for _ in range(2):
        assert fate.finish(session, sub=first, data=report) is task
    assert first.status is (SubTaskStatus.SUCCEEDED if succeeded else SubTaskStatus.FAILED)
    assert task.status is (TaskStatus.RUNNING if succeeded else TaskStatus.FAILED)
    assert second.status is (SubTaskStatus.RUNNING)


def test_a_task_that_succeeded_has_all_its_progress(session: Session) -> None:
    """A plan's trial times steps and reports no progress: listed as SUCCEEDED at 0 %, it
    looked unfinished. Every task that succeeds is at 100 %; one that fails keeps its own."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    assert task.progress == 0.0
    for part in session.scalars(select(SubTask).where(SubTask.task_id == task.id)).all():
        fate.finish(session, sub=part, data=Finished(succeeded=True, cause="user", detail="ok"))
    assert (task.status, task.progress) == (TaskStatus.SUCCEEDED, 1.0)
    failed = lifecycle.change(8, TaskStatus.RUNNING, TaskStatus.FAILED, "boom").task_values()
    assert "progress" not in failed


def test_a_task_starts_only_when_no_part_still_builds_its_environment(session: Session) -> None:
    group(session, "cpu-a", 1)
    group(session, "cpu-b", 1)
    task = submit(
        session,
        version(session),
        [{"name": "cpu-a", "workers": 1}, {"name": "cpu-b", "workers": 1}],
    )
    assert schedule_next(session) == task.id
    a, b = session.scalars(
        select(SubTask).where(SubTask.task_id == task.id).order_by(SubTask.group_index)
    ).all()
    agents = {p.id: agent_named(session, f"agent-cpu-{'ab'[p.group_index]}") for p in (a, b)}

    def claim(part: SubTask) -> None:
        data = Claim(agent_id=agents[part.id].id, host="h", preparing=True)
        fate.claim(session, sub=part, data=data)

    # cpu-a had it cached: claimed and ready before cpu-b's agent even claimed its part.
    claim(a)
    fate.ready(session, sub=a, data=Ready(detail="environment 0123 cached"))
    session.refresh(task)
    assert task.status is TaskStatus.SCHEDULED and task.started_at is None
    claim(b)
    session.refresh(task)
    assert task.status is TaskStatus.SCHEDULED  # cpu-b builds
    fate.ready(session, sub=b, data=Ready(detail="environment 0123 built in 41.0 s"))
    session.refresh(task)
    assert task.status is TaskStatus.RUNNING and task.started_at is not None
    events = session.scalars(
        select(TaskEvent).where(TaskEvent.task_id == task.id).order_by(TaskEvent.id)
    ).all()
    phases = [e.reason for e in events if e.kind.value == "phase"]
    assert phases == [
        "agent on h prepares group 0 part 0: building the code version's environment",
        "group 0 part 0 prepared: environment 0123 cached",
        "agent on h prepares group 1 part 0: building the code version's environment",
        "group 1 part 0 prepared: environment 0123 built in 41.0 s",
    ]
    # The phase is before the start: the time a task ran does not count the build.
    [running] = [
        e for e in events if e.to_status is TaskStatus.RUNNING and e.kind.value == "status"
    ]
    assert running.created_at >= events[-2].created_at
    # A part that is not preparing (any more) cannot report ready again.
    with pytest.raises(Conflict, match="is not preparing"):
        fate.ready(session, sub=b, data=Ready())
