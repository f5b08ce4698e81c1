"""Sweeps through REST: trials submitted K at a time with their hyperparameters, the next one
when one ends, the median stopping rule, cancel, access, refusals (422 naming the field).

No agent runs: a trial is moved to RUNNING in the database and its metrics are reported
through the internal API, and the sweep advances by `advance_all`, the call the scheduler's
pass makes."""

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from backend.core import db
from backend.sweeps import service as sweeps
from backend.tasks.models import Task, TaskStatus
from tests.conftest import agent_headers, make_group, make_project


@pytest.fixture
def setup(client: TestClient) -> Iterator[tuple[TestClient, dict]]:
    make_group(client, "cpu-a", capacity=2)
    _, version = make_project(client)  # mnist_cnn: HYPERPARAMETERS lr, hidden
    yield client, version


def sweep_body(version: dict, **overrides: object) -> dict:
    return {
        "project_id": version["project_id"],
        "code_version_id": version["id"],
        "name": "lr x hidden",
        "task": {
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
            "epochs": 3,
            "global_batch_size": 16,
        },
        "space": {"lr": [0.1, 0.01], "hidden": {"values": [16, 32]}},
        "parallel": 2,
        **overrides,
    }


def advance() -> None:
    with db.get_sessionmaker()() as session:
        sweeps.advance_all(session)


def set_running(*task_ids: int) -> None:
    with db.get_sessionmaker()() as session:
        for task_id in task_ids:
            session.get_one(Task, task_id).status = TaskStatus.RUNNING
        session.commit()


def report(client: TestClient, task_id: int, values: list[float], name: str = "val_loss") -> None:
    metrics = [
        {"name": name, "value": v, "epoch": e, "step": 10 * (e + 1), "rank": 0}
        for e, v in enumerate(values)
    ]
    answer = client.post(
        f"/internal/v1/tasks/{task_id}/metrics", headers=agent_headers(), json={"metrics": metrics}
    )
    assert answer.status_code < 300, answer.text


def test_a_grid_sweep_submits_k_trials_then_the_next_as_one_ends(setup) -> None:  # type: ignore[no-untyped-def]
    client, version = setup
    created = client.post("/api/v1/sweeps", json=sweep_body(version))
    assert created.status_code == 201, created.text
    sweep = created.json()
    assert sweep["status"] == "RUNNING" and sweep["planned"] == 4 and sweep["submitted"] == 2
    assert [t["hyperparameters"] for t in sweep["trials"]] == [
        {"lr": 0.1, "hidden": 16},
        {"lr": 0.1, "hidden": 32},
    ]
    assert sweep["pending"] == [{"lr": 0.01, "hidden": 16}, {"lr": 0.01, "hidden": 32}]
    first = sweep["trials"][0]["task_id"]
    task = client.get(f"/api/v1/tasks/{first}").json()
    assert task["spec"]["hyperparameters"] == {"lr": 0.1, "hidden": 16}
    assert task["name"] == "lr x hidden · trial 1"
    advance()  # two unfinished: nothing more
    assert client.get(f"/api/v1/sweeps/{sweep['id']}").json()["submitted"] == 2

    client.post(f"/api/v1/tasks/{first}/cancel").raise_for_status()
    advance()
    now = client.get(f"/api/v1/sweeps/{sweep['id']}").json()
    assert now["submitted"] == 3 and now["trials"][2]["hyperparameters"] == {
        "lr": 0.01,
        "hidden": 16,
    }
    for trial in now["trials"][1:]:
        client.post(f"/api/v1/tasks/{trial['task_id']}/cancel").raise_for_status()
    advance()
    for trial in client.get(f"/api/v1/sweeps/{sweep['id']}").json()["trials"][3:]:
        client.post(f"/api/v1/tasks/{trial['task_id']}/cancel").raise_for_status()
    advance()
    done = client.get(f"/api/v1/sweeps/{sweep['id']}").json()
    assert done["status"] == "FINISHED" and done["submitted"] == 4 and not done["pending"]
    listed = client.get("/api/v1/sweeps", params={"project_id": version["project_id"]})
    assert listed.headers["x-total-count"] == "1" and listed.json()[0]["id"] == sweep["id"]


