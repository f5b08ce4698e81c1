"""Fault tolerance end to end, on PostgreSQL + Redis when configured (else the embedded default).

A chaos test kills an agent (SIGKILL) in the middle of training: the task alarms once the
heartbeat timeout has passed (at the scheduler's next scan), restarts on healthy capacity
of a compatible group, resumes from its last checkpoint, and ends with the accuracy of an
undisturbed run; every node's log sequence has no gap and no duplicate. A killed worker
process restarts the task at once. A lost group, with no spare capacity, shrinks the task
onto the survivors. Every end releases everything. One stack serves every test here.
"""

import io
import os
import signal
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import torch

from polytrain.stack import GroupSetup, LocalStack
from tests import production
from tests.e2e.conftest import (
    COLD_RANKS,
    DOWNLOAD_TIMEOUT_S,
    new_version,
    submit,
    training_processes,
    wait_for,
)
from worker.engine.ranks import free_port

GROUPS = [GroupSetup("cpu-a", 2), GroupSetup("cpu-b", 1), GroupSetup("cpu-c", 2)]
# A lost agent is detected once the heartbeat timeout has passed: 6 s with a heartbeat
# every second (as tests/e2e/test_api_restart.py, where no false alarm may come of it), not
# the default 15 s, so that the waits for an alarm here take seconds, not tens of seconds.
TIMEOUT_S, SCAN_S = 6.0, 0.5
HEARTBEATS = {
    "POLYTRAIN_HEARTBEAT_TIMEOUT_S": str(TIMEOUT_S),
    "POLYTRAIN_HEARTBEAT_INTERVAL_S": "1",
    "POLYTRAIN_SCHEDULER_INTERVAL_S": str(SCAN_S),
}
# The latest an alarm may come after a kill: the last heartbeat came at the kill at the
# latest, the agent is lost TIMEOUT_S after it, the scheduler sees that at its next scan
# (every SCAN_S), and its transaction commits (1 s allowed on this loaded 2-core host). A CI
# run saw 6.007 s against a bound of TIMEOUT_S alone, which left out the scan.
DETECTED_WITHIN_S = TIMEOUT_S + SCAN_S + 1.0
ENDED = {"SUCCEEDED", "FAILED", "CANCELLED"}


