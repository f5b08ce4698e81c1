"""Sweeps through REST: trials submitted K at a time with their hyperparameters, the next one
when one ends, the median stopping rule, cancel, access, refusals (422 naming the field).

No agent runs: a trial is moved to RUNNING in the database and its metrics are reported
through the internal API, and the sweep advances by `advance_all`, the call the scheduler's
pass makes."""

import json
import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from backend.core import db
from backend.sweeps import service as sweeps
from backend.sweeps.models import Sweep
from backend.tasks.models import Task, TaskStatus
from tests.conftest import agent_headers, login_as, make_group, make_project, with_csrf


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


def report(
    client: TestClient,
    task_id: int,
    values: list[float],
    name: str = "val_loss",
    first_epoch: int = 0,
) -> None:
    """`values` as the metric `name` of epochs `first_epoch`, `first_epoch + 1`, ..."""
    metrics = [
        {"name": name, "value": v, "epoch": e, "step": 10 * (e + 1), "rank": 0}
        for e, v in enumerate(values, start=first_epoch)
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
    report(client, ids[3], [0.92], first_epoch=1)  # its epoch 1: curve 0.95, 0.92
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
    assert by_task[ids[3]]["curve"] == {"0": 0.95, "1": 0.92}  # running average 0.935


def test_a_refused_trial_keeps_the_trials_stopped_in_the_same_pass(setup) -> None:  # type: ignore[no-untyped-def]
    """The pass stops trial 4 by the median rule, then trial 5 is refused (its group is
    gone): the sweep fails, and trial 4 stays stopped (the refusal undoes the submission
    only)."""
    client, version = setup
    body = sweep_body(version, parallel=4, space={"lr": [0.1, 0.01, 0.001, 0.0001, 0.00001]})
    sweep = client.post("/api/v1/sweeps", json=body).json()
    ids = [t["task_id"] for t in sweep["trials"]]
    set_running(*ids)
    for task_id, values in zip(ids, ([1.0, 0.8], [0.9, 0.7], [0.9, 0.85], [1.2, 1.1]), strict=True):
        report(client, task_id, values)
    with db.get_sessionmaker()() as session:
        stored = session.get_one(Sweep, sweep["id"])
        stored.base = {**stored.base, "resource_groups": [{"name": "gone", "workers": 1}]}
        session.commit()
    advance()
    got = client.get(f"/api/v1/sweeps/{sweep['id']}").json()
    assert got["status"] == "FAILED" and got["submitted"] == 4, got
    assert got["reason"].startswith("trial 5 refused: resource group 'gone' does not exist")
    stopped = got["trials"][3]
    assert stopped["status"] == "CANCELLED" and stopped["stopped_early"], stopped


def test_a_metric_never_reported_fails_the_sweep_naming_what_was(setup) -> None:  # type: ignore[no-untyped-def]
    client, version = setup
    sweep = client.post("/api/v1/sweeps", json=sweep_body(version, metric="val_los")).json()
    ids = [t["task_id"] for t in sweep["trials"]]
    set_running(*ids)
    report(client, ids[0], [0.5, 0.4])  # val_loss, not the sweep's val_los
    report(client, ids[0], [0.6], name="train_loss")
    report(client, ids[0], [3.0], name="step/train_loss")  # a per-step series: not named
    advance()
    assert client.get(f"/api/v1/sweeps/{sweep['id']}").json()["status"] == "RUNNING"
    with db.get_sessionmaker()() as session:
        session.get_one(Task, ids[0]).status = TaskStatus.SUCCEEDED
        session.commit()
    advance()
    got = client.get(f"/api/v1/sweeps/{sweep['id']}").json()
    assert got["status"] == "FAILED" and got["submitted"] == 2
    assert got["reason"] == (
        f"trial 1 (task {ids[0]}) succeeded without reporting the metric 'val_los'; "
        "it reported: train_loss, val_loss"
    )
    assert got["trials"][1]["status"] == "CANCELLED"
    assert got["trials"][1]["status_reason"] == f"sweep {sweep['id']} failed"
    page = client.get(f"/sweeps/{sweep['id']}")
    assert "without reporting the metric &#39;val_los&#39;" in page.text
    assert 'id="sweep-reason"' in page.text


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


@pytest.mark.stack(only="postgresql")
def test_a_cancel_waits_for_an_advance_under_way(setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The scheduler's pass (a thread) is in `advance`, about to submit trials 3 and 4, when
    a user cancels the sweep (an API request, another connection): the cancel waits on the
    sweep's row until the pass commits, then cancels the new trials too. Unlocked, the pass
    submitted them after the cancel, and they ran for a cancelled sweep."""
    client, version = setup
    sweep = client.post("/api/v1/sweeps", json=sweep_body(version, early_stopping="none")).json()
    for trial in sweep["trials"]:  # both end: the next pass submits trials 3 and 4
        client.post(f"/api/v1/tasks/{trial['task_id']}/cancel").raise_for_status()
    in_pass, cancel_done = threading.Event(), threading.Event()
    stop = sweeps._stop_bad_trials

    def slow_stop(*args):  # type: ignore[no-untyped-def]
        in_pass.set()
        cancel_done.wait(timeout=2)  # locked, the cancel cannot end while this pass runs
        return stop(*args)

    monkeypatch.setattr(sweeps, "_stop_bad_trials", slow_stop)
    failed: list[BaseException] = []

    def scheduler_pass() -> None:
        try:
            with db.get_sessionmaker()() as session:
                sweeps.advance(session, session.get_one(Sweep, sweep["id"]))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failed.append(exc)

    thread = threading.Thread(target=scheduler_pass)
    thread.start()
    assert in_pass.wait(timeout=30)
    answer = client.post(f"/api/v1/sweeps/{sweep['id']}/cancel")
    cancel_done.set()
    thread.join(timeout=30)
    assert not failed, failed
    assert answer.status_code == 200, answer.text
    got = client.get(f"/api/v1/sweeps/{sweep['id']}").json()
    assert got["status"] == "CANCELLED" and got["submitted"] == 4
    assert [t["status"] for t in got["trials"]] == ["CANCELLED"] * 4, got["trials"]


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
        (
            {"space": {"lr": [i / 100 for i in range(1, 41)], "hidden": list(range(1, 31))}},
            "trials",
            "the grid has 1200 combinations; at most 1000, or give trials",
        ),
        ({"space": {"lr": [0.1, "fast"]}}, "space.lr.values.1", "takes a number"),
        ({"space": {"hidden": [16, True]}}, "space.hidden.values.1", "takes a number"),
        (
            {"algorithm": "random", "space": {"lr": [0.1], "hidden": ["wide"]}},
            "space.hidden.values.0",
            "like its default 64, not 'wide'",
        ),
        (  # the first trials' refusals name the sweep's task's field
            {"task": {"resource_groups": [{"name": "gone", "workers": 1}]}},
            "task.resource_groups.0.name",
            "'gone' does not exist",
        ),
        (
            {
                "task": {
                    "resource_groups": [{"name": "cpu-a", "workers": 1}],
                    "hyperparameters": {"zz": 1},
                }
            },
            "task.hyperparameters.zz",
            "not declared",
        ),
        (
            {
                "space": {"lr": [0.1]},
                "task": {
                    "resource_groups": [{"name": "cpu-a", "workers": 1}],
                    "hyperparameters": {"hidden": "x"},  # fixed for every trial
                },
            },
            "task.hyperparameters.hidden",
            "takes a number",
        ),
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
    # each value of its default's kind: numbers (int or float alike), true/false, strings
    widened = client.post("/api/v1/tasks", json={**body, "hyperparameters": {"hidden": 32.0}})
    assert widened.status_code == 201, widened.text
    for wrong in ({"lr": "fast"}, {"lr": True}, {"hidden": "64"}):
        refused = client.post("/api/v1/tasks", json={**body, "hyperparameters": wrong})
        assert refused.status_code == 422, (wrong, refused.text)
        error = refused.json()["error"]
        assert error["field"] == f"hyperparameters.{next(iter(wrong))}", error
        assert "takes a number like its default" in error["message"], error


def test_a_module_without_hyperparameters_takes_none(setup) -> None:  # type: ignore[no-untyped-def]
    """No `HYPERPARAMETERS` binding at all: a task or sweep giving values is refused; a dict
    that is not a literal is not known here and left to the engine."""
    client, version = setup
    plain = client.post(
        f"/api/v1/projects/{version['project_id']}/code-versions",
        json={"example": "tiny_regression"},  # declares no HYPERPARAMETERS
    ).json()
    body = {
        "project_id": version["project_id"],
        "code_version_id": plain["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 1}],
        "global_batch_size": 8,
    }
    assert client.post("/api/v1/tasks", json=body).status_code == 201
    task = client.post("/api/v1/tasks", json={**body, "hyperparameters": {"lr": 0.1}})
    assert task.status_code == 422, task.text
    assert task.json()["error"] == {
        **task.json()["error"],
        "field": "hyperparameters.lr",
        "message": "hyperparameter 'lr': the module declares no HYPERPARAMETERS",
    }
    sweep = client.post("/api/v1/sweeps", json=sweep_body(plain, space={"lr": [0.1, 0.2]}))
    assert sweep.status_code == 422, sweep.text
    assert sweep.json()["error"]["field"] == "space.lr"
    assert "the module declares no HYPERPARAMETERS" in sweep.json()["error"]["message"]

    source = (
        b"import torch\nHYPERPARAMETERS = dict(lr=0.1)\n"
        b"def build_model(): return torch.nn.Linear(2, 1)\n"
        b"def build_datasets(): return [], []\n"
        b"def build_optimizer(params): return torch.optim.SGD(params, lr=0.1)\n"
        b"def loss_fn(output, target): return (output - target).pow(2).mean()\n"
    )
    unread = client.post(
        f"/api/v1/projects/{version['project_id']}/code-versions/upload",
        files={"file": ("train.py", source)},
    )
    assert unread.status_code == 201, unread.text
    dynamic = {**body, "code_version_id": unread.json()["id"], "hyperparameters": {"zz": "x"}}
    assert client.post("/api/v1/tasks", json=dynamic).status_code == 201


def test_a_large_grid_runs_with_trials_given(setup) -> None:  # type: ignore[no-untyped-def]
    client, version = setup
    space = {"lr": [i / 100 for i in range(1, 41)], "hidden": list(range(1, 31))}
    answer = client.post("/api/v1/sweeps", json=sweep_body(version, space=space, trials=5))
    assert answer.status_code == 201, answer.text
    assert answer.json()["planned"] == 5
    assert answer.json()["pending"][-1] == {"lr": 0.01, "hidden": 5}


def test_sweeps_are_seen_and_changed_only_through_their_project(world) -> None:  # type: ignore[no-untyped-def]
    client = world.client
    version = client.post(  # world.version (tiny_regression) declares no HYPERPARAMETERS
        f"/api/v1/projects/{world.project['id']}/code-versions",
        headers=world.as_(world.owner),
        json={"example": "mnist_cnn"},
    ).json()
    body = {
        "project_id": world.project["id"],
        "code_version_id": version["id"],
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


def test_a_sweeps_task_depends_only_on_tasks_the_caller_may_see(world) -> None:  # type: ignore[no-untyped-def]
    """A member of the owner's shared project cannot make a sweep's trials depend on the
    owner's private task (and so learn its status): REST and the portal's form answer as
    for a task that does not exist."""
    client = world.client
    private = client.post(
        "/api/v1/projects", headers=world.as_(world.owner), json={"name": "private"}
    ).json()
    code = client.post(
        f"/api/v1/projects/{private['id']}/code-versions",
        headers=world.as_(world.owner),
        json={"example": "tiny_regression"},
    ).json()
    hidden = client.post(
        "/api/v1/tasks",
        headers=world.as_(world.owner),
        json={
            "project_id": private["id"],
            "code_version_id": code["id"],
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
        },
    ).json()
    client.post(f"/api/v1/tasks/{hidden['id']}/cancel", headers=world.as_(world.owner))
    version = client.post(
        f"/api/v1/projects/{world.project['id']}/code-versions",
        headers=world.as_(world.owner),
        json={"example": "mnist_cnn"},
    ).json()

    def body(dep: int) -> dict:
        return {
            "project_id": world.project["id"],
            "code_version_id": version["id"],
            "task": {"resource_groups": [{"name": "cpu-a", "workers": 1}], "depends_on": [dep]},
            "space": {"lr": [0.1]},
        }

    missing_id = hidden["id"] + 1000
    answers = [
        client.post("/api/v1/sweeps", json=body(dep), headers=world.as_(world.member))
        for dep in (hidden["id"], missing_id)
    ]
    errors = [a.json()["error"] for a in answers]
    assert [a.status_code for a in answers] == [404, 404], errors
    assert [e["field"] for e in errors] == ["task.depends_on.0"] * 2
    assert errors[0]["message"] == errors[1]["message"].replace(str(missing_id), str(hidden["id"]))
    assert "CANCELLED" not in errors[0]["message"]
    assert client.get("/api/v1/sweeps", headers=world.as_(world.owner)).json() == []

    portal = login_as(TestClient(client.app), world.member)
    form = {
        "code_version_id": str(version["id"]),
        "groups": "cpu-a:1",
        "space": '{"lr": [0.1]}',
        "task_extra": json.dumps({"depends_on": [hidden["id"]]}),
    }
    page = portal.post(f"/projects/{world.project['id']}/sweeps", data=with_csrf(portal, form))
    assert page.status_code == 422 and 'id="error-task_extra"' in page.text, page.text
    assert f"task {hidden['id']} does not exist" in page.text
    assert "CANCELLED" not in page.text


def test_trials_are_placed_by_the_plan_the_sweep_names(client: TestClient) -> None:
    """Without `plan_id` the trials run on the task's groups, though the code version has a
    fitted plan. With it, the first trial takes the fastest set of the plan's groups (both),
    with the plan's id and prediction; the second finds both groups held by the first, so
    every set waits as long, and it takes the fastest set again (the choice among busy
    groups: tests/backend/sweeps/test_search.py)."""
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
    own = client.post("/api/v1/sweeps", json=body)
    assert own.status_code == 201, own.text
    assert own.json()["plan_id"] is None
    assert [t["groups"] for t in own.json()["trials"]] == [["fast"], ["fast"]]
    first = client.get(f"/api/v1/tasks/{own.json()['trials'][0]['task_id']}").json()
    assert {g["name"]: g["workers"] for g in first["spec"]["request"]} == {"fast": 1}
    assert "plan_id" not in first["spec"] or first["spec"]["plan_id"] is None
    client.post(f"/api/v1/sweeps/{own.json()['id']}/cancel").raise_for_status()

    created = client.post("/api/v1/sweeps", json={**body, "plan_id": plan_id})
    assert created.status_code == 201, created.text
    sweep = created.json()
    assert sweep["plan_id"] == plan_id
    first, second = (client.get(f"/api/v1/tasks/{t['task_id']}").json() for t in sweep["trials"])
    assert first["spec"]["plan_id"] == plan_id and first["spec"]["predicted_s"] > 0
    assert {g["name"]: g["workers"] for g in first["spec"]["request"]} == {"fast": 2, "slow": 1}
    assert {g["name"]: g["workers"] for g in second["spec"]["request"]} == {"fast": 2, "slow": 1}
    assert sweep["trials"][1]["groups"] == ["fast", "slow"]
