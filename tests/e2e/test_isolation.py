"""Uploaded code is untrusted: no platform secret, no other task's files, and limits that hold.

A member uploads a module that dumps its environment, tries to read the
platform's files and another user's checkpoints, connects to a service on a
fixed port (as a database or broker listens), and calls `/internal/v1`
against that user's task with every value it found. Everything it tries must
fail; the task's own training still works. Small limits end tasks FAILED with
the limit named.
"""

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from polytrain.stack import LocalStack
from tests.e2e.conftest import TINY, new_version, rank_dirs, submit, wait_for
from worker.agent import netpolicy
from worker.engine.ranks import jemalloc_path

PROBE = TINY.replace(
    "def build_datasets():",
    '''import json, os, urllib.request

import socket

PATHS = json.loads(PATHS_JSON)
VICTIM, API = VICTIM_ID, API_URL
SERVICE_PORT = SERVICE_PORT_NUMBER


def _connect(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return "connected"
    except OSError as exc:
        return "refused: " + type(exc).__name__


def _read(path):
    try:
        if os.path.isdir(path):
            return "listed: " + ",".join(os.listdir(path))
        with open(path, "rb") as fh:
            return "read: " + fh.read(200).decode("latin-1")
    except OSError as exc:
        return "refused: " + type(exc).__name__


def _call(method, path, token, body=None):
    request = urllib.request.Request(API + "/internal/v1" + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + token,
                                              "Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def _probe():
    found = {path: _read(path) for path in PATHS}
    read = [v[6:] for v in found.values() if v.startswith("read: ")]
    words = {w for text in [*os.environ.values(), *read] for w in text.split() if w.isprintable()}
    candidates = set(os.environ.values()) | words
    line = {"attempt": 1, "node": "intruder", "seq": 0, "time": "2026-01-01T00:00:00",
            "text": "INJECTED"}
    calls = []
    for token in sorted(c for c in candidates if c.isprintable()) + [""]:
        calls.append(_call("GET", f"/tasks/{VICTIM}/state", token))
        calls.append(_call("GET", f"/tasks/{VICTIM}/code", token))
        calls.append(_call("POST", f"/tasks/{VICTIM}/logs", token, {"lines": [line]}))
    print("@@probe " + json.dumps({"env": dict(os.environ), "files": found, "calls": calls,
                                   "uid": os.getuid(), "cwd": os.getcwd(),
                                   "service": _connect(SERVICE_PORT)}), flush=True)


def _forge_checkpoints():
    """Ask the agent to upload the database as this task's checkpoint, directly and by a link."""
    os.makedirs("checkpoints", exist_ok=True)
    os.symlink(PATHS[0], "checkpoints/linked.pt")
    for path in (PATHS[0], os.path.abspath("checkpoints/linked.pt")):
        event = {"type": "checkpoint", "path": path, "step": 0, "epoch": 0}
        print("@@polytrain " + json.dumps(event), flush=True)


def build_datasets():
    if os.environ.get("RANK") == "1":  # every compute worker builds the datasets: probe once
        _probe()
        _forge_checkpoints()''',
)


def probe_result(api: httpx.Client, task_id: int) -> dict:
    lines = [line["text"] for line in api.get(f"/api/v1/tasks/{task_id}/logs").json()]
    found = [json.loads(text[len("@@probe ") :]) for text in lines if text.startswith("@@probe ")]
    assert len(found) == 1, lines[-30:]
    return dict(found[0])


@pytest.fixture
def member(stack: LocalStack, api: httpx.Client) -> httpx.Client:
    email = f"member{time.monotonic_ns()}@example.org"
    created = api.post("/api/v1/users", json={"email": email, "password": "member-pass-123"})
    assert created.status_code == 201, created.text
    token = stack.login(email, "member-pass-123")
    return httpx.Client(
        base_url=stack.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
    )