def serve(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[LocalStack]:
    """API and one agent per group of GROUPS, on a fresh database (production stack when
    configured), stopped and dropped at the end."""
    on_production = production.enabled()
    database = production.fresh_database(migrated=False) if on_production else None
    stack = LocalStack(
        data_dir=tmp_path_factory.mktemp(name),
        port=free_port(),
        groups=GROUPS,
        database_url=database,
        broker_url=production.fresh_broker() if on_production else None,
        extra_env={**HEARTBEATS, **COLD_RANKS},
    )
    with stack:
        yield stack
    if database:
        production.drop_database(database)


@pytest.fixture(scope="module")
def ft_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """API and one agent per group: cpu-a, cpu-b, and cpu-c as spare capacity."""
    yield from serve(tmp_path_factory, "ft")


@pytest.fixture
def ft_api(ft_stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ft_stack.url, timeout=30, headers=ft_stack.headers) as client:
        yield client


def epoch_metrics(api: httpx.Client, task_id: int, name: str) -> dict[int, float]:
    metrics = api.get(f"/api/v1/tasks/{task_id}/metrics", params={"name": name}).json()
    return {m["epoch"]: m["value"] for m in metrics if m["rank"] is None}


def assert_logs_gap_free(api: httpx.Client, task_id: int) -> dict[tuple[int, str], int]:
    """Per attempt and node, seq runs 0, 1, 2, ... in arrival order; returns line counts."""
    seqs: dict[tuple[int, str], list[int]] = defaultdict(list)
    after = 0
    while batch := api.get(
        f"/api/v1/tasks/{task_id}/logs", params={"after_id": after, "limit": 10_000}
    ).json():
        for line in batch:
            seqs[(line["attempt"], line["node"])].append(line["seq"])
        after = batch[-1]["id"]
    for key, found in seqs.items():
        assert sorted(found) == list(range(len(found))), f"{key}: gap or duplicate"
    return {key: len(found) for key, found in seqs.items()}


def assert_released(api: httpx.Client, stack: LocalStack, task: dict) -> None:
    """No allocation held, no process left, the parameter server's port closed."""
    allocations = api.get(f"/api/v1/tasks/{task['id']}/allocations").json()
    assert allocations and all(a["released_at"] for a in allocations)
    deadline = time.monotonic() + 15
    while training_processes(stack.data_dir, task["id"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert training_processes(stack.data_dir, task["id"]) == []
    rendezvous = api.get(f"/api/v1/tasks/{task['id']}").json()
    host, port = rendezvous.get("master_addr"), rendezvous.get("master_port")
    if host and port:
        with pytest.raises(OSError), socket.create_connection((host, port), timeout=2):
            pass
    assert all(g["allocated_workers"] == 0 for g in api.get("/api/v1/resource-groups").json())


def wait_checkpoints(api: httpx.Client, task_id: int, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(api.get(f"/api/v1/tasks/{task_id}/checkpoints").json()) < count:
        assert time.monotonic() < deadline, "no checkpoint arrived"
        time.sleep(0.2)


def _utc(stamp: str) -> datetime:
    """A naive UTC time from the API's ISO 8601 (with or without an offset)."""
    parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return parsed.astimezone(UTC).replace(tzinfo=None) if parsed.tzinfo else parsed


MNIST = {"epochs": 3, "global_batch_size": 64, "seed": 7}


def test_chaos_agent_killed_mid_training(ft_api: httpx.Client, ft_stack: LocalStack) -> None:
    version = new_version(ft_api, example="mnist_cnn")
    calm = submit(ft_api, version, **MNIST)
    assert wait_for(ft_api, calm["id"], ENDED, 150)["status"] == "SUCCEEDED"
    expected = epoch_metrics(ft_api, calm["id"], "val_accuracy")

    task = submit(ft_api, version, **MNIST)
    wait_checkpoints(ft_api, task["id"], 2)  # epochs 0 and 1 are saved; epoch 2 is training
    # ... with their shard provenance, which the agent stores in a request after the
    # checkpoint's: an agent killed between the two loses that epoch's record (a known gap,
    # docs/architecture.md, "Training engine"), which is not what this test is about.
    deadline = time.monotonic() + 30
    while len(ft_api.get(f"/api/v1/tasks/{task['id']}/provenance").json()["epochs"]) < 2:
        assert time.monotonic() < deadline, "epoch 1's provenance did not arrive"
        time.sleep(0.1)
    killed_at = datetime.now(UTC).replace(tzinfo=None)
    ft_stack.kill_agent("agent-cpu-a")  # hosts the parameter server and ranks 1-2
    deadline = time.monotonic() + 3  # they may take up to 3 s to go
    while (orphans := _orphans(ft_stack, task["id"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert orphans == [], "the killed agent's training processes outlived it"

    done = wait_for(ft_api, task["id"], ENDED, 150)
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    assert done["attempt"] == 2
    events = ft_api.get(f"/api/v1/tasks/{task['id']}/events").json()
    alarm = next(e for e in events if e["kind"] == "alarm")
    assert "agent-cpu-a" in alarm["reason"]
    detected_s = (_utc(alarm["created_at"]) - killed_at).total_seconds()
    assert detected_s <= DETECTED_WITHIN_S, f"detected after {detected_s:.3f} s"
    statuses = [e["to_status"] for e in events if e["kind"] == "status"]
    assert statuses[-5:] == ["RESTARTING", "QUEUED", "SCHEDULED", "RUNNING", "SUCCEEDED"]
    assert [g["name"] for g in done["spec"]["groups"]] == ["cpu-c", "cpu-b"]  # migrated
    resumed = [
        line["text"]
        for line in ft_api.get(f"/api/v1/tasks/{task['id']}/logs", params={"limit": 10_000}).json()
        if line["attempt"] == 2 and "resumed at epoch" in line["text"]
    ]
    assert resumed, "the second attempt did not resume from a checkpoint"

    accuracy = epoch_metrics(ft_api, task["id"], "val_accuracy")
    last = max(expected)
    print(
        f"chaos: detected after {detected_s:.1f} s; val_accuracy undisturbed "
        f"{expected[last]:.4f}, disturbed {accuracy[last]:.4f}"
    )
    assert abs(accuracy[last] - expected[last]) <= 0.005, (accuracy, expected)
    # Where every sample went, across the restart: each epoch once, by the attempt that kept it.
    epochs = ft_api.get(f"/api/v1/tasks/{task['id']}/provenance").json()["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    assert all(e["exactly_once"] for e in epochs), [(e["epoch"], e["samples"]) for e in epochs]
    assert {a for e in epochs for a in e["attempts"]} == {1, 2}
    assert all(r["host"] for e in epochs for r in e["records"])
    counts = assert_logs_gap_free(ft_api, task["id"])
    assert {node for attempt, node in counts if attempt == 2} >= {"ps", "rank-1", "rank-3"}
    assert_released(ft_api, ft_stack, done)
    assert_released(ft_api, ft_stack, calm)

    ft_stack.start_agent(GROUPS[0])  # the group is served again for the next tests
    ft_stack.wait_agents(60)


def _orphans(stack: LocalStack, task_id: int) -> list[int]:
    """Live processes of the first attempt's ranks 0-2 (the killed agent-cpu-a's)."""
    return [
        p
        for p in training_processes(stack.data_dir, task_id, attempt=1)
        if _rank_of(p) in (0, 1, 2)
    ]


def _rank_of(pid: int) -> int | None:
    """The rank a process runs: started cold (RANK in its environment) or warm (pt-rank-N)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if comm.startswith("pt-rank-") and comm[8:].isdigit():
        return int(comm[8:])
    found = [v for v in environ if v.startswith(b"RANK=")]
    return int(found[0][5:]) if found else None


def _rank_pid(stack: LocalStack, task_id: int, rank: int) -> int:
    for pid in training_processes(stack.data_dir, task_id):
        if _rank_of(pid) == rank:
            return pid
    raise AssertionError(f"no process of rank {rank}")


@pytest.mark.parametrize("rank", [3, 0], ids=["worker", "parameter_server"])
def test_killed_process_restarts_the_task(
    ft_api: httpx.Client, ft_stack: LocalStack, rank: int
) -> None:
    version = new_version(ft_api, example="mnist_cnn")
    task = submit(ft_api, version, epochs=2, global_batch_size=64)
    wait_checkpoints(ft_api, task["id"], 1)  # epoch 0 is saved; epoch 1 is training
    os.kill(_rank_pid(ft_stack, task["id"], rank), signal.SIGKILL)
    done = wait_for(ft_api, task["id"], ENDED, 150)
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    assert done["attempt"] == 2
    alarm = next(
        e for e in ft_api.get(f"/api/v1/tasks/{task['id']}/events").json() if e["kind"] == "alarm"
    )
    assert "exited with code -9" in alarm["reason"]
    assert_logs_gap_free(ft_api, task["id"])
    assert_released(ft_api, ft_stack, done)


def test_a_sharded_task_resumes_from_its_workers_state_and_downloads_whole(
    ft_api: httpx.Client, ft_stack: LocalStack
) -> None:
    """Group cpu-a holds its model sharded (FSDP2): its two workers keep the optimizer state
    of each checkpoint, each uploading its own file through its agent. A worker killed after
    the first epoch's checkpoint is whole restarts the task; the new attempt's workers fetch
    that state and resume from it; the final checkpoint downloads as one state dict."""
    version = new_version(ft_api, example="mnist_cnn")
    groups = [{"name": "cpu-a", "workers": 2, "sharding": "fsdp"}, {"name": "cpu-b", "workers": 1}]
    task = submit(ft_api, version, epochs=3, global_batch_size=64, resource_groups=groups)
    wait_checkpoints(ft_api, task["id"], 1)
    listing = f"/api/v1/tasks/{task['id']}/checkpoints"
    deadline = time.monotonic() + 60
    while not (first := ft_api.get(listing).json()[0])["complete"]:  # its files arriving
        assert time.monotonic() < deadline, first
        time.sleep(0.1)
    assert first["sharded_files"] == 3  # .metadata and one file from each of cpu-a's workers
    os.kill(_rank_pid(ft_stack, task["id"], 2), signal.SIGKILL)
    early = ft_api.get(f"{listing}/{first['id']}/download", timeout=DOWNLOAD_TIMEOUT_S)
    assert early.status_code == 200, early.text
    done = wait_for(ft_api, task["id"], ENDED, 150)
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    assert done["attempt"] == 2
    logs = ft_api.get(f"/api/v1/tasks/{task['id']}/logs", params={"limit": 10_000}).json()
    resumed = {x["node"] for x in logs if x["attempt"] == 2 and "resumed at epoch" in x["text"]}
    assert {"rank-1", "rank-2"} <= resumed, resumed  # cpu-a's workers, from their state
    final = ft_api.get(f"/api/v1/tasks/{task['id']}/checkpoints").json()[-1]
    assert final["sharded_files"] == 3
    body = ft_api.get(
        f"/api/v1/tasks/{task['id']}/checkpoints/{final['id']}/download",
        timeout=DOWNLOAD_TIMEOUT_S,
    )
    assert body.status_code == 200, body.text
    state = torch.load(io.BytesIO(body.content), weights_only=True)
    shapes = {tuple(v.shape) for v in state["model"].values() if v.dim() > 0}
    moments = [v for s in state["optimizer"]["state"].values() for v in s.values() if v.dim() > 0]
    assert moments and {tuple(v.shape) for v in moments} <= shapes  # whole, not rows
    assert_released(ft_api, ft_stack, done)


def test_a_lost_group_shrinks_the_task_onto_the_survivors(
    ft_api: httpx.Client, ft_stack: LocalStack
) -> None:
    """Three groups, no spare capacity; the agent of one is killed mid-epoch: the task
    goes on with the other two from its last checkpoint (on_group_loss: shrink, the
    default), continues that epoch where it stopped, SUCCEEDS, and every training sample
    is used exactly once per epoch across the loss (shard provenance)."""
    version = new_version(ft_api, example="mnist_cnn")
    every = [{"name": g.name, "workers": g.workers} for g in GROUPS]  # all of each group
    task = submit(
        ft_api,
        version,
        resource_groups=every,
        epochs=1,
        global_batch_size=64,
        checkpoint_every=5,
        seed=7,
    )
    wait_checkpoints(ft_api, task["id"], 1)  # step-5.pt: early in epoch 0
    ft_stack.kill_agent("agent-cpu-b")  # one worker of three groups, not the parameter server
    done = wait_for(ft_api, task["id"], ENDED, 240)
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    assert done["attempt"] == 2
    assert [(g["name"], g["workers"]) for g in done["spec"]["groups"]] == [
        ("cpu-a", 2),
        ("cpu-c", 2),
    ]
    logs = ft_api.get(f"/api/v1/tasks/{task['id']}/logs", params={"limit": 10_000}).json()
    assert any(
        line["attempt"] == 2 and "continues epoch 0 at step" in line["text"] for line in logs
    ), "the second attempt did not go on with the interrupted epoch"
    epochs = ft_api.get(f"/api/v1/tasks/{task['id']}/provenance").json()["epochs"]
    (epoch,) = epochs
    assert epoch["exactly_once"], epoch["samples"]
    assert epoch["attempts"] == [1, 2]
    assert {r["group"] for r in epoch["records"] if r["attempt"] == 2} == {"cpu-a", "cpu-c"}
    assert_released(ft_api, ft_stack, done)

    ft_stack.start_agent(GROUPS[1])  # the group is served again for any later test
    ft_stack.wait_agents(60)
