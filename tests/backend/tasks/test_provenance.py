"""Shard provenance at the backend: the records a checkpoint carried, read back per epoch with
the hosts the ranks ran on and the check that the epoch covers the training set once."""

from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.tasks.models import Task
from backend.tasks.models import TaskStatus as S
from backend.web import views
from tests.backend.scheduling import finish, group, running_task
from tests.backend.web.dom import parse
from tests.conftest import agent_headers
from worker.engine.provenance import as_hex, index_hash, training_set_hash

pytestmark = pytest.mark.stack
N_ITEMS = 30


def _checkpoint(client: TestClient, task: Task, name: str, epoch: int) -> int:
    response = client.post(
        f"/internal/v1/tasks/{task.id}/checkpoints",
        headers=agent_headers(),
        params={"name": name, "epoch": epoch, "step": 4 * (epoch + 1)},
        content=name.encode(),
    )
    response.raise_for_status()
    return int(response.json()["id"])


def _records(epoch: int, parts: list[torch.Tensor]) -> list[dict[str, Any]]:
    """One record per worker (ranks 1, 2 in group cpu-a, rank 3 in cpu-b) for `parts`."""
    return [
        {
            "worker": w,
            "rank": w + 1,
            "group_index": 0 if w < 2 else 1,
            "group": "cpu-a" if w < 2 else "cpu-b",
            "epoch": epoch,
            "step_from": 4 * epoch,
            "step_to": 4 * (epoch + 1),
            "samples": len(part),
            "index_hash": as_hex(index_hash(part)),
            "rebalanced": 1 if w == 2 else 0,
            "exchanged": 0,
        }
        for w, part in enumerate(parts)
    ]


def _put(client: TestClient, task: Task, checkpoint: int, records: list[dict]) -> Any:
    body = {"n_items": N_ITEMS, "set_hash": as_hex(training_set_hash(N_ITEMS)), "records": records}
    return client.put(
        f"/internal/v1/tasks/{task.id}/checkpoints/{checkpoint}/provenance",
        headers=agent_headers(),
        json=body,
    )


def test_an_epoch_covered_once_is_marked_and_its_workers_hosts_named(
    client: TestClient, session: Session
) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    order = torch.randperm(N_ITEMS, generator=torch.Generator().manual_seed(1))
    first = _checkpoint(client, task, "epoch-0.pt", 0)
    whole = _records(0, [order[:12], order[12:24], order[24:]])
    assert _put(client, task, first, whole).json() == {"stored": 3}
    assert _put(client, task, first, whole).json() == {"stored": 3}, "a retry replaces"
    second = _checkpoint(client, task, "epoch-1.pt", 1)
    short = _records(1, [order[:12], order[12:24], order[25:]])  # item order[24] is missing
    assert _put(client, task, second, short).status_code == 200

    read = client.get(f"/api/v1/tasks/{task.id}/provenance").json()
    epochs = read["epochs"]
    assert [(e["epoch"], e["samples"], e["exactly_once"], e["in_progress"]) for e in epochs] == [
        (0, 30, True, False),
        (1, 29, False, True),  # the task still runs: its latest epoch is not all recorded
    ]
    records = epochs[0]["records"]
    assert len(records) == 3 and epochs[0]["attempts"] == [1]
    assert [(r["rank"], r["group"], r["samples"], r["rebalanced"]) for r in records] == [
        (1, "cpu-a", 12, 0),
        (2, "cpu-a", 12, 0),
        (3, "cpu-b", 6, 1),
    ]
    hosts = {
        a["rank"]: a["host"]
        for a in client.get(f"/api/v1/tasks/{task.id}/allocations").json()
        if a["role"] == "compute"
    }
    assert all(r["host"] and r["host"] == hosts[r["rank"]] for r in records)
    assert epochs[0]["index_hash"] == epochs[0]["set_hash"]

    section = parse(client.get(f"/tasks/{task.id}").text).by_id("provenance")
    summaries = [" ".join(d.find("summary").text().split()) for d in section.find_all("details")]
    assert summaries == [
        "Epoch 0: 30 of 30 samples each once",
        "Epoch 1: 29 of 30 samples in progress",
    ]
    rows = [[td.text().strip() for td in tr.find_all("td")] for tr in section.find_all("tr")]
    assert ["1", "1–4", "cpu-b", "3", hosts[3], "6", "1", "0"] in [r[:8] for r in rows]
    finish(session, task, S.FAILED)  # ended: a short epoch is a fact, not work under way
    (_, ended) = client.get(f"/api/v1/tasks/{task.id}/provenance").json()["epochs"]
    assert (ended["exactly_once"], ended["in_progress"]) == (False, False)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"index_hash": "not-hex"}, "index_hash"),
        ({"step_to": 0, "step_from": 5}, "step_to"),
        ({"samples": 2, "rebalanced": 3}, "rebalanced"),
        ({"rank": 0}, "rank"),
    ],
)
def test_bad_records_are_refused_naming_the_field(
    client: TestClient, session: Session, change: dict, field: str
) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    checkpoint = _checkpoint(client, task, "epoch-0.pt", 0)
    records = _records(0, [torch.arange(10), torch.arange(10, 20), torch.arange(20, 30)])
    response = _put(client, task, checkpoint, [{**records[0], **change}, *records[1:]])
    assert response.status_code == 422
    assert field in response.text
    assert client.get(f"/api/v1/tasks/{task.id}/provenance").json()["epochs"] == []


