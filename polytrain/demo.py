"""`polytrain demo` and `polytrain up`: the main job on the embedded default, on loopback."""

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from polytrain.stack import GroupSetup, LocalStack

DEMO_GROUPS = [
    GroupSetup("cpu-a", 2, description="CPU pool A (2 workers)"),
    GroupSetup("cpu-b", 1, description="CPU pool B (1 worker)"),
]
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
console = Console(stderr=True)


def submit_mnist(client: httpx.Client, *, epochs: int, global_batch_size: int) -> dict[str, Any]:
    """Create a project with the bundled MNIST example and submit it across both groups."""
    project = (
        client.post(
            "/api/v1/projects",
            json={
                "name": f"mnist-demo-{int(time.time())}",
                "description": "MNIST digits across two CPU resource groups",
            },
        )
        .raise_for_status()
        .json()
    )
    version = (
        client.post(
            f"/api/v1/projects/{project['id']}/code-versions", json={"example": "mnist_cnn"}
        )
        .raise_for_status()
        .json()
    )
    task = client.post(
        "/api/v1/tasks",
        json={
            "project_id": project["id"],
            "code_version_id": version["id"],
            "name": "MNIST CNN across cpu-a and cpu-b",
            "epochs": epochs,
            "global_batch_size": global_batch_size,
            "resource_groups": [{"name": g.name, "workers": g.workers} for g in DEMO_GROUPS],
        },
    )
    return dict(task.raise_for_status().json())


def follow(client: httpx.Client, task_id: int, timeout_s: float) -> dict[str, Any]:
    """Show a progress bar until the task ends; returns the final task."""
    columns = (
        TextColumn("[bold]{task.fields[status]:<10}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%  epoch {task.fields[epoch]}"),
        TimeElapsedColumn(),
    )
    deadline = time.monotonic() + timeout_s
    with Progress(*columns, console=console) as bar:
        row = bar.add_task("train", total=1.0, status="QUEUED", epoch=0)
        while True:
            task = client.get(f"/api/v1/tasks/{task_id}").raise_for_status().json()
            bar.update(row, completed=task["progress"], status=task["status"], epoch=task["epoch"])
            if task["status"] in TERMINAL or time.monotonic() > deadline:
                return dict(task)
            time.sleep(0.5)


def result_line(client: httpx.Client, task: dict[str, Any], wall_s: float) -> dict[str, Any]:
    metrics = client.get(f"/api/v1/tasks/{task['id']}/metrics").json()
    epoch_metrics = [m for m in metrics if m["rank"] is None]
    accuracy = [m["value"] for m in epoch_metrics if m["name"] == "val_accuracy"]
    epochs = {m["epoch"] for m in epoch_metrics if m["name"] == "val_accuracy"}
    return {
        "task_id": task["id"],
        "status": task["status"],
        "val_accuracy": round(accuracy[-1], 4) if accuracy else None,
        "epochs": len(epochs),
        "wall_s": round(wall_s, 1),
        "workers": {g["name"]: g["workers"] for g in task["spec"]["groups"]},
        "global_batch_size": task["spec"]["global_batch_size"],
        "checkpoints": len(client.get(f"/api/v1/tasks/{task['id']}/checkpoints").json()),
        # a group the guard parked (it cost more than it added) or took back, and why
        "guard": [
            e["reason"]
            for e in client.get(f"/api/v1/tasks/{task['id']}/events").json()
            if e["kind"] == "guard"
        ],
    }


def _exit_on_signals() -> None:
    """Turn the first SIGTERM, SIGINT or SIGHUP into SystemExit, so the stack's processes
    are stopped on the way out; later ones are ignored so that nothing cuts the shutdown
    short (a service manager, or `make` passing the signal on, may send several)."""
    stopping = False

    def handler(signum: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, handler)


def run_demo(*, port: int, epochs: int, global_batch_size: int, timeout_s: float) -> int:
    """Start the stack, train MNIST across two groups, print one JSON line, stop everything."""
    _exit_on_signals()
    data_dir = Path("var/demo").resolve()
    shutil.rmtree(data_dir, ignore_errors=True)
    stack = LocalStack(data_dir=data_dir, port=port, groups=DEMO_GROUPS)
    console.print(f"starting the API and two agents on {stack.url} ...")
    with stack, httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as client:
        task = submit_mnist(client, epochs=epochs, global_batch_size=global_batch_size)
        console.print(f"portal: {stack.url}/tasks/{task['id']}  (REST: {stack.url}/docs)")
        started = time.monotonic()
        task = follow(client, task["id"], timeout_s)
        line = result_line(client, task, time.monotonic() - started)
        if task["status"] != "SUCCEEDED":
            console.print(f"[red]task {task['status']}: {task['status_reason']}")
    print(json.dumps(line), flush=True)
    return 0 if line["status"] == "SUCCEEDED" else 1


def run_up(*, port: int, data_dir: Path | None = None) -> None:
    """Start the same portal (API and two agents) and keep it running until stopped.

    A child that dies (API or agent) is restarted with backoff while the others
    keep running (`LocalStack.supervise`). SIGTERM, SIGINT (Ctrl-C) or SIGHUP,
    to this process or its whole process group, stops every child, then exits.
    """
    _exit_on_signals()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stack = LocalStack(
        data_dir=(data_dir or Path("var/up")).resolve(), port=port, groups=DEMO_GROUPS
    )
    # A first admin of your choosing survives restarts; else one with a fresh password.
    stack.admin_email = os.environ.get("POLYTRAIN_ADMIN_EMAIL") or stack.admin_email
    stack.admin_password = os.environ.get("POLYTRAIN_ADMIN_PASSWORD") or stack.admin_password
    try:
        with stack:
            console.print(
                f"polytrain portal: {stack.url}   log in as {stack.admin_email} with "
                f"password {stack.admin_password} (kept in "
                f"{stack.data_dir / 'admin-password'}); Ctrl-C stops everything"
            )
            while True:
                time.sleep(0.5)
                stack.supervise()
    except SystemExit:
        console.print("stopped: the API and the agents are down")
        raise
