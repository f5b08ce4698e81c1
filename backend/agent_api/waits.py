"""Long-polls of a task's state: how an agent learns of a cancellation or a restart within a
second or so without asking every second (docs/architecture.md, "Monitoring").

An agent asks `GET /internal/v1/tasks/{id}/state?status=S&attempt=A&wait_s=W`: the answer
comes as soon as the task's state is no longer (S, A), or after W seconds with it unchanged.
The request waits on the event loop (an `asyncio.Event`), holding neither a thread nor a
database connection. One reader per API process (`StateWaits`) reads the states of every
waited-for task in one query every `TICK_S` seconds, in a worker thread, and wakes the
waiters whose task changed. It reads the database, so a change committed by any API process
(a cancel through the REST API, the scheduler's restart) is seen the same way.
"""

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from anyio import to_thread
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.core.db import get_sessionmaker
from backend.tasks.models import Task

log = logging.getLogger(__name__)
TICK_S = 0.5
"""How often the waited-for tasks' states are read: a change is answered within about this."""
State = tuple[str, int]
Reader = Callable[[list[int]], dict[int, State]]


def task_states(session: Session, task_ids: list[int]) -> dict[int, State]:
    """The (status, attempt) of each of `task_ids` that exists, in one query."""
    if not task_ids:
        return {}
    rows = session.execute(select(Task.id, Task.status, Task.attempt).where(Task.id.in_(task_ids)))
    return {task_id: (status.value, attempt) for task_id, status, attempt in rows}


def read_states(task_ids: list[int]) -> dict[int, State]:
    """`task_states` with a session of its own (the long-polls' reader, in a worker thread)."""
    with get_sessionmaker()() as session:
        return task_states(session, task_ids)


@dataclass(eq=False)
class _Waiter:
    task_id: int
    known: State
    loop: asyncio.AbstractEventLoop
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    latest: State | None = None
    found: bool = True

    def answer(self) -> None:
        """Answer the waiting request (from its own loop, or any thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.changed.set()
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.changed.set)


class StateWaits:
    """The waiting long-polls of one API process, and the reader answering them.

    `read` takes task ids and returns their states (default: one SELECT); tests give
    their own. The reader runs only while someone waits, on the loop of the requests (one
    per loop: uvicorn has one; a test may call the app from two).
    """

    def __init__(self, read: Reader = read_states, tick_s: float = TICK_S) -> None:
        self.read, self.tick_s = read, tick_s
        self._lock = threading.Lock()  # the waiters, added and read on the loops' threads
        self._waiters: dict[int, set[_Waiter]] = {}
        self._readers: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        self._closed = False
        self.reads = 0
        """Queries made (tests, and to see that waiting agents cost one query a tick)."""

    @property
    def waiting(self) -> int:
        with self._lock:
            return sum(len(waiters) for waiters in self._waiters.values())

    def _mine(self, loop: asyncio.AbstractEventLoop) -> dict[int, list[_Waiter]]:
        """The waiters of `loop`, by task."""
        with self._lock:
            found = {
                task_id: [w for w in waiters if w.loop is loop]
                for task_id, waiters in self._waiters.items()
            }
        return {task_id: waiters for task_id, waiters in found.items() if waiters}

    async def wait(self, task_id: int, known: State, timeout_s: float) -> State | None:
        """The task's state once it differs from `known`, or after `timeout_s` seconds its
        state then (`known` if it could not be read); None if there is no such task."""
        if self._closed or timeout_s <= 0:
            return await self._read_one(task_id, known)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(task_id, known, loop)
        with self._lock:
            self._waiters.setdefault(task_id, set()).add(waiter)
        reader = self._readers.get(loop)
        if reader is None or reader.done():
            self._readers[loop] = loop.create_task(self._run(loop))
        try:
            await asyncio.wait_for(waiter.changed.wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                waiters = self._waiters.get(task_id)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[task_id]
        if not waiter.found:
            return None
        return waiter.latest or known

    async def _read_one(self, task_id: int, known: State) -> State | None:
        states = await to_thread.run_sync(self.read, [task_id])
        self.reads += 1
        return states.get(task_id)

    def close(self) -> None:
        """Answer every waiting long-poll now, and from now on every new one at once (the
        process is stopping: its open requests should end without waiting)."""
        self._closed = True
        with self._lock:
            waiting = [w for waiters in self._waiters.values() for w in waiters]
        for waiter in waiting:
            waiter.answer()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._mine(loop) and not self._closed:
            await self.tick()
            await asyncio.sleep(self.tick_s)

    async def tick(self) -> None:
        """Read the states of every task waited for on this loop in one query; wake each
        waiter whose task's state differs from what it knows (or that no longer exists)."""
        mine = self._mine(asyncio.get_running_loop())
        task_ids = sorted(mine)
        if not task_ids:
            return
        try:
            states = await to_thread.run_sync(self.read, task_ids)
        except Exception:  # the database is unreachable: the waits time out with what they know
            log.warning("reading the waited-for tasks' states failed", exc_info=True)
            return
        self.reads += 1
        for task_id, waiters in mine.items():
            state = states.get(task_id)
            for waiter in waiters:
                if state is None:
                    waiter.found = False
                    waiter.answer()
                    continue
                waiter.latest = state
                if state != waiter.known:
                    waiter.answer()


def close_at_exit_signal(waits: StateWaits, loop: asyncio.AbstractEventLoop) -> None:
    """Make the first SIGINT or SIGTERM answer every waiting long-poll at once, before the
    handler installed so far runs (uvicorn's: it then waits up to its grace period for open
    requests, which a 25 s long-poll would otherwise fill). Call from the main thread during
    the app's lifespan startup; elsewhere (a test client's thread) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: object = previous) -> None:
            loop.call_soon_threadsafe(waits.close)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(sig, handler)