def test_provenance_of_an_unknown_checkpoint_is_404(client: TestClient, session: Session) -> None:
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    assert _put(client, task, 999, []).status_code == 404


def test_a_groups_alarm_becomes_a_task_event_once_and_not_from_an_old_attempt(
    client: TestClient, session: Session
) -> None:
    """The alarm path the agreement check (worker.engine.agreement) takes to the task."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    task.attempt = 2  # a restarted task: attempt 1's processes may still be reporting
    session.commit()
    body = {"reason": "group 'cpu-b' (cpu) disagrees", "group": "cpu-b", "attempt": 2}
    url = f"/internal/v1/tasks/{task.id}/alarms"
    assert client.post(url, headers=agent_headers(), json=body).json() == {"stored": True}
    assert client.post(url, headers=agent_headers(), json=body).json() == {"stored": False}
    stale = {**body, "attempt": 1, "reason": "from the earlier attempt"}
    assert client.post(url, headers=agent_headers(), json=stale).json() == {"stored": False}
    refused = client.post(url, headers=agent_headers(), json={**body, "reason": ""})
    assert refused.status_code == 422 and "reason" in refused.text
    events = client.get(f"/api/v1/tasks/{task.id}/events").json()
    assert [e["reason"] for e in events if e["kind"] == "alarm"] == [
        "alarm in attempt 2: group 'cpu-b' (cpu) disagrees"
    ]


def test_a_guard_move_becomes_a_guard_event_on_the_timeline_and_the_task_page(
    client: TestClient, session: Session
) -> None:
    """The path of the guard's moves (worker.engine.guard) to the task: an event of its own
    kind, not an alarm, shown as such on the task page."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    reason = "group 'cpu-b' parked at step 8: predicted step 243.1 ms -> 131.0 ms"
    body = {"reason": reason, "group": "cpu-b", "attempt": 1, "kind": "guard"}
    url = f"/internal/v1/tasks/{task.id}/alarms"
    assert client.post(url, headers=agent_headers(), json=body).json() == {"stored": True}
    assert client.post(url, headers=agent_headers(), json=body).json() == {"stored": False}
    unknown = client.post(url, headers=agent_headers(), json={**body, "kind": "note"})
    assert unknown.status_code == 422 and "kind" in unknown.text
    events = client.get(f"/api/v1/tasks/{task.id}/events").json()
    assert [(e["kind"], e["reason"]) for e in events if e["kind"] != "status"] == [
        ("guard", f"guard in attempt 1: {reason}")
    ]
    rows = parse(client.get(f"/tasks/{task.id}").text).by_id("timeline").find_all("tr")
    [row] = [r for r in rows if r.attrs.get("class") == "guard"]
    assert "parked at step 8" in row.text() and "guard" in row.text()


