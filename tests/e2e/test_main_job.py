"""The main job end to end: REST → scheduler → Celery → agents → torch.distributed → REST."""

import io
import time

import httpx
import pytest
import torch

from polytrain.stack import LocalStack
from tests.e2e.conftest import (
    DOWNLOAD_TIMEOUT_S,
    TINY,
    new_version,
    submit,
    training_processes,
    wait_for,
)

FAILING_MODEL = TINY.replace(
    "    return torch.nn.Linear(4, 1)",
    '    raise RuntimeError("model definition is broken: bad layer size")',
).encode()


FAILING_STEP = TINY.encode().replace(
    b"def loss_fn(output, target):",
    b"""CALLS = [0]

def loss_fn(output, target):
    CALLS[0] += 1
    if CALLS[0] == 5:
        raise ValueError("loss exploded at call 5")""",
)


def assert_released(api: httpx.Client, stack: LocalStack, task_id: int) -> None:
    allocations = api.get(f"/api/v1/tasks/{task_id}/allocations").json()
    assert allocations and all(a["released_at"] for a in allocations)
    deadline = time.monotonic() + 15
    while training_processes(stack.data_dir, task_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert training_processes(stack.data_dir, task_id) == []
    groups = api.get("/api/v1/resource-groups").json()
    assert all(g["allocated_workers"] == 0 for g in groups)


@pytest.fixture(scope="module")
def two_group_task(stack: LocalStack) -> dict:
    """The built-in tiny example across both groups (2 epochs), run to its end once for the
    tests that read what it left: its timeline, logs, metrics and checkpoints."""
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        task = submit(api, new_version(api, example="tiny_regression"))
        return wait_for(api, task["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})


def test_task_spans_two_groups_and_succeeds(
    api: httpx.Client, stack: LocalStack, two_group_task: dict
) -> None:
    task = done = two_group_task
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    events = api.get(f"/api/v1/tasks/{task['id']}/events").json()
    said = [(e["kind"], e["to_status"], e["reason"]) for e in events]
    assert [e["to_status"] for e in events] == [
        "QUEUED",
        "SCHEDULED",
        "RUNNING",
        "SUCCEEDED",
    ], said

    allocations = api.get(f"/api/v1/tasks/{task['id']}/allocations").json()
    compute = sorted(
        (a["resource_group"], a["rank"]) for a in allocations if a["role"] == "compute"
    )
    assert compute == [("cpu-a", 1), ("cpu-a", 2), ("cpu-b", 3)]
    assert {a["role"] for a in allocations} == {"task_manager", "parameter_server", "compute"}

    nodes = {line["node"] for line in api.get(f"/api/v1/tasks/{task['id']}/logs").json()}
    assert {"ps", "rank-1", "rank-2", "rank-3"} <= nodes

    metrics = api.get(f"/api/v1/tasks/{task['id']}/metrics").json()
    val_loss = [m for m in metrics if m["name"] == "val_loss" and m["rank"] is None]
    assert [m["epoch"] for m in val_loss] == [0, 1] or [m["epoch"] for m in val_loss] == [1, 2]
    throughput_ranks = {
        m["rank"] for m in metrics if m["name"] == "samples_per_s" and m["rank"] is not None
    }
    assert throughput_ranks == {1, 2, 3}
    provenance = api.get(f"/api/v1/tasks/{task['id']}/provenance").json()["epochs"]
    assert provenance and all(e["exactly_once"] for e in provenance)
    records = [r for e in provenance for r in e["records"]]
    assert {(r["group"], r["rank"]) for r in records} == {("cpu-a", 1), ("cpu-a", 2), ("cpu-b", 3)}
    assert_released(api, stack, task["id"])


def test_checkpoint_downloads_and_loads(api: httpx.Client, two_group_task: dict) -> None:
    task = two_group_task
    assert task["status"] == "SUCCEEDED", task["status_reason"]
    checkpoints = api.get(f"/api/v1/tasks/{task['id']}/checkpoints").json()
    assert checkpoints
    blob = api.get(
        f"/api/v1/tasks/{task['id']}/checkpoints/{checkpoints[-1]['id']}/download",
        timeout=DOWNLOAD_TIMEOUT_S,
    )
    assert blob.status_code == 200
    state = torch.load(io.BytesIO(blob.content), weights_only=True)
    # The source worker kept the optimizer state (its agent uploaded its file beside the
    # checkpoint): the download holds it whole, as the user's optimizer loads it.
    assert checkpoints[-1]["sharded_files"] == 2  # DCP's .metadata and the worker's file
    from examples.tiny_regression import build_model, build_optimizer

    model = build_model()
    model.load_state_dict(state["model"])
    optimizer = build_optimizer(model.parameters())
    optimizer.load_state_dict(state["optimizer"])
    moments = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert [tuple(v.shape) for v in moments] == [tuple(p.shape) for p in model.parameters()]


@pytest.mark.parametrize(
    "strategy",
    # sync: the owners sum every step, each worker of the 2-worker group sending its half
    [{"sync_strategy": "periodic", "sync_period": 2}, {"sync_strategy": "sync"}],
    ids=["periodic", "sync"],
)
def test_a_task_with_its_parameter_server_in_shards_succeeds(
    api: httpx.Client, stack: LocalStack, strategy: dict[str, object]
) -> None:
    version = new_version(api, example="tiny_regression")
    task = submit(api, version, epochs=1, ps_shards=2, **strategy)
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    # The second shard's owner is rank 4, after the 3 workers, started beside rank 0.
    lines = api.get(f"/api/v1/tasks/{task['id']}/logs", params={"node": "rank-4"}).json()
    assert any("up: shard 1 of 2 of the parameter server" in line["text"] for line in lines)
    agent = api.get(f"/api/v1/tasks/{task['id']}/logs").json()
    started = [line["text"] for line in agent if "started ranks [0, 4, 1, 2] " in line["text"]]
    assert started, "the parameter server's agent did not start the second shard's owner"
    checkpoints = api.get(f"/api/v1/tasks/{task['id']}/checkpoints").json()
    assert checkpoints
    if strategy["sync_strategy"] == "periodic":
        # Each owner wrote its slice of the model (2 files each, uploaded from its own rank's
        # folder), none gathered it; final.pt's download is the whole model all the same.
        final = checkpoints[-1]  # final.pt: no optimizer state under periodic, the slices
        assert final["sharded_files"] == 4, checkpoints
        blob = api.get(
            f"/api/v1/tasks/{task['id']}/checkpoints/{final['id']}/download",
            timeout=DOWNLOAD_TIMEOUT_S,
        )
        assert blob.status_code == 200, blob.text
        state = torch.load(io.BytesIO(blob.content), weights_only=True)
        assert "model_slices" not in state
        from examples.tiny_regression import build_model

        model = build_model()
        model.load_state_dict(state["model"])
        assert all(bool(p.abs().sum() > 0) for p in model.parameters())
    assert_released(api, stack, task["id"])


def test_a_diloco_task_with_a_sharded_group_succeeds_and_its_download_is_whole(
    api: httpx.Client, stack: LocalStack
) -> None:
    """cpu-a's two workers hold their rows of the model (FSDP2) and each sends the parameter
    server only its own rows of a round; the last checkpoint's download holds cpu-a's
    optimizer state whole, built from its workers' files."""
    version = new_version(api, example="tiny_regression")
    groups = [{"name": "cpu-a", "workers": 2, "sharding": "fsdp"}, {"name": "cpu-b", "workers": 1}]
    task = submit(
        api, version, epochs=1, resource_groups=groups, sync_strategy="diloco", sync_period=2
    )
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    checkpoints = api.get(f"/api/v1/tasks/{task['id']}/checkpoints").json()
    # The epoch's checkpoint keeps each group's optimizer state (final.pt keeps none): cpu-a's
    # .metadata and its 2 workers' files, cpu-b's .metadata and its worker's file; each
    # checkpoint the model, as the parameter server's one owner wrote it (2 files).
    assert [c["sharded_files"] for c in checkpoints] == [5 + 2, 2], checkpoints
    kept = checkpoints[:1]
    blob = api.get(
        f"/api/v1/tasks/{task['id']}/checkpoints/{kept[-1]['id']}/download",
        timeout=DOWNLOAD_TIMEOUT_S,
    )
    assert blob.status_code == 200
    state = torch.load(io.BytesIO(blob.content), weights_only=True)
    from examples.tiny_regression import build_model, build_optimizer

    model = build_model()
    model.load_state_dict(state["model"])
    for group in (0, 1):  # each group's own optimizer, as the user's optimizer loads it
        optimizer = build_optimizer(model.parameters())
        optimizer.load_state_dict(state["group_optimizers"][group])
        moments = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert [tuple(v.shape) for v in moments] == [tuple(p.shape) for p in model.parameters()]
    assert_released(api, stack, task["id"])


def test_user_error_fails_task_with_traceback(api: httpx.Client, stack: LocalStack) -> None:
    version = new_version(api, source=FAILING_MODEL)
    task = submit(api, version)
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["status"] == "FAILED"
    text = "\n".join(line["text"] for line in api.get(f"/api/v1/tasks/{task['id']}/logs").json())
    assert "Traceback" in text and "model definition is broken" in text
    assert_released(api, stack, task["id"])


def test_cancel_running_task_stops_processes(api: httpx.Client, stack: LocalStack) -> None:
    version = new_version(api, example="tiny_regression")
    task = submit(api, version, epochs=10_000)
    wait_for(api, task["id"], {"RUNNING"})
    deadline = time.monotonic() + 60
    while not api.get(f"/api/v1/tasks/{task['id']}/metrics").json():
        assert time.monotonic() < deadline, "no metric arrived"
        time.sleep(0.3)
    # Agents beat every 3 s and the API writes the stamps within a second; on a loaded CI
    # host (a whole `make test` beside it) 20 s was not always enough.
    deadline = time.monotonic() + 90
    while not all(a["last_heartbeat_at"] for a in _nodes(api, task["id"])):
        assert time.monotonic() < deadline, "ranks never reported alive by their agents"
        time.sleep(0.5)
    assert api.post(f"/api/v1/tasks/{task['id']}/cancel").json()["status"] == "CANCELLED"
    assert_released(api, stack, task["id"])


def _nodes(api: httpx.Client, task_id: int) -> list[dict]:
    allocations = api.get(f"/api/v1/tasks/{task_id}/allocations").json()
    return [a for a in allocations if a["rank"] is not None]


def test_error_in_a_training_step_fails_task(api: httpx.Client, stack: LocalStack) -> None:
    version = new_version(api, source=FAILING_STEP)
    task = submit(api, version, epochs=3)
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["status"] == "FAILED"
    assert "exited with code 1: ValueError: loss exploded at call 5" in done["status_reason"]
    text = "\n".join(line["text"] for line in api.get(f"/api/v1/tasks/{task['id']}/logs").json())
    assert "Traceback" in text and "loss exploded at call 5" in text
    assert_released(api, stack, task["id"])


def test_agents_registered_with_hardware(api: httpx.Client) -> None:
    agents = api.get("/api/v1/agents").json()
    assert {a["name"] for a in agents if a["online"]} >= {"agent-cpu-a", "agent-cpu-b"}
    assert all(a["hardware"]["cpu_cores"] >= 1 for a in agents)


NAN_ON_RANK_2 = FAILING_STEP.replace(
    b"""    if CALLS[0] == 5:
        raise ValueError("loss exploded at call 5")""",
    b"""    import os
    # 6 profiling calls, steps 1-2, one validation call after epoch 0, step 3, then step 4
    if os.environ["RANK"] == "2" and CALLS[0] == 6 + 2 + 1 + 2:
        return torch.nn.functional.mse_loss(output.squeeze(-1), target) * float("nan")""",
)


def test_nan_loss_on_one_rank_fails_the_task_naming_where(
    api: httpx.Client, stack: LocalStack
) -> None:
    version = new_version(api, source=NAN_ON_RANK_2)
    task = submit(api, version, epochs=3, checkpoint_every=3)  # 2 steps per epoch
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["status"] == "FAILED", done["status_reason"]
    assert (
        "NonFiniteError: non-finite loss and gradient on rank 2 (group 'cpu-a') at epoch 1, step 4"
    ) in done["status_reason"]
    checkpoints = api.get(f"/api/v1/tasks/{task['id']}/checkpoints").json()
    assert [c["step"] for c in checkpoints] == [2, 3]  # the last good one is kept
    assert_released(api, stack, task["id"])


def test_a_plan_runs_its_trial_as_a_real_task_and_its_task_gets_an_eta(
    api: httpx.Client, stack: LocalStack
) -> None:
    """A plan's trial is scheduled on both groups, runs real ranks, reports its timings
    through the agent, ends SUCCEEDED and releases its workers; the plan then recommends
    and the task submitted from it has an ETA before its first step."""
    version = new_version(api, example="tiny_regression")
    created = api.post(
        "/api/v1/plans",
        json={
            "project_id": version["project_id"],
            "code_version_id": version["id"],
            "resource_groups": [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
            "global_batch_size": 16,
            "epochs": 2,
            "trial_steps": 2,
        },
    )
    assert created.status_code == 201, created.text
    plan = created.json()
    trial = wait_for(api, plan["trial_task_id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert trial["status"] == "SUCCEEDED", trial["status_reason"]
    assert_released(api, stack, trial["id"])
    ready = api.get(f"/api/v1/plans/{plan['id']}").json()
    assert ready["status"] == "ready", ready["error"]
    assert len(ready["options"]) == 6  # {a}, {b}, {a, b} × even, weighted
    assert all(o["step_s"] > 0 and o["finish_s"] > o["step_s"] for o in ready["options"])
    assert set(ready["marginal_gain_s"]) == {"cpu-a", "cpu-b"}
    task = api.post("/api/v1/tasks", json=ready["task_request"]).json()
    assert task["spec"]["plan_id"] == plan["id"]
    assert task["eta_s"] == pytest.approx(ready["best"]["finish_s"], rel=0.05)
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["status"] == "SUCCEEDED", done["status_reason"]
