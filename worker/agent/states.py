"""What the agent knows of its tasks' states, and how it learns of a change without polling
(docs/architecture.md, "Monitoring").

Two channels feed `TaskStates`: each running part's long-poll of its task's state
(`StateWatch`: `GET /tasks/{id}/state?status=&attempt=&wait_s=`, answered by the API as soon
as the state changes, else after `STATE_WAIT_S`), and every heartbeat's answer (the states
of the tasks the agent named). A part's runner reads the state from here, never from a
request of its own.
"""

import logging
import threading
from collections import Counter
from collections.abc import Callable

import httpx

from contracts.agent_api import ACTIVE_STATUSES, STATE_WAIT_S
from worker.agent.client import InternalApi

log = logging.getLogger(__name__)
State = tuple[str, int]
_ORDER = {"QUEUED": 0, "SCHEDULED": 1, "RUNNING": 2}
"""A task's statuses in the order one attempt passes them; any other (RESTARTING, an end)
comes last. A restart queues the next attempt, so (attempt, this order) never goes back."""


def _rank(state: State) -> tuple[int, int]:
    status, attempt = state
    return attempt, _ORDER.get(status, 3)


def stop_reason(state: State | None, attempt: int) -> str | None:
    """Why a part of `attempt` must stop in `state` ("task is S in attempt A"), or None (also
    for a state of an earlier attempt: what is known is behind, not a reason to stop)."""
    if state is None or state[1] < attempt or (state[0] in ACTIVE_STATUSES and state[1] == attempt):
        return None
    return f"task is {state[0]} in attempt {state[1]}"


class TaskStates:
    """The latest (status, attempt) known of each task the agent runs a part of.

    Thread-safe. A state older than the one known (an answer that was overtaken, e.g. a
    heartbeat's read before a cancel that a long-poll already brought) is ignored, so a
    change once seen is never undone.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._known: dict[int, State] = {}
        self._watched: Counter[int] = Counter()

    def watch(self, task_id: int) -> None:
        with self._changed:
            self._watched[task_id] += 1

    def unwatch(self, task_id: int) -> None:
        with self._changed:
            self._watched[task_id] -= 1
            if self._watched[task_id] <= 0:
                del self._watched[task_id]
                self._known.pop(task_id, None)

    def watched(self) -> list[int]:
        """The tasks the agent runs a part of now (named in its heartbeats)."""
        with self._changed:
            return sorted(self._watched)

    def get(self, task_id: int) -> State | None:
        with self._changed:
            return self._known.get(task_id)

    def set(self, task_id: int, status: str, attempt: int) -> None:
        """Learn a task's state (ignored for a task not watched, or older than the known)."""
        with self._changed:
            if task_id not in self._watched:
                return
            known = self._known.get(task_id)
            if known is not None and _rank((status, attempt)) < _rank(known):
                return
            self._known[task_id] = (status, attempt)
            self._changed.notify_all()

    def update(self, states: dict[int, State]) -> None:
        for task_id, (status, attempt) in states.items():
            self.set(task_id, status, attempt)

    def wait_for(
        self, task_id: int, done: Callable[[State | None], bool], timeout_s: float
    ) -> State | None:
        """Wait up to `timeout_s` seconds until `done(state)` holds; the state then."""
        with self._changed:
            self._changed.wait_for(lambda: done(self._known.get(task_id)), timeout_s)
            return self._known.get(task_id)


class StateWatch:
    """A part's long-poll of its task's state, in a thread of its own, feeding `states`.

    The first ask (state unknown) is answered at once; each next one carries the state
    known and waits for a change. It ends when the part's attempt is over (the task left
    the active statuses or moved to another attempt) or when the part ends (`close`).
    """

    def __init__(
        self,
        api: InternalApi,
        states: TaskStates,
        task_id: int,
        attempt: int,
        wait_s: float = STATE_WAIT_S,
    ) -> None:
        self.api, self.states, self.task_id, self.attempt = api, states, task_id, attempt
        self.wait_s = wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"state-watch-{task_id}", daemon=True
        )

    def start(self) -> "StateWatch":
        self.states.watch(self.task_id)
        self._thread.start()
        return self

    def __enter__(self) -> "StateWatch":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching (the thread ends with its current long-poll's answer)."""
        if not self._stop.is_set():
            self._stop.set()
            self.states.unwatch(self.task_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            status, attempt = self.states.get(self.task_id) or ("", self.attempt)
            try:
                status, attempt = self.api.wait_state(self.task_id, status, attempt, self.wait_s)
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code == 404:  # the task is gone: nothing to watch
                    self.states.set(self.task_id, "DELETED", self.attempt)
                    return
                log.warning("task %s: state long-poll failed", self.task_id, exc_info=True)
                self._stop.wait(1.0)
                continue
            except Exception:  # the API is away: the client retried; try again soon
                log.warning("task %s: state long-poll failed", self.task_id, exc_info=True)
                self._stop.wait(1.0)
                continue
            self.states.set(self.task_id, status, attempt)
            if stop_reason((status, attempt), self.attempt):
                return  # this part's attempt is over: its runner stops