def test_records_a_later_attempt_redid_are_shown_but_not_counted(
    client: TestClient, session: Session
) -> None:
    """Attempt 1 checkpoints at steps 4 and 8; attempt 2 resumed from step 4 (the step-8
    checkpoint arrived after the restart was decided) and redid steps 5-8."""
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    order = torch.randperm(N_ITEMS, generator=torch.Generator().manual_seed(2))

    def segment(name: str, attempt: int, parts: list[torch.Tensor], steps: tuple[int, int]):
        response = client.post(
            f"/internal/v1/tasks/{task.id}/checkpoints",
            headers=agent_headers(),
            params={"name": name, "epoch": 0, "step": steps[1], "attempt": attempt},
            content=f"{name}{attempt}".encode(),
        )
        records = [{**r, "step_from": steps[0], "step_to": steps[1]} for r in _records(0, parts)]
        assert _put(client, task, int(response.json()["id"]), records).status_code == 200

    first, second = order[:15], order[15:]
    segment("step-4.pt", 1, [first[:5], first[5:10], first[10:]], (0, 4))
    segment("step-8.pt", 1, [second[:5], second[5:10], second[10:]], (4, 8))
    segment("epoch-0.pt", 2, [second[:5], second[5:10], second[10:]], (4, 8))

    (epoch,) = client.get(f"/api/v1/tasks/{task.id}/provenance").json()["epochs"]
    assert (epoch["samples"], epoch["exactly_once"], epoch["attempts"]) == (30, True, [1, 2])
    kept = [(r["attempt"], r["step_to"], r["kept"]) for r in epoch["records"]]
    assert kept.count((1, 8, False)) == 3 and kept.count((2, 8, True)) == 3
    page = parse(client.get(f"/tasks/{task.id}").text).by_id("provenance")
    assert page.text().count("(discarded)") == 3


def test_the_task_page_lists_the_latest_epochs_and_fetches_its_section_alone(
    client: TestClient, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long task's page lists its latest epochs (here 2 of 4; 50 by default), naming how
    many are before them, and its refresh fetches that section alone; REST lists all."""
    monkeypatch.setattr(views, "PROVENANCE_EPOCHS", 2)
    group(session, "cpu-a", 2)
    group(session, "cpu-b", 1)
    task = running_task(session)
    order = torch.randperm(N_ITEMS, generator=torch.Generator().manual_seed(3))
    for epoch in range(4):
        checkpoint = _checkpoint(client, task, f"epoch-{epoch}.pt", epoch)
        parts = [order[:12], order[12:24], order[24:]]
        assert _put(client, task, checkpoint, _records(epoch, parts)).status_code == 200

    every = client.get(f"/api/v1/tasks/{task.id}/provenance").json()
    assert [e["epoch"] for e in every["epochs"]] == [0, 1, 2, 3] and every["earlier_epochs"] == 0
    response = client.get(f"/tasks/{task.id}/provenance-section")
    assert response.status_code == 200 and "<nav" not in response.text  # the section alone
    for html in (response.text, client.get(f"/tasks/{task.id}").text):
        section = parse(html).by_id("provenance")
        summaries = [d.find("summary").text().split(":")[0] for d in section.find_all("details")]
        assert summaries == ["Epoch 2", "Epoch 3"]
        assert "the 2 before them are in the JSON" in section.by_id("provenance-earlier").text()
    assert client.get("/tasks/999/provenance-section").status_code == 404
