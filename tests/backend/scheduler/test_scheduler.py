"""The scheduler on a real database: queue order, gang allocation, placement policies."""

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.scheduler import placement
from backend.scheduler.booking import allocate
from backend.scheduler.capacity import free_capacity
from backend.scheduler.queue import queue_head
from backend.scheduler.service import schedule_next, schedule_once
from backend.tasks import lifecycle
from backend.tasks.models import Allocation, SubTask, Task, TaskEvent, TaskStatus
from contracts.plan import GroupPlan
from tests.backend.scheduling import (
    RecordingDispatcher,
    add_agent,
    agent_named,
    finish,
    group,
    held,
    submit,
    version,
)

pytestmark = pytest.mark.stack


def test_queue_is_priority_then_age(session: Session) -> None:
    group(session, "cpu-a", 1)
    code = version(session)
    low = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    high1 = submit(session, code, [{"name": "cpu-a", "workers": 1}], priority=5)
    high2 = submit(session, code, [{"name": "cpu-a", "workers": 1}], priority=5)
    order = []
    for _ in range(3):
        task_id = schedule_next(session)
        assert task_id is not None
        order.append(task_id)
        assert schedule_next(session) is None  # the group is full
        finish(session, session.get(Task, task_id))
    assert order == [high1.id, high2.id, low.id]


