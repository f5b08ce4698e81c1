"""The agent's HTTP client of the internal API: retries, refusals and what it sends."""

from __future__ import annotations

import httpx
import pytest

from tests.worker.agent.fakes import FakeApi
from worker.agent import client as client_module
from worker.agent.client import Conflict


def test_a_503_is_retried_and_the_batch_arrives_once(api: FakeApi) -> None:
    api.fail["logs"] = [503]
    lines = [{"attempt": 1, "node": "ps", "seq": 0, "time": "2026-01-01T00:00:00", "text": "hi"}]
    api.client().logs(4, lines)
    assert api.bodies("logs") == [{"lines": lines}]


def test_a_dropped_connection_is_retried(api: FakeApi) -> None:
    api.fail["register"] = [0]
    assert api.client().register(name="n") == 7
    assert api.fail["register"] == []


def test_a_backend_that_stays_down_raises_after_the_retries(api: FakeApi) -> None:
    api.fail["progress"] = [500, 502, 503, 200]
    with pytest.raises(httpx.HTTPStatusError):
        api.client(retries=2).progress(4, 0.5, 1)
    assert api.bodies("progress") == []


def test_a_refusal_is_a_conflict_naming_the_field_and_not_retried(api: FakeApi) -> None:
    api.claimed_by, api.refuse_field = "agent-9", "agent_id"
    with pytest.raises(Conflict) as refused:
        api.client().claim(17, agent_id=7, host="h", attempt=1)
    assert refused.value.field == "agent_id" and "agent-9" in str(refused.value)
    assert len(api.bodies("claim")) == 1


def test_a_client_error_is_raised_at_once(api: FakeApi) -> None:
    api.fail["metrics"] = [422, 200]
    with pytest.raises(httpx.HTTPStatusError):
        api.client().metrics(4, [])
    assert api.fail["metrics"] == [200]


def test_nul_characters_in_rank_output_still_arrive(api: FakeApi) -> None:
    line = {
        "attempt": 1,
        "node": "rank-1",
        "seq": 0,
        "time": "2026-01-01T00:00:00",
        "text": "bad\x00byte",
    }
    api.client().logs(4, [line])
    assert api.bodies("logs")[0]["lines"][0]["text"] == "bad\ufffdbyte"


def test_task_state_and_attempt(api: FakeApi) -> None:
    api.status, api.attempt = "CANCELLED", 3
    assert api.client().task_state(4) == ("CANCELLED", 3)


def test_a_heartbeat_is_tried_twice_and_never_waits_on_the_backoff(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's loop beats again one interval later; the client's backoff (up to 5 s
    # between tries) would reach a restarted API too late for its monitor's timeout.
    waits: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", waits.append)
    api.fail["heartbeat"] = [0, 0, 503, 503]
    client = api.client(retries=30)
    with pytest.raises(httpx.TransportError):
        client.heartbeat(7)
    with pytest.raises(httpx.HTTPStatusError):
        client.heartbeat(7)
    assert api.fail["heartbeat"] == [] and api.bodies("heartbeat") == []
    assert client.heartbeat(7) == {}
    assert api.bodies("heartbeat") == [{"running": []}]
    assert waits == [0.5, 0.5]  # one short wait a failed beat, never the backoff's 1-5 s
    beats = [r for r in api.requests if r.url.path.endswith("/heartbeat")]
    assert {r.extensions["timeout"]["read"] for r in beats} == {client_module.HEARTBEAT_TIMEOUT_S}


def test_a_report_and_a_claim_leave_an_outage_to_their_callers(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reporter flushes again 5 s later and the runner claims again 5 s later, each for
    up to 120 s: through the agent's 30 retries (137 s of waits) one call outlasted that."""
    waits: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", waits.append)
    api.fail["report"] = [503] * 10
    api.fail["claim"] = [0] * 10
    client = api.client(retries=30)
    with pytest.raises(httpx.HTTPStatusError):
        client.report(4, lines=[], metrics=[])
    with pytest.raises(httpx.TransportError):
        client.claim(17, agent_id=7, host="h", attempt=1)
    assert waits == [0.5, 1.0] * 2
    assert len(api.fail["report"]) == len(api.fail["claim"]) == 10 - 3
