"""The scheduler's background thread inside the API process."""

import logging
import signal
import threading
from datetime import datetime
from types import FrameType

from backend.core.config import Settings
from backend.core.db import get_engine, get_sessionmaker, utcnow
from backend.scheduler.dispatch import CeleryDispatcher, Dispatcher
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


class SchedulerLoop:
    """Runs `schedule_once` every `scheduler_interval_s` seconds until stopped.

    `started_at` (naive UTC) is when this loop began watching the agents: an
    API restart gives every agent one full heartbeat timeout from then before
    it can be marked offline (`monitor.mark_stale_agents`), whatever its last
    heartbeat before the restart.
    """

    def __init__(self, settings: Settings, dispatcher: Dispatcher | None = None) -> None:
        self.settings = settings
        self.dispatcher = dispatcher or CeleryDispatcher()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self.started_at: datetime = utcnow()

    def start(self) -> None:
        """Start passes; a submission or a release in this process wakes the loop at once."""
        self.started_at = utcnow()
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
        """Stop after the current pass (waits up to 10 s for it)."""
        lifecycle.remove_waker(self.wake)
        _started.discard(self)
        self.request_stop()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_pass()
            except Exception:  # keep scheduling through a transient database error
                log.exception("scheduler pass failed")
            self._wake.wait(self.settings.scheduler_interval_s)
            self._wake.clear()

    def run_pass(self) -> int:
        """One scheduling pass now, on this thread; returns how many tasks were scheduled."""
        # One connection for the whole pass (checked out and pinged once, not per
        # decision); each decision is its own transaction on it.
        with get_engine().connect() as connection, get_sessionmaker()(bind=connection) as session:
            return schedule_once(
                session,
                self.dispatcher,
                heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
                interval_s=self.settings.scheduler_interval_s,
                watching_since=self.started_at,
            )
