"""The scheduler's background thread inside the API process: on PostgreSQL only the elected
process's thread runs passes (:mod:`backend.scheduler.leader`), the others wait as
candidates; on SQLite the one API process runs them."""

import logging
import signal
import threading
from contextlib import nullcontext
from datetime import datetime
from types import FrameType

from sqlalchemy import make_url
from sqlalchemy.engine import Connection

from backend.core.config import Settings
from backend.core.db import get_engine, get_sessionmaker, utcnow
from backend.scheduler.dispatch import CeleryDispatcher, Dispatcher
from backend.scheduler.leader import Election
from backend.scheduler.service import schedule_once
from backend.tasks import lifecycle

log = logging.getLogger(__name__)
_started: set["SchedulerLoop"] = set()


def stop_all_soon() -> None:
    """Ask every scheduler loop of this process to stop after its current pass, without
    waiting (safe in a signal handler).

    Called at the API's first exit signal: while the server drains its connections
    no heartbeat reaches it, so a scheduler still watching the agents then would
    mark them offline and restart healthy tasks.
    """
    for loop in list(_started):
        loop.request_stop()


EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_at_exit_signal() -> None:
    """Make the first SIGINT or SIGTERM stop this process's schedulers (`stop_all_soon`)
    before the handler installed so far (uvicorn's: stop accepting, drain connections)
    runs. Call from the main thread once the server has installed its handlers (the
    app's lifespan startup); elsewhere (a test client's thread) a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in EXIT_SIGNALS:
        previous = signal.getsignal(sig)
        if getattr(previous, "stops_schedulers", False):
            continue

        def handler(signum: int, frame: FrameType | None, previous: object = previous) -> None:
            stop_all_soon()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        handler.stops_schedulers = True  # type: ignore[attr-defined]
        signal.signal(sig, handler)


def leading() -> bool:
    """Whether this process runs the scheduler now (the leader; on SQLite, a started loop)."""
    return any(loop.leading for loop in list(_started))


class SchedulerLoop:
    """Runs `schedule_once` every `scheduler_interval_s` seconds until stopped.

    On PostgreSQL the loop is a candidate in the scheduler's election (`election`, made at
    `start` unless given): it runs passes only while this process holds the leader's lock,
    each on the lock's own connection, at least every third of `scheduler_lease_s`; else it
    tries for the lock every half period. On SQLite (one API process) it always runs them.

    `started_at` (naive UTC) is when this loop began watching the agents: an
    API restart gives every agent one full heartbeat timeout from then before
    it can be marked offline (`monitor.mark_stale_agents`), whatever its last
    heartbeat before the restart. A process taking the lead over does the same from
    the moment it took the lock (`watching_since`).
    """

    def __init__(
        self,
        settings: Settings,
        dispatcher: Dispatcher | None = None,
        election: Election | None = None,
    ) -> None:
        self.settings = settings
        self.dispatcher = dispatcher or CeleryDispatcher()
        self.election = election
        self.leading = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self.started_at: datetime = utcnow()

    def start(self) -> None:
        """Start passes; a submission or a release in this process wakes the loop at once."""
        self.started_at = utcnow()
        url = self.settings.resolved_database_url()
        if self.election is None and make_url(url).get_backend_name() == "postgresql":
            self.election = Election(url, lease_s=self.settings.scheduler_lease_s)
        lifecycle.add_waker(self.wake)
        _started.add(self)
        self._thread.start()

    def wake(self) -> None:
        """Run a pass now (after a submission or a release)."""
        self._wake.set()

    def request_stop(self) -> None:
        """Stop after the current pass; returns at once."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        """Stop after the current pass (waits up to 10 s for it); the leader's lock is
        released as the thread ends, so another process takes over at once."""
        lifecycle.remove_waker(self.wake)
        _started.discard(self)
        self.request_stop()
        self._thread.join(timeout=10)

    @property
    def watching_since(self) -> datetime:
        """Since when this scheduler has watched the agents: its start, or when this process
        last took the lead, whichever is later."""
        since = self.election.since if self.election is not None else None
        return max(self.started_at, since) if since is not None else self.started_at

    def _run(self) -> None:
        election = self.election
        pause = self.settings.scheduler_interval_s
        if election is not None:
            pause = min(pause, election.lease_s / 3)  # the lock's session never idles a period
        try:
            while not self._stop.is_set():
                connection = None
                if election is not None:
                    connection = election.acquire()
                    self.leading = connection is not None
                    if connection is None:  # another process leads: try again later
                        self._stop.wait(election.retry_s)
                        continue
                self.leading = True
                try:
                    self.run_pass(connection)
                except Exception:  # keep scheduling through a transient database error
                    if election is not None and not election.leading:  # its session ended
                        log.warning("scheduler: lost the lead; a candidate again", exc_info=True)
                    else:
                        log.exception("scheduler pass failed")
                self._wake.wait(pause)
                self._wake.clear()
        finally:
            self.leading = False
            if election is not None:
                election.dispose()

    def run_pass(self, connection: Connection | None = None) -> int:
        """One scheduling pass now, on this thread; returns how many tasks were scheduled.

        On `connection` (the leader's) when given, else on a connection of the pool (a pass
        outside the election: tests and tools).
        """
        # One connection for the whole pass (checked out and pinged once, not per
        # decision); each decision is its own transaction on it.
        scope = nullcontext(connection) if connection is not None else get_engine().connect()
        with scope as bound, get_sessionmaker()(bind=bound) as session:
            return schedule_once(
                session,
                self.dispatcher,
                heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
                interval_s=self.settings.scheduler_interval_s,
                watching_since=self.watching_since,
            )
