"""A live stack for end-to-end tests: API, broker, two agents, real torch.distributed."""

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.tasks.models import TaskStatus
from polytrain.stack import GroupSetup, LocalStack
from worker.engine.ranks import free_port

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}

# Agents without warm interpreters: each rank starts cold. On this 2-core host the warm
# pool's spare interpreters (each agent keeps workers + 1 importing torch, and refills after
# every task) took CPU the tests' own ranks were waiting for: 3 end-to-end tests took 49 s
# with it and 37 s without (2026-11-27). The warm path stays tested where it matters most,
# in test_isolation (a warm interpreter sees no secret) and the browser tests' stack.
COLD_RANKS = {"POLYTRAIN_WARM_POOL": "false"}
WARM_POOL_MODULES = {"tests.e2e.test_isolation"}

DOWNLOAD_TIMEOUT_S = 180
"""A checkpoint's download is built on demand from its files: past the client's 30 s on a
loaded host (three runs of make test on 2026-11-30 at load 9-11), in well under 30 alone."""


# A tiny training module that trains: a linear model on random sums (tests change a part).
TINY = """
import torch

def build_model():
    return torch.nn.Linear(4, 1)

def build_datasets():
    x = torch.randn(32, 4)
    return [(x[i], x[i].sum()) for i in range(32)], [(x[i], x[i].sum()) for i in range(8)]

def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output.squeeze(-1), target)
"""


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LocalStack]:
    data_dir = tmp_path_factory.mktemp("stack")
    groups = [GroupSetup("cpu-a", 2), GroupSetup("cpu-b", 1)]
    env = {} if request.module.__name__ in WARM_POOL_MODULES else COLD_RANKS
    # No test of these modules loses an agent (test_fault_tolerance has a stack of its own,
    # with a 6 s timeout): a 60 s heartbeat timeout keeps a CI host under a whole `make test`
    # from declaring a busy agent lost (the 50M-parameter task test_isolation then ran saw its
    # agent judged lost after 15 s on 2026-11-29, with the host's load average at 13).
    env = {**env, "POLYTRAIN_HEARTBEAT_TIMEOUT_S": "60"}
    with LocalStack(data_dir=data_dir, port=free_port(), groups=groups, extra_env=env) as running:
        yield running


@pytest.fixture
def api(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as client:
        yield client
        cancel_unfinished(client)


def cancel_unfinished(api: httpx.Client) -> None:
    """Cancel every task of the stack not finished yet: a test that failed before its task
    ended (a 10,000-epoch task left running when its assertion failed) would otherwise hold
    the stack's workers, and every later test of the module would wait 480 s for a task that
    stays QUEUED (a slow CI host saw one failure become four)."""
    for status in (s.value for s in TaskStatus if not s.terminal):
        for task in api.get("/api/v1/tasks", params={"status": status, "limit": 500}).json():
            api.post(f"/api/v1/tasks/{task['id']}/cancel")


def wait_for(api: httpx.Client, task_id: int, statuses: set[str], timeout_s: float = 480) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        task = api.get(f"/api/v1/tasks/{task_id}").json()
        if task["status"] in statuses:
            return dict(task)
        time.sleep(0.3)
    logs = api.get(f"/api/v1/tasks/{task_id}/logs").json()
    tail = "\n".join(f"{line['node']}: {line['text']}" for line in logs[-30:])
    raise AssertionError(f"task {task_id} is {task['status']} after {timeout_s} s:\n{tail}")


def rank_dirs(data_dir: Path, task_id: int, attempt: int | None = None) -> list[str]:
    """The sandboxed rank directories of `task_id` (of one `attempt`, else of all): the agent
    links them as `agent/task-<id>/rank-<r>` (attempt 1) and `.../attempt-<n>/rank-<r>`."""
    task_dir = data_dir / "agent" / f"task-{task_id}"
    found = []
    for folder, dirs, files in os.walk(task_dir):
        here = 1 if Path(folder) == task_dir else int(Path(folder).name.split("-")[-1])
        for name in dirs + files:
            link = os.path.join(folder, name)
            if name.startswith("rank-") and os.path.islink(link) and attempt in (None, here):
                found.append(os.readlink(link))
    return found


def training_processes(data_dir: Path, task_id: int, attempt: int | None = None) -> list[int]:
    """PIDs of live processes started for `task_id` (its `attempt`, else any) in this stack."""
    markers = rank_dirs(data_dir, task_id, attempt)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().split()[2]
            cwd = os.readlink(proc / "cwd")  # a rank runs in its own folder (bound as is)
        except OSError:
            continue
        mine = any(m + " " in cmdline or cwd == m or cwd.startswith(m + "/") for m in markers)
        if mine and state != "Z":
            found.append(int(proc.name))
    return found


def submit(api: httpx.Client, version: dict, **overrides: object) -> dict:
    spec = {
        "project_id": version["project_id"],
        "code_version_id": version["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        "epochs": 2,
        "global_batch_size": 16,
        # The guard decides from measured step times, so on a loaded host it may park a
        # group of this tiny model (one group alone skips the cross-group exchange): these
        # tests check what every group does, so they turn it off (tests/worker/engine/
        # test_guard.py tests the guard, with a schedule).
        "guard": False,
    }
    spec.update(overrides)
    response = api.post("/api/v1/tasks", json=spec)
    assert response.status_code == 201, response.text
    return dict(response.json())


def new_version(
    api: httpx.Client,
    *,
    example: str | None = None,
    source: bytes | None = None,
    project_name: str | None = None,
) -> dict:
    """A new project (named `project_name`, else a fresh name) with one code version: the
    built-in `example`, else `source` uploaded as train.py; the version as REST answers it."""
    name = project_name or f"p{time.monotonic_ns()}"
    project = api.post("/api/v1/projects", json={"name": name}).json()
    if example:
        response = api.post(
            f"/api/v1/projects/{project['id']}/code-versions", json={"example": example}
        )
    else:
        response = api.post(
            f"/api/v1/projects/{project['id']}/code-versions/upload",
            files={"file": ("train.py", source or b"", "text/x-python")},
        )
    assert response.status_code == 201, response.text
    return dict(response.json())