def test_the_median_rule_stops_a_bad_trial_and_the_best_is_named(setup) -> None:  # type: ignore[no-untyped-def]
    client, version = setup
    body = sweep_body(version, parallel=4, space={"lr": [0.1, 0.01, 0.001, 0.0001]})
    sweep = client.post("/api/v1/sweeps", json=body).json()
    ids = [t["task_id"] for t in sweep["trials"]]
    assert len(ids) == 4
    set_running(*ids)
    report(client, ids[0], [1.0, 0.8])  # running averages at epoch 1: 0.9, 0.8, 1.1
    report(client, ids[1], [0.9, 0.7])
    report(client, ids[2], [1.2, 1.0])
    report(client, ids[3], [0.95])  # one epoch: not judged yet
    advance()
    trials = client.get(f"/api/v1/sweeps/{sweep['id']}").json()["trials"]
    assert [t["status"] for t in trials] == ["RUNNING"] * 4
    report(client, ids[3], [0.95, 0.92][1:])  # epoch 0 again would be a duplicate: add epoch 1
    client.post(
        f"/internal/v1/tasks/{ids[3]}/metrics",
        headers=agent_headers(),
        json={"metrics": [{"name": "val_loss", "value": 0.92, "epoch": 1, "step": 20, "rank": 0}]},
    ).raise_for_status()
    advance()
    got = client.get(f"/api/v1/sweeps/{sweep['id']}").json()
    by_task = {t["task_id"]: t for t in got["trials"]}
    # trial 4: best 0.92 by epoch 1 > the median 0.9 of the others' averages (0.9, 0.8, 1.1)
    # trial 3: best 1.0 > the median 0.9 of (0.9, 0.8, 0.935) too
    stopped = by_task[ids[3]]
    assert stopped["status"] == "CANCELLED" and stopped["stopped_early"]
    assert "median stopping rule" in stopped["status_reason"]
    assert "best val_loss 0.92 by epoch 1" in stopped["status_reason"]
    assert by_task[ids[2]]["stopped_early"]
    assert by_task[ids[0]]["status"] == "RUNNING" and by_task[ids[1]]["status"] == "RUNNING"
    assert got["best"]["task_id"] == ids[1] and got["best"]["objective"] == 0.7
    assert by_task[ids[0]]["curve"] == {"0": 1.0, "1": 0.8}


def test_cancelling_a_sweep_cancels_its_unfinished_trials(setup) -> None:  # type: ignore[no-untyped-def]
    client, version = setup
    sweep = client.post("/api/v1/sweeps", json=sweep_body(version)).json()
    ids = [t["task_id"] for t in sweep["trials"]]
    set_running(ids[0])
    cancelled = client.post(f"/api/v1/sweeps/{sweep['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "CANCELLED"
    for task_id in ids:
        task = client.get(f"/api/v1/tasks/{task_id}").json()
        assert task["status"] == "CANCELLED"
        assert task["status_reason"] == f"sweep {sweep['id']} cancelled"
    advance()  # a cancelled sweep submits nothing more
    assert client.get(f"/api/v1/sweeps/{sweep['id']}").json()["submitted"] == 2
    again = client.post(f"/api/v1/sweeps/{sweep['id']}/cancel")
    assert again.status_code == 409


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"space": {"lr": []}}, "space.lr", "no values"),
        ({"space": {"lr": {"scale": "log"}}}, "space.lr", "no values"),
        ({"space": {}}, "space", "no hyperparameters"),
        ({"parallel": 0}, "parallel", "greater than or equal to 1"),
        ({"space": {"width": [1, 2]}}, "space.width", "not declared"),
        ({"space": {"lr": [[0.1]]}}, "space.lr", "scalar"),
        ({"space": {"lr": {"min": 0.1, "max": 1}}}, "space.lr", "random search"),
        (
            {"algorithm": "random", "space": {"lr": {"min": 0, "max": 1, "scale": "log"}}},
            "space.lr",
            "log scale needs min > 0",
        ),
        ({"task": {"epochs": 3}}, "task.resource_groups", "Field required"),
        ({"metric": ""}, "metric", "at least 1"),
    ],
)
def test_bad_sweeps_are_refused_naming_the_field(setup, change, field, words) -> None:  # type: ignore[no-untyped-def]
    client, version = setup
    answer = client.post("/api/v1/sweeps", json=sweep_body(version, **change))
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"].startswith(field) and words in error["message"], error
    assert client.get("/api/v1/sweeps").json() == []
    assert client.get("/api/v1/tasks").json() == []  # nothing submitted