def test_user_code_finds_no_secret_and_every_internal_call_is_refused(
    api: httpx.Client, member: httpx.Client, stack: LocalStack
) -> None:
    victim = submit(api, new_version(api, example="tiny_regression"), epochs=1)
    assert wait_for(api, victim["id"], {"SUCCEEDED", "FAILED"})["status"] == "SUCCEEDED"
    victim_checkpoints = api.get(f"/api/v1/tasks/{victim['id']}/checkpoints").json()
    assert victim_checkpoints
    victim_rank_dirs = rank_dirs(stack.data_dir, victim["id"])
    assert victim_rank_dirs
    data = stack.data_dir
    paths = [
        str(data / "polytrain.db"),
        str(data / "broker.db"),
        str(data / "admin-password"),
        str(data / "api.log"),
        str(data / "agent-cpu-a.log"),
        str(data),
        str(data / "checkpoints" / f"task-{victim['id']}" / "final.pt"),
        str(data / "agent"),
        str(data / "agent" / "ranks"),
        *[f"{d}/checkpoints/final.pt" for d in victim_rank_dirs],
        *victim_rank_dirs,
        "/proc/1/environ",
        "/etc/shadow",
    ]
    service = _service_on_a_fixed_port()  # as a database or broker listens, reachable by root
    source = (
        PROBE.replace("PATHS_JSON", repr(json.dumps(paths)))
        .replace("VICTIM_ID", str(victim["id"]))
        .replace("API_URL", repr(stack.url))
        .replace("SERVICE_PORT_NUMBER", str(service.getsockname()[1]))
    )
    probe = submit(member, new_version(member, source=source.encode()), epochs=1)
    with service:
        socket.create_connection(service.getsockname(), timeout=5).close()
        done = wait_for(member, probe["id"], {"SUCCEEDED", "FAILED"})
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    result = probe_result(member, probe["id"])

    env = result["env"]
    secrets = {stack.token, stack.admin_password, stack.admin_token}
    assert not secrets & set(env.values())
    assert not [
        k
        for k in env
        if k in ("DATABASE_URL", "BROKER_URL") or "TOKEN" in k or "PASSWORD" in k or "SECRET" in k
    ]
    assert {k for k in env if k.startswith("POLYTRAIN_")} <= {
        "POLYTRAIN_DIST_TIMEOUT_S",
        "POLYTRAIN_NUM_THREADS",
    }
    assert set(result["files"]) == set(paths)
    # The folders above its own rank directory exist in its sandbox, holding only the way down.
    own_way = {f"listed: {part}" for part in Path(result["cwd"]).parts}
    readable = {
        p: v for p, v in result["files"].items() if not v.startswith("refused") and v not in own_way
    }
    assert readable == {}, readable
    assert result["uid"] != 0
    assert result["service"] == "refused: ConnectionRefusedError", result["service"]
    assert result["calls"] and set(result["calls"]) == {401}, result["calls"]

    # Neither forged checkpoint was uploaded (the database file, directly or by a link).
    sizes = {c["size_bytes"] for c in member.get(f"/api/v1/tasks/{probe['id']}/checkpoints").json()}
    assert (data / "polytrain.db").stat().st_size not in sizes
    probe_logs = [line["text"] for line in member.get(f"/api/v1/tasks/{probe['id']}/logs").json()]
    assert len([text for text in probe_logs if text.startswith("refused checkpoint")]) == 2

    victim_logs = api.get(f"/api/v1/tasks/{victim['id']}/logs").json()
    assert not [line for line in victim_logs if line["text"] == "INJECTED"]
    assert api.get(f"/api/v1/tasks/{victim['id']}").json()["status"] == "SUCCEEDED"


def _service_on_a_fixed_port() -> socket.socket:
    """A listening socket on a free port below the ephemeral range, as services listen."""
    first, _ = netpolicy.ephemeral_ports()
    for port in range(first - 1, 1024, -1):
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", port))
        except OSError:
            listener.close()
            continue
        listener.listen()
        return listener
    raise RuntimeError("no free port below the ephemeral range")


def one_group() -> dict:
    return {
        "resource_groups": [{"name": "cpu-b", "workers": 1}],
        "epochs": 1,
        "global_batch_size": 8,
        "max_restarts": 2,
    }


