"""A claim the API took whose answer was lost (its process killed mid-request, a dropped
connection) is retried by the agent with the same claim id and answered again; a new claim
of the same part (a redelivered message) is still refused, so a part never runs twice."""

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.core import db
from backend.core.errors import Conflict
from backend.scheduler.service import schedule_once
from backend.tasks import fate
from backend.tasks.models import SubTask, SubTaskStatus, Task, TaskStatus
from contracts.agent_api import Claim
from tests.backend.scheduling import RecordingDispatcher, group, submit, version
from worker.agent.client import InternalApi


def _part(session: Session) -> SubTask:
    group(session, "cpu-a", 1)
    task = submit(session, version(session), [{"name": "cpu-a", "workers": 1}])
    assert schedule_once(session, RecordingDispatcher(), heartbeat_timeout_s=15) == 1
    sub = session.scalars(select(SubTask).where(SubTask.task_id == task.id)).one()
    assert sub.agent_id is not None
    return sub


def test_a_retried_claim_is_answered_again_and_a_new_one_refused(session: Session) -> None:
    sub = _part(session)
    assert sub.agent_id is not None
    taken = Claim(agent_id=sub.agent_id, host="a", claim_id="c" * 32)
    fate.claim(session, sub=sub, data=taken)
    session.commit()
    assert fate.claim(session, sub=sub, data=taken) is sub  # the retry: nothing changes
    assert (sub.status, sub.claim_id) == (SubTaskStatus.RUNNING, "c" * 32)
    for other in (
        Claim(agent_id=sub.agent_id, host="a", claim_id="d" * 32),  # a redelivered message
        Claim(agent_id=sub.agent_id, host="a"),  # an agent older than claim ids
    ):
        with pytest.raises(Conflict, match="is RUNNING"):
            fate.claim(session, sub=sub, data=other)
    task = session.get_one(Task, sub.task_id)
    assert task.status is TaskStatus.RUNNING


def test_a_retried_claim_of_a_part_that_ended_is_refused(session: Session) -> None:
    sub = _part(session)
    assert sub.agent_id is not None
    taken = Claim(agent_id=sub.agent_id, host="a", claim_id="c" * 32)
    fate.claim(session, sub=sub, data=taken)
    sub.status = SubTaskStatus.FAILED
    session.commit()
    with pytest.raises(Conflict):
        fate.claim(session, sub=sub, data=taken)


def test_the_agent_sends_one_claim_id_in_every_retry() -> None:
    bodies: list[bytes] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(503 if len(bodies) == 1 else 204)

    api = InternalApi("http://api.test", "t", retries=1, transport=httpx.MockTransport(handle))
    api.claim(7, agent_id=1, host="h")
    api.claim(7, agent_id=1, host="h")  # a second claim (a redelivered message): a new id
    ids = [Claim.model_validate_json(body).claim_id for body in bodies]
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2]
    assert all(i is not None and len(i) == 32 for i in ids)


def test_a_retry_that_read_the_part_before_its_claim_committed_is_answered_again(
    session: Session,
) -> None:
    """The retry of a claim still under way (its answer late, the client timed out) read the
    part PENDING, then waited for the task's lock while the claim committed: it must see the
    part as it is now (claimed by this very claim) and be answered, not refused or made to
    hand the part back."""
    sub = _part(session)
    assert sub.agent_id is not None
    taken = Claim(agent_id=sub.agent_id, host="a", claim_id="c" * 32)
    assert sub.status is SubTaskStatus.PENDING  # what the retry read
    with db.get_sessionmaker()() as first:
        fate.claim(first, sub=first.get_one(SubTask, sub.id), data=taken)
        first.commit()
    assert fate.claim(session, sub=sub, data=taken) is sub
    session.commit()
    session.expire_all()
    assert (sub.status, sub.agent_id, sub.claim_id) == (
        SubTaskStatus.RUNNING,
        taken.agent_id,
        "c" * 32,
    )
