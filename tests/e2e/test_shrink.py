"""A lost group shrinks the task onto the survivors, end to end (on PostgreSQL + Redis when
configured, else the embedded default). A module of its own, with its own stack, so that it
runs beside tests/e2e/test_fault_tolerance.py rather than after it."""

from collections.abc import Iterator

import httpx
import pytest

from polytrain.stack import LocalStack
from tests.e2e.conftest import new_version, submit, wait_for
from tests.e2e.test_fault_tolerance import (
    ENDED,
    GROUPS,
    assert_released,
    serve,
    wait_checkpoints,
)


@pytest.fixture(scope="module")
def shrink_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """API and one agent per group: cpu-a ×2, cpu-b ×1, cpu-c ×2."""
    yield from serve(tmp_path_factory, "shrink")


@pytest.fixture
def shrink_api(shrink_stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=shrink_stack.url, timeout=30, headers=shrink_stack.headers
    ) as client:
        yield client


def test_a_lost_group_shrinks_the_task_onto_the_survivors(
    shrink_api: httpx.Client, shrink_stack: LocalStack
) -> None:
    """Three groups, no spare capacity; the agent of one is killed mid-epoch: the task
    goes on with the other two from its last checkpoint (on_group_loss: shrink, the
    default), continues that epoch where it stopped, SUCCEEDS, and every training sample
    is used exactly once per epoch across the loss (shard provenance)."""
    version = new_version(shrink_api, example="mnist_cnn")
    every = [{"name": g.name, "workers": g.workers} for g in GROUPS]  # all of each group
    task = submit(
        shrink_api,
        version,
        resource_groups=every,
        epochs=1,
        global_batch_size=64,
        checkpoint_every=5,
        seed=7,
    )
    wait_checkpoints(shrink_api, task["id"], 1)  # step-5.pt: early in epoch 0
    shrink_stack.kill_agent("agent-cpu-b")  # one worker of three groups, not the parameter server
    done = wait_for(shrink_api, task["id"], ENDED, 240)
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    assert done["attempt"] == 2
    assert [(g["name"], g["workers"]) for g in done["spec"]["groups"]] == [
        ("cpu-a", 2),
        ("cpu-c", 2),
    ]
    logs = shrink_api.get(f"/api/v1/tasks/{task['id']}/logs", params={"limit": 10_000}).json()
    assert any(
        line["attempt"] == 2 and "continues epoch 0 at step" in line["text"] for line in logs
    ), "the second attempt did not go on with the interrupted epoch"
    epochs = shrink_api.get(f"/api/v1/tasks/{task['id']}/provenance").json()["epochs"]
    (epoch,) = epochs
    assert epoch["exactly_once"], epoch["samples"]
    assert epoch["attempts"] == [1, 2]
    assert {r["group"] for r in epoch["records"] if r["attempt"] == 2} == {"cpu-a", "cpu-c"}
    assert_released(shrink_api, shrink_stack, done)
