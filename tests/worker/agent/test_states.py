"""How the agent learns its tasks' states without polling (worker/agent/states.py): a part's
long-poll brings a cancellation, the heartbeat's answer brings the states of the tasks it
names, and a state once learned is never undone by an older answer."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from contracts.packages import lock_hash
from tests.worker.agent.fakes import FakeApi, FakePool, event
from tests.worker.agent.test_runner import cached_environment
from worker.agent import main
from worker.agent.processes import RunningRegistry
from worker.agent.states import StateWatch, TaskStates, stop_reason
from worker.config import AgentSettings

Run = Callable[..., tuple[str, FakePool]]
RENDEZVOUS = event("rendezvous", port=4242)


def test_a_cancel_arrives_through_the_long_poll_and_no_state_is_polled(
    api: FakeApi, run_with: Run
) -> None:
    """The ranks run; the task is cancelled; the part's long-poll (waiting on the known
    state) is answered with it and the ranks stop. No state request but the first (state
    unknown) was a poll."""

    def cancel_once_started(route: str) -> None:
        if route == "rendezvous":  # rank 0 is up: cancel a moment later, from elsewhere
            threading.Timer(0.3, lambda: setattr(api, "status", "CANCELLED")).start()

    api.before = cancel_once_started
    outcome, pool = run_with({0: f"{RENDEZVOUS}; sleep 30", 1: "sleep 30", 2: "sleep 30"})
    assert outcome == "failed"
    assert all(slot.popen.poll() is not None for slot in pool.slots)
    (finished,) = api.bodies("finished")
    assert finished["cause"] == "stopped" and "CANCELLED in attempt 1" in finished["detail"]
    asks = api.calls("state")
    assert len(api.state_polls()) <= 1  # the first ask, before the state is known
    assert asks[-1].url.params["status"] == "RUNNING"  # the long-poll that brought CANCELLED
    assert float(asks[-1].url.params["wait_s"]) >= 20


def test_a_preparing_part_starts_its_ranks_when_the_long_poll_brings_running(
    api: FakeApi, run_with: Run, settings: AgentSettings
) -> None:
    lock = "einops==0.8.2\n"
    cached_environment(settings, lock)
    api.status = "SCHEDULED"  # another part still prepares

    def run_when_ready(route: str) -> None:
        if route == "ready":
            threading.Timer(0.3, lambda: setattr(api, "status", "RUNNING")).start()

    api.before = run_when_ready
    outcome, pool = run_with(
        {0: RENDEZVOUS}, environment={"lock_hash": lock_hash(lock), "lock": lock}
    )
    assert outcome == "succeeded" and pool.slots
    assert len(api.state_polls()) <= 1


def test_a_state_once_learned_is_not_undone_by_an_older_answer() -> None:
    states = TaskStates()
    states.set(4, "RUNNING", 1)  # not watched: ignored
    assert states.get(4) is None
    states.watch(4)
    states.set(4, "RUNNING", 1)
    states.set(4, "CANCELLED", 1)  # the long-poll's answer
    states.set(4, "RUNNING", 1)  # a heartbeat's answer, read before the cancel
    assert states.get(4) == ("CANCELLED", 1)
    assert stop_reason(states.get(4), 1) == "task is CANCELLED in attempt 1"
    states.set(4, "QUEUED", 2)  # restarted: a later attempt moves on
    assert states.get(4) == ("QUEUED", 2)
    states.unwatch(4)
    assert states.get(4) is None and states.watched() == []


def test_heartbeats_name_the_watched_tasks_and_bring_their_states(api: FakeApi) -> None:
    states, stop = TaskStates(), threading.Event()
    states.watch(4)
    states.set(4, "RUNNING", 1)
    api.status = "CANCELLED"

    def stop_after_one(route: str) -> None:
        if route == "heartbeat":
            stop.set()

    api.before = stop_after_one
    main._heartbeats(api.client(retries=0), 7, 0.01, stop, RunningRegistry(), None, states)
    assert api.bodies("heartbeat") == [{"running": [], "tasks": [4]}]
    assert states.get(4) == ("CANCELLED", 1)


@pytest.mark.parametrize("status", ["CANCELLED", "SUCCEEDED"])
def test_a_watch_ends_with_its_attempt(api: FakeApi, status: str) -> None:
    states = TaskStates()
    api.status = status
    watch = StateWatch(api.client(), states, 4, 1, wait_s=25.0).start()
    watch._thread.join(10)
    assert not watch._thread.is_alive()
    assert states.get(4) == (status, 1)
    watch.close()
    assert states.watched() == []
