"""Benchmark `submit_to_first_step_s`: from `POST /api/v1/tasks` to the task's first optimizer step.

A whole stack on loopback (API with its scheduler, one agent per group, real
torch.distributed ranks), once on the production stack (PostgreSQL + a Redis
broker of its own, target <= 2 s) and once on the embedded default (SQLite
and the SQLAlchemy transport, target <= 5 s). The first step is seen through
the REST API: the task's `progress` turns positive (the parameter server
reports it after its first step). Each run is cancelled after its first step;
one warm-up run precedes the timed ones, which are `--pause` seconds apart so
the agents' warm interpreters are ready again (submissions closer together
than an agent can refill its pool start cold). Prints one JSON line per stack.

Then on the embedded default, two more lines (`--only cold` runs only these):
`submit_to_first_step_cold_s`, a user's first submission: a freshly started
stack whose agents keep no warm interpreters (`POLYTRAIN_WARM_POOL=0`), so
every rank is a fresh Python process importing torch; value = that first
submission (target <= 3 s), with `--runs` later cold submissions beside it.
`submit_to_first_step_back_to_back_s`: with the warm pools, `--runs`
submissions with no pause between them (after a warm-up), so the pools
cannot refill between tasks; median.

    python -m bench.submit_to_first_step [--runs 5] [--only redis|embedded|cold]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psycopg  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from bench.services import PG_SERVER, example_project, redis_server  # noqa: E402
from polytrain.stack import GroupSetup, LocalStack  # noqa: E402
from worker.engine.ranks import free_port  # noqa: E402

TARGETS = {"redis": 2.0, "embedded": 5.0}
COLD_TARGET_S = 3.0
GROUPS = [GroupSetup("cpu-a", 2), GroupSetup("cpu-b", 1)]


def _admin(sql: str) -> None:
    dsn = make_url(PG_SERVER).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql)


def first_step_s(api: httpx.Client, version: dict) -> float:
    """Seconds from submission to progress > 0; the task is then cancelled and released."""
    started = time.perf_counter()
    task = (
        api.post(
            "/api/v1/tasks",
            json={
                "project_id": version["project_id"],
                "code_version_id": version["id"],
                "resource_groups": [{"name": g.name, "workers": g.workers} for g in GROUPS],
                "epochs": 200,
                "global_batch_size": 16,
            },
        )
        .raise_for_status()
        .json()
    )
    while True:
        state = api.get(f"/api/v1/tasks/{task['id']}").json()
        if state["progress"] > 0:
            elapsed = time.perf_counter() - started
            break
        if state["status"] in ("FAILED", "CANCELLED") or time.perf_counter() - started > 120:
            raise RuntimeError(f"task {task['id']} {state['status']}: {state['status_reason']}")
        time.sleep(0.01)
    api.post(f"/api/v1/tasks/{task['id']}/cancel")
    while any(g["allocated_workers"] for g in api.get("/api/v1/resource-groups").json()):
        time.sleep(0.1)
    return elapsed


def measure(stack: LocalStack, runs: int, pause_s: float, warm_up: bool = True) -> list[float]:
    """Seconds to the first step of `runs` submissions `pause_s` apart, after one untimed
    submission when `warm_up`."""
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        _, version = example_project(api, "bench")
        timings = []
        for index in range(runs + warm_up):
            if index:
                time.sleep(pause_s)
            timings.append(first_step_s(api, version))
        return timings[1:] if warm_up else timings


def _stats(timings: list[float]) -> dict:
    return {
        "median_s": round(statistics.median(timings), 3),
        "max_s": round(max(timings), 3),
        "runs_s": [round(t, 3) for t in timings],
        "n": len(timings),
    }


def run_embedded_modes(runs: int, workdir: Path) -> list[dict]:
    """The embedded default cold (agents without warm interpreters: every rank a fresh
    process; the first submission on a freshly started stack, then `runs` more) and with
    the warm pools for `runs` back-to-back submissions (no pause: the pools cannot refill)."""
    cold_stack = LocalStack(
        data_dir=workdir / "cold",
        port=free_port(),
        groups=GROUPS,
        extra_env={"POLYTRAIN_WARM_POOL": "0"},
    )
    with cold_stack:
        cold = measure(cold_stack, runs + 1, 0.0, warm_up=False)
    with LocalStack(data_dir=workdir / "b2b", port=free_port(), groups=GROUPS) as stack:
        back_to_back = measure(stack, runs, 0.0)
    common = {
        "unit": "s",
        "broker": "sqlalchemy+sqlite",
        "database": "sqlite",
        "workers": {g.name: g.workers for g in GROUPS},
        "example": "tiny_regression",
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    return [
        {
            "benchmark": "submit_to_first_step_cold_s",
            "value": round(cold[0], 3),
            "target": COLD_TARGET_S,
            "stat": "first submission on a fresh stack, no warm interpreters",
            "warm_pool": False,
            "first_s": round(cold[0], 3),
            "later": _stats(cold[1:]),
            **common,
        },
        {
            "benchmark": "submit_to_first_step_back_to_back_s",
            "value": round(statistics.median(back_to_back), 3),
            "target": None,
            "stat": "median",
            "warm_pool": True,
            "pause_s": 0.0,
            **_stats(back_to_back),
            **common,
        },
    ]


def run_stack(kind: str, runs: int, workdir: Path, pause_s: float) -> dict:
    redis_proc, database = None, None
    stack = LocalStack(data_dir=workdir / kind, port=free_port(), groups=GROUPS)
    if kind == "redis":
        port = free_port()
        redis_proc = subprocess.Popen(redis_server(port), stdout=subprocess.DEVNULL)
        name = f"pt_bench_first_{os.getpid()}"
        _admin(f'CREATE DATABASE "{name}"')
        database = make_url(PG_SERVER).set(database=name).render_as_string(hide_password=False)
        stack.broker_url, stack.database_url = f"redis://127.0.0.1:{port}/0", database
    try:
        with stack:
            timings = measure(stack, runs, pause_s)
    finally:
        if redis_proc:
            redis_proc.terminate()
        if database:
            _admin(f'DROP DATABASE IF EXISTS "{make_url(database).database}" WITH (FORCE)')
    median = statistics.median(timings)
    return {
        "benchmark": "submit_to_first_step_s",
        "value": round(median, 3),
        "target": TARGETS[kind],
        "unit": "s",
        "stat": "median",
        "broker": "redis" if kind == "redis" else "sqlalchemy+sqlite",
        "database": "postgresql" if kind == "redis" else "sqlite",
        "runs_s": [round(t, 3) for t in timings],
        "max_s": round(max(timings), 3),
        "pause_s": pause_s,
        "workers": {g.name: g.workers for g in GROUPS},
        "example": "tiny_regression",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", choices=[*sorted(TARGETS), "cold"])
    parser.add_argument(
        "--pause", type=float, default=10.0, help="seconds between submissions (warm pools refill)"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="polytrain-bench-"))
    try:
        for kind in [args.only] if args.only else ["redis", "embedded", "cold"]:
            if kind == "cold":
                lines = run_embedded_modes(args.runs, workdir)
            else:
                lines = [run_stack(kind, args.runs, workdir, args.pause)]
            for line in lines:
                print(json.dumps(line), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0  # a missed target is a result, not a failure to run


if __name__ == "__main__":
    sys.exit(main())
