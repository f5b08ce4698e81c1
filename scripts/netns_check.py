"""Drive the namespace cluster of `netns_cluster.sh` from the API's host: groups, one task
across the three agents (group cpu-a on two hosts), checks that its nodes ran on the agents'
addresses and that its final parameters equal a single-process replay; one JSON line.

    PYTHONPATH=. python scripts/netns_check.py API_URL ADMIN_EMAIL ADMIN_PASSWORD \
        ADDR_A1 ADDR_A2 ADDR_B groups|task

Exactness without any debug option a task could set: the split of the `even` policy is a
pure function of the seed, the epoch and the shares (`worker.engine.split`), so this
script derives every step's global batch the way the engine's session does
(`seeded_batches`, checked against the recorded batches by
tests/worker/engine/test_equivalence.py), trains one process on them in order with the same code
(tests/worker/engine/reference.py, as the equivalence tests do), and compares the result
with the task's last checkpoint, downloaded through the REST API.
"""

import io
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tests.worker.engine.reference import reference_run, seeded_batches
from worker.engine.contract import load_training_code
from worker.engine.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, GLOBAL_BATCH_SIZE, SEED = 3, 16, 5
GROUPS = [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}]
TOLERANCE = 1e-5
# netns_cluster.sh listens here, on the broker's host, which runs no rank.
PROBE_HOST, PROBE_PORT = "10.77.0.2", 45000


def wait(check, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = check()
            if found:
                return found
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} within {timeout_s:.0f} s")


def client(url: str, email: str, password: str) -> httpx.Client:
    """An admin's client of the API, once the API answers."""
    wait(lambda: httpx.get(f"{url}/api/v1/health").status_code == 200, 90, "API up")
    token = httpx.post(
        f"{url}/api/v1/auth/login",
        json={"email": email, "password": password, "token_name": "netns"},
    ).json()["token"]
    return httpx.Client(
        base_url=f"{url}/api/v1", timeout=30, headers={"Authorization": f"Bearer {token}"}
    )


def create_groups(api: httpx.Client) -> None:
    for name, capacity in (("cpu-a", 2), ("cpu-b", 1)):
        response = api.post(
            "/resource-groups", json={"name": name, "device_type": "cpu", "capacity": capacity}
        )
        assert response.status_code in (201, 409), response.text


PROBE = f"""

def _probe():
    import socket
    try:
        socket.create_connection(("{PROBE_HOST}", {PROBE_PORT}), timeout=3).close()
        return "connected"
    except OSError as exc:
        return "refused " + type(exc).__name__


print("probe " + _probe(), flush=True)
"""


def control_probe() -> str:
    """The same connection from this (unsandboxed) client: the listener is there."""
    scope: dict[str, object] = {}
    exec(PROBE.replace('print("probe " + _probe(), flush=True)', ""), scope)  # noqa: S102
    return str(scope["_probe"]())  # type: ignore[operator]


def max_difference(api: httpx.Client, task: dict) -> float:
    """The largest absolute difference between the task's last checkpoint's parameters and a
    single-process replay of its seeded batches (the example's code, seeded alike)."""
    checkpoints = api.get(f"/tasks/{task['id']}/checkpoints").json()
    last = max(checkpoints, key=lambda c: (c["step"], c["id"]))
    # built on demand from the checkpoint's files: over 30 s on a loaded host
    body = api.get(f"/tasks/{task['id']}/checkpoints/{last['id']}/download", timeout=180).content
    state = torch.load(io.BytesIO(body), weights_only=False)
    assert last["epoch"] == EPOCHS - 1 and state["epoch_complete"], (last, state["epoch"])
    spec = RunSpec.model_validate(
        {
            "task_id": task["id"],
            "code": str(ROOT / "examples" / "tiny_regression.py"),
            "epochs": EPOCHS,
            "global_batch_size": GLOBAL_BATCH_SIZE,
            "seed": SEED,
            "groups": [{**g, "device_type": "cpu"} for g in GROUPS],
            "checkpoint_dir": tempfile.gettempdir(),  # the replay writes none
        }
    )
    code = load_training_code(spec.code)
    n_items = len(code.build_datasets()[0])  # type: ignore[arg-type]
    expected, _ = reference_run(spec, seeded_batches(spec, n_items))
    model = code.build_model()
    model.load_state_dict(state["model"])
    got = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    return float((got - expected).abs().max())


def run_task(api: httpx.Client, addr_a1: str, addr_a2: str, addr_b: str) -> int:
    started = time.monotonic()
    wait(
        lambda: (
            {g["name"]: g["agents_online"] for g in api.get("/resource-groups").json()}
            == {"cpu-a": 2, "cpu-b": 1}
        ),
        120,
        "agents online",
    )
    project = api.post("/projects", json={"name": "netns"}).json()
    # The example, plus a probe: each rank tries a listener on the broker's host, on a port in
    # the ephemeral range where rendezvous ports lie. That host runs no rank of the task.
    source = (ROOT / "examples" / "tiny_regression.py").read_text() + PROBE
    version = api.post(
        f"/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", source.encode(), "text/x-python")},
    ).json()
    task = api.post(
        "/tasks",
        json={
            "project_id": project["id"],
            "code_version_id": version["id"],
            "epochs": EPOCHS,
            "global_batch_size": GLOBAL_BATCH_SIZE,
            "seed": SEED,
            "resource_groups": GROUPS,
        },
    ).json()
    done = wait(
        lambda: (
            (t := api.get(f"/tasks/{task['id']}").json())["status"]
            in ("SUCCEEDED", "FAILED", "CANCELLED")
            and t
        ),
        300,
        "task ended",
    )
    probes = sorted(
        {
            line["text"]
            for line in api.get(f"/tasks/{task['id']}/logs", params={"limit": 1000}).json()
            if line["text"].startswith("probe ")
        }
    )
    hosts = {
        (a["resource_group"], a["host"])
        for a in api.get(f"/tasks/{task['id']}/allocations").json()
        if a["role"] == "compute"
    }
    parts = [
        (s["resource_group"], s["part"], s["first_rank"], s["workers"], s["hosts_parameter_server"])
        for s in api.get(f"/tasks/{task['id']}/sub-tasks").json()
    ]
    difference = max_difference(api, task) if done["status"] == "SUCCEEDED" else None
    print(
        json.dumps(
            {
                "script": "netns_cluster",
                "status": done["status"],
                "status_reason": done["status_reason"],
                "master_addr": done.get("master_addr"),
                "compute_hosts": sorted(hosts),
                "parts": sorted(parts),
                "max_abs_difference": difference,
                "probes": probes,
                "control_probe": control_probe(),
                "wall_s": round(time.monotonic() - started, 1),
            }
        )
    )
    ok = (
        done["status"] == "SUCCEEDED"
        and hosts == {("cpu-a", addr_a1), ("cpu-a", addr_a2), ("cpu-b", addr_b)}
        and done.get("master_addr") in (addr_a1, addr_a2)
        and difference is not None
        and difference <= TOLERANCE
    )
    return 0 if ok else 1


def main(
    url: str, email: str, password: str, addr_a1: str, addr_a2: str, addr_b: str, step: str
) -> int:
    api = client(url, email, password)
    if step == "groups":
        create_groups(api)
        return 0
    return run_task(api, addr_a1, addr_a2, addr_b)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:8]))
