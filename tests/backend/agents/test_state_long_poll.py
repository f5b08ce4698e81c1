"""The agents' long-poll of a task's state (backend/agent_api/waits.py): answered as soon as
the state changes (a cancel through the REST API), one query a tick for every waiter, each
waiting on the event loop; and at once without `wait_s` (an older agent's poll)."""

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.agent_api.waits import StateWaits
from tests.backend.scheduling import group, running_task
from tests.conftest import agent_headers

# A bound for a hung wait, far below the long-poll's own wait: an answer only at the
# timeout would miss it. Not a speed the test expects.
PATIENCE_S = 20.0
WAIT_S = 28.0


def test_a_cancel_answers_the_waiting_long_poll(client: TestClient, session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    url = f"/internal/v1/tasks/{task.id}/state"
    now = client.get(url, headers=agent_headers()).json()  # an older agent's poll: at once
    assert now == {"status": "RUNNING", "attempt": 1}
    answers: list[dict] = []

    def long_poll() -> None:
        params = {"status": "RUNNING", "attempt": 1, "wait_s": WAIT_S}
        answers.append(client.get(url, headers=agent_headers(), params=params).json())

    waiting = threading.Thread(target=long_poll)
    waiting.start()
    waits: StateWaits = client.app.state.state_waits  # type: ignore[attr-defined]
    for _ in range(int(PATIENCE_S / 0.05)):  # the request is waiting before the cancel
        if waits.waiting:
            break
        waiting.join(0.05)
    assert waits.waiting == 1
    client.post(f"/api/v1/tasks/{task.id}/cancel").raise_for_status()
    waiting.join(PATIENCE_S)
    assert not waiting.is_alive(), "the long-poll was not answered at the cancel"
    assert answers == [{"status": "CANCELLED", "attempt": 1}]
    # Knowing an old state, the answer is at once; an unknown task is 404.
    params = {"status": "RUNNING", "attempt": 1, "wait_s": WAIT_S}
    assert client.get(url, headers=agent_headers(), params=params).json()["status"] == "CANCELLED"
    missing = client.get("/internal/v1/tasks/999999/state", headers=agent_headers(), params=params)
    assert missing.status_code == 404


def test_every_waiter_is_answered_from_one_read_a_tick() -> None:
    states = {task_id: ("RUNNING", 1) for task_id in range(1, 201)}
    reads: list[list[int]] = []

    def read(task_ids: list[int]) -> dict[int, tuple[str, int]]:
        reads.append(task_ids)
        return {t: states[t] for t in task_ids if t in states}

    async def scenario() -> list[tuple[str, int] | None]:
        waits = StateWaits(read, tick_s=3600.0)  # ticks only when the test says
        jobs = [
            asyncio.create_task(waits.wait(task_id, ("RUNNING", 1), 60.0)) for task_id in states
        ]
        jobs.append(asyncio.create_task(waits.wait(404, ("RUNNING", 1), 60.0)))
        while waits.waiting < 201:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the reader's first tick: one read of all 201 tasks
        while not reads:
            await asyncio.sleep(0.01)
        assert reads == [sorted([*states, 404])]
        assert jobs[-1].done() or await jobs[-1] is None  # no such task: answered
        states[7], states[9] = ("CANCELLED", 1), ("SCHEDULED", 2)
        await waits.tick()
        await asyncio.wait([jobs[6], jobs[8]], timeout=PATIENCE_S)
        assert len(reads) == 2 and {j.done() for j in jobs[:200]} == {True, False}
        changed = {i + 1: jobs[i].result() for i in range(200) if jobs[i].done()}
        assert changed == {7: ("CANCELLED", 1), 9: ("SCHEDULED", 2)}
        waits.close()  # the process stops: every other waiter is answered now
        rest = await asyncio.gather(*jobs[:200])
        assert await waits.wait(1, ("RUNNING", 1), 60.0) == ("RUNNING", 1)  # closed: at once
        return rest

    answers = asyncio.run(asyncio.wait_for(scenario(), PATIENCE_S))
    assert answers.count(("RUNNING", 1)) == 198


@pytest.mark.parametrize("wait_s", [-1, 31])
def test_a_wait_beyond_its_bounds_is_refused(client: TestClient, wait_s: float) -> None:
    params = {"status": "RUNNING", "attempt": 1, "wait_s": wait_s}
    answer = client.get("/internal/v1/tasks/1/state", headers=agent_headers(), params=params)
    assert answer.status_code == 422
