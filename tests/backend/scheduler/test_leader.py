"""The scheduler's election among API processes (backend/scheduler/leader.py), on PostgreSQL:
one candidate wins; when the winner's session ends (its connection dropped, or it stayed
silent a lease period) another wins, and the former leader can neither write nor win back
while the other holds the lock. On SQLite the one process always leads.

No test waits on a clock: each waits for its condition, with a generous bound for a hung
run. That a takeover comes within two lease periods is argued in docs/architecture.md.
"""

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from backend.core.config import get_settings
from backend.prometheus import render_metrics
from backend.scheduler.leader import (
    LEADING_SESSION_PARAMS,
    LEADING_SESSION_SQL,
    Election,
    NotLeader,
    SqliteInUse,
    hold_sqlite,
    leader_pid_in,
    process_name,
)
from backend.scheduler.loop import SchedulerLoop
from tests.backend.scheduling import RecordingDispatcher

PATIENCE_S = 60.0
LEASE_S = 0.5


def wait_until(what: str, done: Callable[[], object]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {PATIENCE_S} s"
        time.sleep(0.02)


def _admin() -> psycopg.Connection:
    url = get_settings().resolved_database_url().replace("postgresql+psycopg", "postgresql")
    return psycopg.connect(url, autocommit=True)


def _holder() -> str | None:
    """The application_name of the session holding the leader's lock in this database."""
    with _admin() as conn:
        row = conn.execute(LEADING_SESSION_SQL, LEADING_SESSION_PARAMS).fetchone()
    return str(row[0]) if row else None


def test_the_leading_pid_is_read_from_the_sessions_name_unless_it_was_cut() -> None:
    assert leader_pid_in(process_name()) == os.getpid()
    assert leader_pid_in(f"polytrain scheduler {'h' * 60}:12345"[:63]) is None  # cut off
    assert leader_pid_in("polytrain scheduler host:") is None


@pytest.fixture
def candidates(service_env: Path, db_backend: str) -> Iterator[tuple[Election, Election]]:
    url = get_settings().resolved_database_url()
    a, b = (Election(url, lease_s=LEASE_S, name=n) for n in ("candidate a", "candidate b"))
    yield a, b
    a.dispose()
    b.dispose()


@pytest.mark.stack(only="postgresql")
def test_one_candidate_wins_and_the_other_takes_over_when_its_session_is_dropped(
    candidates: tuple[Election, Election],
) -> None:
    a, b = candidates
    won = a.acquire()
    assert won is not None and a.leading and _holder() == "candidate a"
    assert b.acquire() is None and not b.leading  # the lock is taken: b stays a candidate
    assert a.acquire() is won  # the leader keeps its one connection

    # The leader's connection drops (its process died, the network cut it): the server ends
    # the session, and the lock with it; the next try of the other candidate wins.
    pid = won.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with _admin() as admin:  # waits until the session has ended
        assert admin.execute("SELECT pg_terminate_backend(%s, 30000)", (pid,)).fetchone() == (True,)
    assert b.acquire() is not None and _holder() == "candidate b"

    # The former leader finds out at its next statement, and can write nothing more: the
    # reconnection SQLAlchemy makes goes through the election first, and loses.
    refused = "another API process runs the scheduler"
    with pytest.raises(Exception) as lost:  # the server's word, or the reconnection refused
        won.execute(text("SELECT 1"))
    assert "terminat" in str(lost.value) or refused in str(lost.value)
    won.rollback()
    with pytest.raises(Exception, match=refused) as again:
        won.execute(text("SELECT 1"))
    assert isinstance(again.value, NotLeader) or isinstance(again.value.orig, NotLeader)  # type: ignore[attr-defined]
    assert not a.leading and a.acquire() is None and _holder() == "candidate b"

    b.release()  # a stopping process hands over at once
    assert a.acquire() is not None and _holder() == "candidate a"


@pytest.mark.stack(only="postgresql")
def test_a_silent_leader_loses_the_lock_after_a_lease_period(
    candidates: tuple[Election, Election],
) -> None:
    """A stalled (or partitioned) leader sends nothing: the server ends its session one lease
    period after its last statement (idle_session_timeout), and another candidate wins."""
    a, b = candidates
    stalled = a.acquire()
    assert stalled is not None
    wait_until("b takes over from the silent leader", lambda: b.acquire() is not None)
    assert _holder() == "candidate b"
    with pytest.raises(Exception, match="idle-session timeout"):
        stalled.execute(text("SELECT 1"))  # it wakes up: its session is gone, it learns so
    assert a.acquire() is None


@pytest.mark.stack(only="postgresql")
def test_two_scheduler_loops_one_leads_and_the_other_takes_over_when_it_stops(
    service_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLYTRAIN_SCHEDULER_LEASE_S", str(LEASE_S))
    get_settings.cache_clear()
    url = get_settings().resolved_database_url()
    loops = [
        SchedulerLoop(
            get_settings(),
            RecordingDispatcher(),
            Election(url, lease_s=LEASE_S, name=f"loop {i}"),
        )
        for i in range(2)
    ]
    for loop in loops:
        loop.start()
    try:
        wait_until("a loop leads", lambda: any(loop.leading for loop in loops))
        first = next(i for i, loop in enumerate(loops) if loop.leading)
        for _ in range(10):  # a few of the candidate's tries: it never leads meanwhile
            assert [loop.leading for loop in loops].count(True) == 1
            assert _holder() == f"loop {first}"
            time.sleep(LEASE_S / 4)
        here = f'polytrain_scheduler_leader{{process="{socket.gethostname()}:{os.getpid()}"}} 1.0'
        assert here in render_metrics().decode()
        loops[first].stop()  # a stopping API process closes the lock's connection
        wait_until("the other loop leads", lambda: loops[1 - first].leading)
        assert _holder() == f"loop {1 - first}"
    finally:
        for loop in loops:
            loop.stop()
    assert 'polytrain_scheduler_leader{process="' in render_metrics().decode()
    assert not any(loop.leading for loop in loops)


def test_on_sqlite_the_one_loop_leads_and_a_second_api_process_is_refused(
    service_env: Path,
) -> None:
    loop = SchedulerLoop(get_settings(), RecordingDispatcher())
    loop.start()
    try:
        wait_until("the loop leads", lambda: loop.leading)
        assert loop.election is None
    finally:
        loop.stop()
    url = get_settings().resolved_database_url()
    held = hold_sqlite(url)
    assert held is not None
    try:
        with pytest.raises(SqliteInUse, match=f"another API process \\(pid {os.getpid()}\\)"):
            hold_sqlite(url)
    finally:
        os.close(held)  # its holder is gone (a dead process's lock goes with it)
    again = hold_sqlite(url)
    assert again is not None
    os.close(again)
