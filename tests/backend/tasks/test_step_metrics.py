"""Per-step curves at the backend: stored in the metric table, read back filtered.

The path is the real one: the engine's per-step points (:class:`worker.engine.report.StepCurve`)
read by the agent's Reporter, sent by its InternalApi client, stored, then read through
`GET /api/v1/tasks/{id}/metrics` by scale, name and at most `max_points` a series. Also the
task option `step_metrics_every`: validated at submission and passed to the engine.
"""

import queue

import pytest
from fastapi.testclient import TestClient

from backend.core import db
from backend.tasks import service
from backend.tasks.models import STEP_SERIES, Task
from contracts.task_spec import TaskSpec
from tests.backend.conftest import World
from tests.backend.tasks.test_nonfinite_metrics import _agent_api
from tests.conftest import make_group, make_project, task_request
from worker.agent.reporter import Reporter
from worker.engine import report


def _send(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """What the ranks printed so far, through the agent's Reporter to the backend."""
    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    for line in capsys.readouterr().out.splitlines():
        lines.put(("rank-0", line))
    reporter = Reporter(_agent_api(world.client), world.task["id"], group="cpu-a")
    reporter.pump(lines)
    reporter.flush()


def _get(world: World, query: str) -> list[dict]:
    url = f"/api/v1/tasks/{world.task['id']}/metrics?{query}"
    response = world.client.get(url, headers=world.owner.headers)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.stack  # the thinning's window functions and integer division on PostgreSQL too
def test_step_series_are_stored_and_read_apart_from_epoch_metrics(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report.STEP_SERIES == STEP_SERIES
    curve = report.StepCurve()
    curve.restart(0, 2)
    for step in range(1, 21):  # 20 steps, a point every 2: 10 points of each series
        curve.add(0.5 * 8, 8)
        if curve.due(step):
            curve.point(step=step, epoch=0, lr=0.1)
    curve.flush()
    report.metric("step/train_accuracy", 0.75, step=20, epoch=0, rank=2)  # a worker's own
    report.metric("train_loss", 0.5, step=20, epoch=0, rank=0)
    report.metric("samples_per_s", 99.0, step=20, epoch=0, rank=1)
    _send(world, capsys)

    every = _get(world, "")
    assert len(every) == 3 * 10 + 1 + 3  # (the world's task has a val_loss of its own)
    steps = _get(world, "scale=step")
    assert {m["name"] for m in steps} == {
        "step/train_loss",
        "step/samples_per_s",
        "step/lr",
        "step/train_accuracy",
    }
    loss = [m for m in steps if m["name"] == "step/train_loss"]
    assert [m["step"] for m in loss] == list(range(2, 21, 2))
    assert {(m["value"], m["rank"], m["epoch"]) for m in loss} == {(0.5, None, 0)}
    assert {m["value"] for m in steps if m["name"] == "step/lr"} == {0.1}
    (accuracy,) = [m for m in steps if m["name"] == "step/train_accuracy"]
    assert (accuracy["rank"], accuracy["value"]) == (2, 0.75)
    epochs = _get(world, "scale=epoch")
    assert {m["name"] for m in epochs} == {"val_loss", "train_loss", "samples_per_s"}
    assert [m["name"] for m in _get(world, "scale=step&name=step/lr")] == ["step/lr"] * 10

    # At most 4 points a series: every 3rd (ceil(10 / 4)) counted back from the latest.
    thin = _get(world, "scale=step&name=step/train_loss&max_points=4")
    assert [m["step"] for m in thin] == [2, 8, 14, 20]
    thin = _get(world, "scale=step&max_points=4")
    assert len(thin) == 3 * 4 + 1  # the one-point series comes whole
    assert len(_get(world, "scale=step&max_points=10")) == 3 * 10 + 1

    # A chart's cursor: only what was stored after the id it last saw, in the order stored.
    ids = [m["id"] for m in every]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert _get(world, f"after_id={ids[-1]}") == []
    assert _get(world, f"after_id={ids[9]}") == every[10:]
    newer = _get(world, f"scale=step&name=step/lr&after_id={ids[-12]}")
    assert newer == [m for m in every[-11:] if m["name"] == "step/lr"] and newer
    assert _get(world, "after_id=0") == every
    assert _get(world, f"after_id={ids[9]}&limit=5") == every[10:15]  # one query, no total

    # The task's final metrics are its epoch metrics, never a per-step point.
    with db.get_sessionmaker()() as session:
        task = session.get(Task, world.task["id"])
        assert task is not None
        assert service.summary(session, task=task) == {"val_loss": 0.5, "train_loss": 0.5}


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("scale=minute", "scale"),
        ("max_points=0", "max_points"),
        ("after_id=-1", "after_id"),
        ("after_id=3&max_points=10", "neither max_points"),
        ("after_id=3&offset=10", "nor offset"),
    ],
)
def test_a_bad_filter_is_refused_naming_it(world: World, query: str, field: str) -> None:
    url = f"/api/v1/tasks/{world.task['id']}/metrics?{query}"
    response = world.client.get(url, headers=world.owner.headers)
    assert response.status_code == 422
    assert field in response.text


def test_step_metrics_every_reaches_the_engine_and_is_validated(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    make_group(client, "cpu-b", 1)
    version = make_project(client)[1]
    spec = client.post("/api/v1/tasks", json=task_request(version)).json()["spec"]
    assert "step_metrics_every" not in TaskSpec.model_validate(spec).engine_options()
    response = client.post("/api/v1/tasks", json=task_request(version, step_metrics_every=25))
    assert response.status_code == 201, response.text
    engine = TaskSpec.model_validate(response.json()["spec"]).engine_options()
    assert engine["step_metrics_every"] == 25
    response = client.post("/api/v1/tasks", json=task_request(version, step_metrics_every=-1))
    assert response.status_code == 422
    assert "step_metrics_every" in response.text
