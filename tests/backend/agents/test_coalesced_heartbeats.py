"""Heartbeats written together (backend/agents/stamps.py): an online agent's beat is held in
the API process and written with the others' by one flush, never backwards; the answer
carries the named tasks' states; and what a crash loses cannot time out a live agent."""

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select, update
from sqlalchemy.orm import Session

from backend.agents import stamps as stamps_module
from backend.agents.models import Agent
from backend.agents.stamps import FLUSH_EVERY_S, HeldStamps
from backend.core import dependencies
from backend.core.config import Settings
from backend.core.db import get_engine, utcnow
from backend.scheduler import monitor
from backend.tasks.models import Allocation, NodeRole
from tests.backend.scheduling import group, running_task
from tests.conftest import agent_headers

pytestmark = pytest.mark.stack


def _agents(session: Session) -> dict[str, Agent]:
    session.expire_all()
    return {a.name: a for a in session.scalars(select(Agent))}


def _beat(client: TestClient, agent: Agent, **body: object) -> dict:
    response = client.post(
        f"/internal/v1/agents/{agent.id}/heartbeat", headers=agent_headers(), json=body
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _own_stamps(client: TestClient, *, flushing: bool) -> HeldStamps:
    """Stamps the test holds and flushes itself, in place of the app's: the app's own
    `StampFlusher` (started by the client's lifespan) writes its stamps every second, and on
    a slow host it took a beat's rank stamps between the test's beat and its look at them.
    `flushing`: as while a flusher runs (beats are held), else each beat writes itself."""
    stamps = HeldStamps()
    stamps.flushing = flushing
    client.app.state.stamps = stamps  # type: ignore[attr-defined]
    return stamps


def _age_agents(session: Session, seconds: float) -> None:
    session.execute(update(Agent).values(last_heartbeat_at=utcnow() - timedelta(seconds=seconds)))
    session.commit()


def test_beats_are_held_then_written_in_one_flush(client: TestClient, session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    _age_agents(session, 10)
    before = {name: a.last_heartbeat_at for name, a in _agents(session).items()}
    stamps = _own_stamps(client, flushing=True)  # the test flushes itself
    ranks = sorted(
        r
        for r in session.scalars(
            select(Allocation.rank).where(
                Allocation.task_id == task.id, Allocation.role == NodeRole.COMPUTE
            )
        )
        if r is not None
    )
    agents = _agents(session)
    answer = _beat(client, agents["agent-cpu-a"], running=[{"task_id": task.id, "ranks": ranks}])
    _beat(client, agents["agent-cpu-b"])
    assert answer == {"tasks": [{"task_id": task.id, "status": "RUNNING", "attempt": 1}]}
    # Nothing written yet: both stamps and the ranks' are held.
    assert {n: a.last_heartbeat_at for n, a in _agents(session).items()} == before
    held_agents, held_ranks = stamps.held()
    assert set(held_agents) == {agents["agent-cpu-a"].id, agents["agent-cpu-b"].id}
    assert set(held_ranks) == {(task.id, rank) for rank in ranks}
    assert stamps.flush(session) == (2, len(ranks))
    after = _agents(session)
    assert all(after[n].last_heartbeat_at > before[n] for n in before)
    assert all(after[n].last_heartbeat_at == held_agents[after[n].id] for n in before)
    alive = session.scalars(
        select(Allocation).where(Allocation.task_id == task.id, Allocation.rank.in_(ranks))
    ).all()
    assert alive and all(a.last_heartbeat_at == held_ranks[(task.id, a.rank)] for a in alive)
    assert stamps.held() == ({}, {}) and stamps.flush(session) == (0, 0)
    # A stamp older than the stored one (another API process wrote a newer) never goes back.
    newest = after["agent-cpu-a"].last_heartbeat_at
    stamps.agent(after["agent-cpu-a"].id, newest - timedelta(seconds=3))
    stamps.flush(session)
    assert _agents(session)["agent-cpu-a"].last_heartbeat_at == newest


def test_an_offline_agent_is_online_again_at_once_and_a_deregistered_one_stays_off(
    client: TestClient, session: Session
) -> None:
    group(session, "cpu-a", 2)
    stamps = _own_stamps(client, flushing=True)
    agent = _agents(session)["agent-cpu-a"]
    session.execute(update(Agent).values(online=False))
    session.commit()
    _beat(client, agent)
    assert _agents(session)["agent-cpu-a"].online  # written by the beat itself
    assert stamps.held() == ({}, {})
    _beat(client, agent)  # online: held
    assert agent.id in stamps.held()[0]
    client.post(f"/internal/v1/agents/{agent.id}/deregister", headers=agent_headers())
    assert stamps.held() == ({}, {})  # its held stamp is dropped with it
    stamps.flush(session)
    assert not _agents(session)["agent-cpu-a"].online


def test_without_a_flusher_a_beat_is_written_at_once(client: TestClient, session: Session) -> None:
    """An app whose lifespan did not run (no flusher) writes each beat itself."""
    group(session, "cpu-a", 2)
    _age_agents(session, 10)
    _own_stamps(client, flushing=False)  # each beat writes itself
    agent = _agents(session)["agent-cpu-a"]
    old = agent.last_heartbeat_at
    _beat(client, agent)
    assert _agents(session)["agent-cpu-a"].last_heartbeat_at > old


def test_a_crash_loses_only_the_held_beats_and_no_live_agent_is_timed_out(
    client: TestClient, session: Session
) -> None:
    """The durability argument of docs/architecture.md ("Monitoring"), checked.

    A crash loses what was held since the last flush, at most `FLUSH_EVERY_S` of beats: the
    stored stamp is then the agent's previous flushed beat. Its next beat reaches a live
    process one interval later (after its client's retries); until then the stored stamp is
    at most two intervals, the retries and a flush period old, which is short of the timeout
    less the monitor's scan period. A restarted API judges nothing for a full timeout.
    """
    group(session, "cpu-a", 2)
    stamps = _own_stamps(client, flushing=True)
    agent = _agents(session)["agent-cpu-a"]
    _beat(client, agent)
    stamps.flush(session)
    flushed = _agents(session)["agent-cpu-a"].last_heartbeat_at
    _beat(client, agent)
    crashed = HeldStamps()  # the process died: its held beat is gone, nothing else
    assert crashed.flush(session) == (0, 0)
    assert _agents(session)["agent-cpu-a"].last_heartbeat_at == flushed

    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    interval, timeout = 3.0, settings.heartbeat_timeout_s  # the agent's default interval
    retries = 0.5 + 1.0  # the agent's client: two transport retries to reach a live process
    worst = 2 * interval + retries + FLUSH_EVERY_S
    assert worst < timeout - settings.scheduler_interval_s
    _age_agents(session, worst)  # the oldest the stored stamp gets before the next beat
    assert (
        monitor.mark_stale_agents(
            session, timeout_s=timeout, interval_s=settings.scheduler_interval_s
        )
        == 0
    )
    assert _agents(session)["agent-cpu-a"].online
    # A restarted API (its scheduler just started) judges no agent, however old its stamp.
    _age_agents(session, 10 * timeout)
    assert monitor.check(session, timeout_s=timeout, watching_since=utcnow()) == 0
    assert _agents(session)["agent-cpu-a"].online


def test_an_id_no_column_holds_is_refused_at_the_beat_and_never_held(
    client: TestClient, session: Session
) -> None:
    """A rank or task id beyond INTEGER is refused when it arrives (422): held, it made
    every flush fail and, put back each time, kept every other agent's stamp unwritten."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    agent = _agents(session)["agent-cpu-a"]
    stamps = _own_stamps(client, flushing=True)
    url = f"/internal/v1/agents/{agent.id}/heartbeat"
    for body in (
        {"running": [{"task_id": task.id, "ranks": [2**40]}]},
        {"running": [{"task_id": 2**40, "ranks": [1]}]},
        {"tasks": [2**40]},
    ):
        response = client.post(url, headers=agent_headers(), json=body)
        assert response.status_code == 422, body
    assert stamps.held() == ({}, {})


def test_a_stamp_the_database_refuses_is_dropped_not_held_again(
    client: TestClient, session: Session
) -> None:
    """Whatever gets past the contract and is refused by the database is dropped with its
    batch, so the next flush writes the agents' new beats."""
    group(session, "cpu-a", 2)
    agent = _agents(session)["agent-cpu-a"]
    stamps = HeldStamps()
    stamps.agent(agent.id, utcnow())
    stamps.ranks(1, [2**70], utcnow())  # no INTEGER holds it
    with pytest.raises(Exception):  # noqa: B017 (SQLite: OverflowError; PostgreSQL: DataError)
        stamps.flush(session)
    session.rollback()
    assert stamps.held() == ({}, {})
    _age_agents(session, 10)
    stamps.agent(agent.id, utcnow())
    assert stamps.flush(session) == (1, 0)


def test_a_beat_reads_nothing_while_its_agent_was_seen_online_within_the_timeout(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle online agent's beat makes no database round trip for a liveness timeout after
    its row was read; an agent judged lost meanwhile is online again at the first beat after
    that (at most one timeout late: no verdict can come sooner, docs/architecture.md), and a
    deregistered one's next beat reads its row."""
    group(session, "cpu-a", 2)
    stamps = _own_stamps(client, flushing=True)
    agent = _agents(session)["agent-cpu-a"]
    timeout = Settings(_env_file=None).heartbeat_timeout_s  # type: ignore[call-arg]
    clock = [1000.0]
    monkeypatch.setattr(stamps_module.time, "monotonic", lambda: clock[0])
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", count)
    try:
        _beat(client, agent)  # reads the row: online
        read = len(statements)
        assert read > 0
        clock[0] += timeout / 2
        _beat(client, agent)
        assert len(statements) == read  # held, nothing read
        assert agent.id in stamps.held()[0]
        # Judged lost (another process's monitor) while this one still trusts its read:
        session.execute(update(Agent).where(Agent.id == agent.id).values(online=False))
        session.commit()
        _beat(client, agent)
        assert not _agents(session)["agent-cpu-a"].online  # held: back within a timeout
        clock[0] += timeout / 2
        _beat(client, agent)  # a timeout since the read: read again, online at once
        assert len(statements) > read and _agents(session)["agent-cpu-a"].online
        read = len(statements)
        client.post(f"/internal/v1/agents/{agent.id}/deregister", headers=agent_headers())
        statements.clear()
        _beat(client, agent)
        assert statements  # the deregistered agent's row is read again
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_a_beat_is_stamped_when_it_arrived_not_when_a_thread_took_it_up(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent was alive when its beat reached the API: on a busy process the wait for a
    worker thread is the API's delay, and must not age the agent (nor its ranks)."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    stamps = _own_stamps(client, flushing=True)
    arrived = utcnow() - timedelta(seconds=4)  # as if a thread took the beat up 4 s late
    monkeypatch.setattr(dependencies, "utcnow", lambda: arrived)
    agent = _agents(session)["agent-cpu-a"]
    _beat(client, agent, running=[{"task_id": task.id, "ranks": [1]}])
    held_agents, held_ranks = stamps.held()
    assert held_agents == {agent.id: arrived}
    assert held_ranks == {(task.id, 1): arrived}
