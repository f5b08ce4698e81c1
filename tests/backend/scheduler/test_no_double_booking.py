"""No double booking: concurrent submissions and several schedulers on one database.

Eight submitters fire tasks while four schedulers (each its own connection,
as several API processes would be) allocate and a finisher ends tasks; a
checker samples the held workers of every group throughout. Allocations
never exceed capacity, and every task is allocated exactly once.
"""

import random
import threading
import time

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from backend.core import db
from backend.resource_groups.models import ResourceGroup
from backend.scheduler.service import schedule_next
from backend.tasks import lifecycle
from backend.tasks.models import Allocation, NodeRole, Task, TaskEvent, TaskStatus
from tests.backend.scheduling import group, submit, version

CAPACITY = {"cpu-a": 3, "cpu-b": 2, "cpu-c": 4}
SUBMITTERS, PER_SUBMITTER, SCHEDULERS = 8, 12, 4


def _request(rng: random.Random) -> list[dict]:
    kind = rng.choice(["named", "named2", "uniform", "resource_state"])
    if kind == "named":
        return [{"name": rng.choice(list(CAPACITY)), "workers": rng.randint(1, 2)}]
    if kind == "named2":
        return [{"name": "cpu-a", "workers": rng.randint(1, 3)}, {"name": "cpu-b", "workers": 1}]
    return [{"device_type": "cpu", "workers": rng.randint(1, 5), "placement": kind}]


def _held_by_group(session: db.Session) -> dict[str, int]:
    rows = session.execute(
        select(ResourceGroup.name, func.count(Allocation.id))
        .join(Allocation, Allocation.resource_group_id == ResourceGroup.id)
        .where(Allocation.released_at.is_(None), Allocation.role == NodeRole.COMPUTE)
        .group_by(ResourceGroup.name)
    ).all()
    return {name: count for name, count in rows}


class Run:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.peak: dict[str, int] = dict.fromkeys(CAPACITY, 0)
        self.samples = 0

    def guard(self, target, *args):  # type: ignore[no-untyped-def]
        def body() -> None:
            try:
                target(*args)
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)
                self.stop.set()

        return threading.Thread(target=body, daemon=True)


def _submitter(run: Run, seed: int, code_id: int, project_id: int) -> None:
    rng = random.Random(seed)
    with db.get_sessionmaker()() as session:
        code = type("Code", (), {"id": code_id, "project_id": project_id})
        for _ in range(PER_SUBMITTER):
            submit(session, code, _request(rng), priority=rng.randint(-2, 2))


def _scheduler(run: Run) -> None:
    with db.get_sessionmaker()() as session:
        while not run.stop.is_set():
            try:
                if schedule_next(session) is None:
                    time.sleep(0.005)
            except OperationalError:  # a lock timeout or serialisation failure: try again
                session.rollback()


def _finisher(run: Run, seed: int) -> None:
    rng = random.Random(seed)
    with db.get_sessionmaker()() as session:
        while not run.stop.is_set():
            ids = session.scalars(select(Task.id).where(Task.status == TaskStatus.SCHEDULED)).all()
            for task_id in rng.sample(list(ids), k=min(3, len(ids))):
                task = session.get(Task, task_id, with_for_update=True, populate_existing=True)
                if task is not None and task.status is TaskStatus.SCHEDULED:
                    lifecycle.transition(session, task, TaskStatus.SUCCEEDED, "test finisher")
                session.commit()
            time.sleep(0.01)


def _checker(run: Run) -> None:
    with db.get_sessionmaker()() as session:
        while not run.stop.is_set():
            for name, count in _held_by_group(session).items():
                run.peak[name] = max(run.peak[name], count)
            session.commit()
            run.samples += 1


@pytest.mark.stack(only="postgresql")
def test_concurrent_submissions_never_exceed_capacity(session: db.Session) -> None:
    for name, capacity in CAPACITY.items():
        group(session, name, capacity)
    code = version(session)
    run = Run()
    workers = [run.guard(_submitter, run, i, code.id, code.project_id) for i in range(SUBMITTERS)]
    loops = [run.guard(_scheduler, run) for _ in range(SCHEDULERS)]
    loops += [run.guard(_finisher, run, 99), run.guard(_checker, run)]
    for thread in workers + loops:
        thread.start()
    for thread in workers:
        thread.join(timeout=120)
    total = SUBMITTERS * PER_SUBMITTER
    deadline = time.monotonic() + 120
    while (
        session.scalar(select(func.count(Task.id)).where(Task.status == TaskStatus.SUCCEEDED))
        < total
        and not run.stop.is_set()
    ):
        assert time.monotonic() < deadline, "tasks were left unscheduled"
        time.sleep(0.1)
        session.commit()
    run.stop.set()
    for thread in loops:
        thread.join(timeout=30)
    assert not run.errors, run.errors
    assert run.samples > 50
    assert all(run.peak[name] <= CAPACITY[name] for name in CAPACITY), run.peak
    assert any(run.peak[name] == CAPACITY[name] for name in CAPACITY), run.peak  # it was busy
    scheduled = session.execute(
        select(TaskEvent.task_id, func.count(TaskEvent.id))
        .where(TaskEvent.to_status == TaskStatus.SCHEDULED)
        .group_by(TaskEvent.task_id)
    ).all()
    assert len(scheduled) == total and all(count == 1 for _, count in scheduled)
    for task in session.scalars(select(Task)):
        compute = session.scalar(
            select(func.count(Allocation.id)).where(
                Allocation.task_id == task.id, Allocation.role == NodeRole.COMPUTE
            )
        )
        assert compute == sum(g["workers"] for g in task.spec["groups"])