def test_task_hyperparameters_are_checked_against_the_declared_ones(setup) -> None:  # type: ignore[no-untyped-def]
    client, version = setup
    body = {
        "project_id": version["project_id"],
        "code_version_id": version["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 1}],
        "global_batch_size": 8,
    }
    plain = client.post("/api/v1/tasks", json=body).json()
    assert "hyperparameters" not in plain["spec"]  # a task without any: unchanged
    ok = client.post("/api/v1/tasks", json={**body, "hyperparameters": {"lr": 0.003}})
    assert ok.status_code == 201 and ok.json()["spec"]["hyperparameters"] == {"lr": 0.003}
    unknown = client.post("/api/v1/tasks", json={**body, "hyperparameters": {"width": 3}})
    assert unknown.status_code == 422
    assert unknown.json()["error"]["field"] == "hyperparameters.width"
    assert "declared: hidden, lr" in unknown.json()["error"]["message"]
    nested = client.post("/api/v1/tasks", json={**body, "hyperparameters": {"lr": [1]}})
    assert nested.status_code == 422 and "JSON scalar" in nested.json()["error"]["message"]


def test_sweeps_are_seen_and_changed_only_through_their_project(world) -> None:  # type: ignore[no-untyped-def]
    client = world.client
    body = {
        "project_id": world.project["id"],
        "code_version_id": world.version["id"],
        "task": {"resource_groups": [{"name": "cpu-a", "workers": 1}], "global_batch_size": 8},
        "space": {"lr": [0.1, 0.2]},
        "early_stopping": "none",
    }
    assert (
        client.post("/api/v1/sweeps", json=body, headers=world.as_(world.stranger)).status_code
        == 404
    )
    created = client.post("/api/v1/sweeps", json=body, headers=world.as_(world.owner))
    assert created.status_code == 201, created.text
    sweep_id = created.json()["id"]
    for account, seen in ((world.member, 200), (world.admin, 200), (world.stranger, 404)):
        answer = client.get(f"/api/v1/sweeps/{sweep_id}", headers=world.as_(account))
        assert answer.status_code == seen
        listed = client.get("/api/v1/sweeps", headers=world.as_(account)).json()
        assert [s["id"] for s in listed] == ([sweep_id] if seen == 200 else [])
    assert world.anonymous.get(f"/api/v1/sweeps/{sweep_id}").status_code == 401
    stranger = client.post(f"/api/v1/sweeps/{sweep_id}/cancel", headers=world.as_(world.stranger))
    assert stranger.status_code == 404
    member = client.post(f"/api/v1/sweeps/{sweep_id}/cancel", headers=world.as_(world.member))
    assert member.status_code == 200
    audit = client.get("/api/v1/audit", params={"action": "sweep.create"}).json()
    assert str(sweep_id) in [e["object_id"] for e in audit]  # and the stranger's refusal
    assert len(audit) == 2
    cancels = client.get("/api/v1/audit", params={"action": "sweep.cancel"}).json()
    assert {e["object_id"] for e in cancels} == {str(sweep_id)}


def test_trials_are_placed_by_the_code_versions_plan(client: TestClient) -> None:
    """With a fitted plan of the code version, the first trial takes the fastest set of the
    plan's groups (both), with the plan's id and prediction; the second finds both groups
    held by the first, so every set waits as long, and it takes the fastest set again (the
    choice among busy groups: tests/backend/sweeps/test_search.py)."""
    from backend.plans.models import Plan
    from backend.plans.performance import Ring, fit
    from tests.backend.plans.test_performance import GROUPS, _trial

    make_group(client, "fast", capacity=2)
    make_group(client, "slow", capacity=1)
    project, version = make_project(client)
    trial = _trial({0: (0.010, 0.002), 1: (0.010, 0.004)}, {0: 2, 1: 1}, cross=Ring(1e-5, 1e-10))
    with db.get_sessionmaker()() as session:
        plan = Plan(
            project_id=project["id"],
            name="plan",
            request={"code_version_id": version["id"]},
            model=fit(trial, GROUPS, sync_strategy="sync").to_json(),
        )
        session.add(plan)
        session.commit()
        plan_id = plan.id
    body = sweep_body(version, space={"lr": [0.1, 0.01, 0.001]}, parallel=2)
    body["task"] = {
        "resource_groups": [{"name": "fast", "workers": 1}],
        "epochs": 2,
        "global_batch_size": 64,
        "split_policy": "weighted",
    }
    created = client.post("/api/v1/sweeps", json=body)
    assert created.status_code == 201, created.text
    sweep = created.json()
    assert sweep["plan_id"] == plan_id
    first, second = (client.get(f"/api/v1/tasks/{t['task_id']}").json() for t in sweep["trials"])
    assert first["spec"]["plan_id"] == plan_id and first["spec"]["predicted_s"] > 0
    assert {g["name"]: g["workers"] for g in first["spec"]["request"]} == {"fast": 2, "slow": 1}
    assert {g["name"]: g["workers"] for g in second["spec"]["request"]} == {"fast": 2, "slow": 1}
    assert sweep["trials"][1]["groups"] == ["fast", "slow"]