def test_memory_limit_fails_the_task_naming_the_limit(api: httpx.Client) -> None:
    hog = TINY.replace(
        "def loss_fn(output, target):",
        """HOARD = []

def loss_fn(output, target):
    HOARD.append(torch.ones(2**27))  # 512 MiB on each call""",
    )
    version = new_version(api, source=hog.encode())
    task = submit(api, version, **one_group(), memory_limit_mb=700)
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED"})
    assert done["status"] == "FAILED"
    assert "memory_limit_mb=700 exceeded" in done["status_reason"], done["status_reason"]
    assert done["attempt"] == 1  # a limit is the user's: no restart


# A 34M-parameter MLP with SGD and momentum: 0.4 GiB of parameters, gradients and momentum.
# Under the agent (2026-12-01; 8 blocks rather than 12, a third less of this test's time), a
# whole worker needs between 900 and 950 MiB of data memory (it fails at 900 and runs at
# 950) and, with the workers sharded, the parameter server between 650 and 700 (it fails at
# 650 and runs at 700); the limit below lies 100 MiB from each.
# Its checkpoint (model and momentum, 0.27 GB) fits the platform's upload limit.
BIG_MLP = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def build_model():
    blocks = [nn.Sequential(nn.Linear(2048, 2048), nn.Tanh()) for _ in range(8)]
    return nn.Sequential(*blocks, nn.Linear(2048, 1))

def build_datasets():
    x = torch.randn(24, 2048, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x[:16], x[:16, :1].clone()), TensorDataset(x[16:], x[16:, :1].clone())

def build_optimizer(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""


def test_a_model_too_large_whole_trains_sharded_under_the_same_limit(api: httpx.Client) -> None:
    version = new_version(api, source=BIG_MLP.encode())
    limits = {
        "resource_groups": [{"name": "cpu-a", "workers": 2}],
        "epochs": 1,
        "global_batch_size": 8,
        "max_restarts": 0,
        "memory_limit_mb": 800,
        # one profile of 6 steps rather than two (the weighted split profiles again at its
        # shares): most of this test's time, and two equal workers split evenly anyway
        "split_policy": "even",
    }
    whole = submit(api, version, **limits)
    done = wait_for(api, whole["id"], {"SUCCEEDED", "FAILED"})
    assert done["status"] == "FAILED"
    assert "memory_limit_mb=800 exceeded" in done["status_reason"], done["status_reason"]
    sharded = submit(api, version, **limits, sharding="fsdp")
    done = wait_for(api, sharded["id"], {"SUCCEEDED", "FAILED"})
    assert done["status"] == "SUCCEEDED", done["status_reason"]
    checkpoints = api.get(f"/api/v1/tasks/{sharded['id']}/checkpoints").json()
    assert checkpoints, "the sharded task saved no checkpoint"
    # Sharded workers run on glibc's malloc unless the agent's host asks for jemalloc
    # (POLYTRAIN_JEMALLOC, worker.engine.ranks.allocator_env); the group's leader says which.
    logs = api.get(f"/api/v1/tasks/{sharded['id']}/logs", params={"limit": 10_000}).json()
    on_glibc = [line["text"] for line in logs if "glibc's malloc" in line["text"]]
    assert len(on_glibc) == (0 if jemalloc_path() else 1), on_glibc


def test_wall_clock_limit_fails_the_task_naming_the_limit(api: httpx.Client) -> None:
    slow = TINY.replace(
        "def loss_fn(output, target):",
        """import time

def loss_fn(output, target):
    time.sleep(3)""",
    )
    version = new_version(api, source=slow.encode())
    task = submit(api, version, **one_group(), max_runtime_s=4)
    done = wait_for(api, task["id"], {"SUCCEEDED", "FAILED"})
    assert done["status"] == "FAILED"
    assert "max_runtime_s=4 exceeded" in done["status_reason"], done["status_reason"]
    assert done["attempt"] == 1


def test_limits_are_validated_naming_the_field(api: httpx.Client) -> None:
    version = new_version(api, example="tiny_regression")
    for field, value in (("memory_limit_mb", 1), ("max_runtime_s", 0)):
        response = api.post(
            "/api/v1/tasks",
            json={
                "project_id": version["project_id"],
                "code_version_id": version["id"],
                "resource_groups": [{"name": "cpu-b", "workers": 1}],
                field: value,
            },
        )
        assert response.status_code == 422, response.text
        assert field in response.text