def test_gang_allocation_holds_nothing_partial_and_backfills(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    code = version(session)
    blocker = submit(session, code, [{"name": "cpu-b", "workers": 1}], priority=9)
    assert schedule_next(session) == blocker.id
    big = submit(
        session,
        code,
        [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        priority=5,
    )
    small = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    assert schedule_next(session) == small.id  # big waits for cpu-b: no partial hold
    assert session.scalars(select(Allocation).where(Allocation.task_id == big.id)).all() == []
    assert (held(session, "cpu-a"), held(session, "cpu-b")) == (1, 1)
    finish(session, blocker)
    finish(session, small)
    assert schedule_next(session) == big.id
    assert (held(session, "cpu-a"), held(session, "cpu-b")) == (2, 1)
    roles = sorted(
        a.role.value
        for a in session.scalars(select(Allocation).where(Allocation.task_id == big.id))
    )
    assert roles == ["compute"] * 3 + ["parameter_server", "task_manager"]


def test_booking_writes_every_node_sub_task_and_event_of_the_decision(session: Session) -> None:
    """The rows a decision books, the same on SQLite and on PostgreSQL (one statement there):
    a group's workers split into parts across its agents, the roomiest first."""
    a, b = group(session, "cpu-a", 3, online=1), group(session, "cpu-b", 1)
    a2 = add_agent(session, a, "a2", workers=2)
    code = version(session)
    task = submit(session, code, [{"name": "cpu-a", "workers": 3}, {"name": "cpu-b", "workers": 1}])
    assert schedule_next(session) == task.id
    session.refresh(task)
    assert task.status is TaskStatus.SCHEDULED
    assert task.status_reason == (
        "attempt 1: allocated parameter server and 4 workers: cpu-a×3, cpu-b×1"
    )
    assert [(g["name"], g["workers"]) for g in task.spec["groups"]] == [("cpu-a", 3), ("cpu-b", 1)]
    nodes = session.scalars(
        select(Allocation)
        .where(Allocation.task_id == task.id)
        .order_by(Allocation.rank.nulls_first())
    ).all()
    rows = [(n.role.value, n.resource_group_id, n.rank, n.attempt, n.released_at) for n in nodes]
    assert rows == [
        ("task_manager", a.id, None, 1, None),
        ("parameter_server", a.id, 0, 1, None),
        ("compute", a.id, 1, 1, None),
        ("compute", a.id, 2, 1, None),
        ("compute", a.id, 3, 1, None),
        ("compute", b.id, 4, 1, None),
    ]
    subs = session.scalars(
        select(SubTask).where(SubTask.task_id == task.id).order_by(SubTask.first_rank)
    ).all()
    a1, b1 = agent_named(session, "agent-cpu-a"), agent_named(session, "agent-cpu-b")
    assert [
        (
            s.resource_group_id,
            s.group_index,
            s.part,
            s.first_rank,
            s.workers,
            s.hosts_parameter_server,
            s.status.value,
            s.agent_id,
            s.dispatched_at,
        )
        for s in subs
    ] == [
        (a.id, 0, 0, 1, 2, True, "PENDING", a2.id, None),
        (a.id, 0, 1, 3, 1, False, "PENDING", a1.id, None),
        (b.id, 1, 0, 4, 1, False, "PENDING", b1.id, None),
    ]
    events = session.scalars(
        select(TaskEvent).where(TaskEvent.task_id == task.id).order_by(TaskEvent.id)
    ).all()
    assert [(e.from_status, e.to_status, e.reason) for e in events][-1] == (
        TaskStatus.QUEUED,
        TaskStatus.SCHEDULED,
        task.status_reason,
    )


def test_the_parameter_server_s_other_shards_are_booked_after_the_workers(
    session: Session,
) -> None:
    """With `ps_shards` 3 the parameter server holds rank 0 and ranks W + 1, W + 2, on the
    first group, so their resource samples are kept (SQLite and PostgreSQL alike)."""
    a, b = group(session, "cpu-a", 2), group(session, "cpu-b", 1)
    code = version(session)
    request = [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}]
    task = submit(session, code, request, sync_strategy="periodic", ps_shards=3)
    assert schedule_next(session) == task.id
    nodes = session.scalars(
        select(Allocation).where(Allocation.task_id == task.id).order_by(Allocation.rank)
    ).all()
    servers = [(n.resource_group_id, n.rank) for n in nodes if n.role.value == "parameter_server"]
    assert servers == [(a.id, 0), (a.id, 4), (a.id, 5)]
    compute = [(n.resource_group_id, n.rank) for n in nodes if n.role.value == "compute"]
    assert compute == [(a.id, 1), (a.id, 2), (b.id, 3)]


def test_a_task_no_longer_queued_is_not_booked(session: Session) -> None:
    group(session, "cpu-a", 1)
    code = version(session)
    task = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    queued = queue_head(session)[0]
    free = free_capacity(session)
    session.rollback()
    lifecycle.transition(session, task, TaskStatus.CANCELLED, "test")
    session.commit()
    chosen = [GroupPlan(name="cpu-a", device_type="cpu", workers=1)]
    assert allocate(session, queued, chosen, free) is None
    assert session.scalars(select(Allocation).where(Allocation.task_id == task.id)).all() == []
    assert session.scalars(select(SubTask).where(SubTask.task_id == task.id)).all() == []


def test_capacity_follows_online_agents(session: Session) -> None:
    group(session, "cpu-a", 4, online=1)
    code = version(session)
    submit(session, code, [{"name": "cpu-a", "workers": 2}])
    assert schedule_next(session) is None


def test_uniform_spreads_over_every_group_of_the_device_type(session: Session) -> None:
    for name, capacity in (("cpu-a", 4), ("cpu-b", 4), ("cpu-c", 2)):
        group(session, name, capacity)
    group(session, "gpu-a", 4, device_type="cuda")
    code = version(session)
    task = submit(session, code, [{"device_type": "cpu", "workers": 5, "placement": "uniform"}])
    assert task.spec["groups"] == []
    schedule_next(session)
    session.refresh(task)
    assert {g["name"]: g["workers"] for g in task.spec["groups"]} == {
        "cpu-a": 2,
        "cpu-b": 2,
        "cpu-c": 1,
    }


def test_resource_state_takes_largest_free_group_first(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 4)
    group(session, "cpu-c", 3)
    code = version(session)
    task = submit(
        session, code, [{"device_type": "cpu", "workers": 5, "placement": "resource_state"}]
    )
    schedule_next(session)
    session.refresh(task)
    assert [(g["name"], g["workers"]) for g in task.spec["groups"]] == [("cpu-b", 4), ("cpu-c", 1)]


def test_labels_select_groups(session: Session) -> None:
    group(session, "cpu-a", 4, labels={"zone": "a"})
    group(session, "cpu-b", 4, labels={"zone": "b"})
    code = version(session)
    task = submit(session, code, [{"device_type": "cpu", "workers": 3, "labels": {"zone": "b"}}])
    schedule_next(session)
    session.refresh(task)
    assert task.spec["groups"] == [{"name": "cpu-b", "device_type": "cpu", "workers": 3}]


def test_policies_in_isolation() -> None:
    assert placement.uniform(7, {"a": 2, "b": 5, "c": 5}) == {"a": 2, "b": 3, "c": 2}
    assert placement.uniform(2, {"a": 1, "b": 5, "c": 3}) == {"b": 1, "c": 1}
    assert placement.largest_first(6, {"a": 2, "b": 5, "c": 5}) == {"b": 5, "c": 1}


def test_decision_reads_a_bounded_window_of_the_queue(session: Session) -> None:
    group(session, "cpu-a", 1)
    code = version(session)
    for _ in range(40):
        submit(session, code, [{"name": "cpu-a", "workers": 1}])
    assert len(queue_head(session)) == 32


def test_pass_dispatches_one_message_per_group_with_sub_task_id(session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    code = version(session)
    task = submit(session, code, [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}])
    dispatcher = RecordingDispatcher()
    assert schedule_once(session, dispatcher, heartbeat_timeout_s=15) == 1
    subs = session.scalars(
        select(SubTask).where(SubTask.task_id == task.id).order_by(SubTask.group_index)
    ).all()
    assert [p.sub_task_id for p in dispatcher.sent] == [s.id for s in subs]
    assert [p.ranks for p in dispatcher.sent] == [[1, 2], [3]]
    assert all(s.dispatched_at for s in subs)
    assert schedule_once(session, dispatcher, heartbeat_timeout_s=15) == 0
    assert len(dispatcher.sent) == 2  # published once


def test_unpublished_message_is_sent_on_a_later_pass(session: Session) -> None:
    group(session, "cpu-a", 1)
    code = version(session)
    task = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    schedule_once(session, RecordingDispatcher(fail=True), heartbeat_timeout_s=15)
    session.refresh(task)
    assert task.status is TaskStatus.SCHEDULED
    dispatcher = RecordingDispatcher()
    schedule_once(session, dispatcher, heartbeat_timeout_s=15)
    assert [p.task_id for p in dispatcher.sent] == [task.id]


def test_dependent_starts_only_after_its_dependency_succeeded(session: Session) -> None:
    group(session, "cpu-a", 2)
    code = version(session)
    first = submit(session, code, [{"name": "cpu-a", "workers": 1}])
    second = submit(
        session, code, [{"name": "cpu-a", "workers": 1}], priority=10, depends_on=[first.id]
    )
    assert second.waiting
    assert schedule_next(session) == first.id  # the dependent waits despite its priority
    assert schedule_next(session) is None
    finish(session, first)
    session.refresh(second)
    assert not second.waiting
    assert schedule_next(session) == second.id
