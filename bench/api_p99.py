"""Benchmark `api_p99_ms`: task listing and status reads under 50 concurrent clients (locust),
alone and with the writes of a working deployment in the mix.

The API (with its scheduler) runs on loopback on the production stack when
PostgreSQL is reachable (else the embedded default), holding 500 tasks, as
`--api-processes` processes (`polytrain api --workers`, default 2, one per core here; they
share login counters in a Redis of the bench's own; on SQLite one process). Locust,
headless and bounded in time, runs 50 users that each make one request a
second (the task list and single task statuses), started 0.1 s apart; the
statistics restart once all run. The line reports the p99 over all requests
(target <= 100 ms) and the failures (target 0).

A second run on a fresh stack (`api_p99_mixed_ms`) adds to the same readers
`--submitters` users submitting a task every 2 s and `--agents` registered
agents, each heartbeating every 3 s and sending every second a metric batch
(20 values) or a progress report (the agent API); the line gives every
endpoint's p50, p99 and request count, and the worst endpoint's p99 as value
(target <= 100 ms for each endpoint). Locust's percentiles are those of its
response-time histogram (2 significant digits).

    python -m bench.api_p99 [--users 50] [--seconds 30] [--agents 20] [--submitters 5]
        [--only readers|mixed]
"""

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psycopg  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from bench.services import PG_SERVER, example_project, redis_server  # noqa: E402
from polytrain.stack import GroupSetup, LocalStack  # noqa: E402
from worker.agent.hardware import detect_hardware  # noqa: E402
from worker.engine.ranks import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
TASKS = 500
# Users start 0.1 s apart, so their once-a-second requests have independent phases (as
# separate portals would); started all at once they would fire in lockstep bursts of 50.
SPAWN_RATE = 10


def _admin(sql: str) -> bool:
    dsn = make_url(PG_SERVER).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql)
        return True
    except psycopg.OperationalError:
        return False


def seed(stack: LocalStack) -> tuple[list[int], str]:
    """A project with `TASKS` queued tasks (no agent runs them); their ids, and
    "project_id,code_version_id" for more submissions."""
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        project, version = example_project(api, "bench")
        return [
            api.post(
                "/api/v1/tasks",
                json={
                    "project_id": project["id"],
                    "code_version_id": version["id"],
                    "epochs": 1,
                    "resource_groups": [{"name": "cpu-a", "workers": 1}],
                    "global_batch_size": 8,
                },
            )
            .raise_for_status()
            .json()["id"]
            for _ in range(TASKS)
        ], f"{project['id']},{version['id']}"


def register_agents(stack: LocalStack, count: int) -> list[int]:
    """`count` agents of group cpu-a registered through the agent API (none runs); their ids."""
    hardware = detect_hardware("cpu")
    with httpx.Client(
        base_url=stack.url + "/internal/v1",
        timeout=30,
        headers={"Authorization": f"Bearer {stack.token}"},
    ) as api:
        return [
            api.post(
                "/agents/register",
                json={
                    "name": f"bench-agent-{index}",
                    "host": "127.0.0.1",
                    "resource_group": "cpu-a",
                    "workers": 1,
                    "hardware": hardware,
                },
            )
            .raise_for_status()
            .json()["id"]
            for index in range(count)
        ]


def run_locust(
    stack: LocalStack,
    ids: list[int],
    users: int,
    seconds: int,
    out: Path,
    writers: dict[str, str] | None = None,
) -> dict:
    env = {
        **os.environ,
        "POLYTRAIN_BENCH_TOKEN": stack.headers["Authorization"][7:],
        "POLYTRAIN_BENCH_TASKS": ",".join(map(str, ids)),
        **(writers or {}),
    }
    subprocess.run(
        [
            str(Path(sys.executable).with_name("locust")),
            "-f",
            str(HERE / "locust_api.py"),
            "--headless",
            "--users",
            str(users),
            "--spawn-rate",
            str(SPAWN_RATE),
            "--reset-stats",
            "--run-time",
            f"{seconds}s",
            "--stop-timeout",
            "5",
            "--host",
            stack.url,
            "--csv",
            str(out / "api"),
            "--only-summary",
            "--loglevel",
            "WARNING",
        ],
        env=env,
        check=False,
        timeout=seconds + 60,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    with open(out / "api_stats.csv") as fh:
        rows = {row["Name"]: row for row in csv.DictReader(fh)}
    return rows


def run(args: argparse.Namespace, mixed: bool) -> dict:
    """One stack, one locust run; the JSON line (readers alone, or `mixed` with writers)."""
    workdir = Path(tempfile.mkdtemp(prefix="polytrain-bench-"))
    name = f"pt_bench_api_{os.getpid()}_{int(mixed)}"
    on_pg = _admin(f'CREATE DATABASE "{name}"')
    database = make_url(PG_SERVER).set(database=name).render_as_string(hide_password=False)
    # Several API processes need PostgreSQL and login counters they share (a Redis of its own).
    processes = args.api_processes if on_pg else 1
    redis_port = free_port()
    redis_proc = subprocess.Popen(redis_server(redis_port), stdout=subprocess.DEVNULL)
    try:
        return _run_on(args, mixed, workdir, database if on_pg else None, processes, redis_port)
    finally:
        redis_proc.terminate()
        redis_proc.wait()
        if on_pg:
            _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(workdir, ignore_errors=True)


def _run_on(
    args: argparse.Namespace,
    mixed: bool,
    workdir: Path,
    database: str | None,
    processes: int,
    redis_port: int,
) -> dict:
    stack = LocalStack(
        data_dir=workdir / "stack",
        port=free_port(),
        groups=[GroupSetup("cpu-a", 1)],
        database_url=database,
        extra_env={
            "WEB_CONCURRENCY": str(processes),
            "POLYTRAIN_RATE_LIMIT_STORAGE_URL": f"redis://127.0.0.1:{redis_port}/0",
        },
    )
    stack.groups, ensure = [], stack.groups  # the API alone: no agent takes the tasks
    users = args.users
    with stack:
        stack._ensure_group(ensure[0])
        ids, submit = seed(stack)
        writers = None
        if mixed:
            writers = {
                "POLYTRAIN_BENCH_AGENT_TOKEN": stack.token,
                "POLYTRAIN_BENCH_AGENTS": ",".join(map(str, register_agents(stack, args.agents))),
                "POLYTRAIN_BENCH_SUBMIT": submit,
                "POLYTRAIN_BENCH_SUBMITTERS": str(args.submitters),
            }
            users += args.agents + args.submitters
        rows = run_locust(stack, ids, users, args.seconds, workdir, writers)
    total = rows["Aggregated"]
    endpoints = {
        n: {
            "p50_ms": float(r["50%"]),
            "p99_ms": float(r["99%"]),
            "requests": int(r["Request Count"]),
            "failures": int(r["Failure Count"]),
        }
        for n, r in rows.items()
        if n != "Aggregated"
    }
    common = {
        "target": 100.0,
        "unit": "ms",
        "failures": int(total["Failure Count"]),
        "requests": int(total["Request Count"]),
        "rps": round(float(total["Requests/s"]), 1),
        "users": users,
        "seconds": args.seconds,
        "tool": "locust",
        "spawn_rate_per_s": SPAWN_RATE,
        "api_processes": processes,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "database": "postgresql" if database else "sqlite",
        "tasks": TASKS,
    }
    if not mixed:
        return {
            "benchmark": "api_p99_ms",
            "value": float(total["99%"]),
            "stat": "p99",
            **common,
            "p50_ms": float(total["50%"]),
            "by_request_p99_ms": {n: e["p99_ms"] for n, e in endpoints.items()},
        }
    worst = max(endpoints, key=lambda n: endpoints[n]["p99_ms"])
    return {
        "benchmark": "api_p99_mixed_ms",
        "value": endpoints[worst]["p99_ms"],
        "stat": "p99 of the worst endpoint",
        "worst_endpoint": worst,
        **common,
        "readers": args.users,
        "agents": args.agents,
        "submitters": args.submitters,
        "by_endpoint": endpoints,
        "all_p99_ms": float(total["99%"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument(
        "--api-processes",
        type=int,
        default=2,
        help="uvicorn worker processes of the API (WEB_CONCURRENCY)",
    )
    parser.add_argument("--agents", type=int, default=20, help="registered agents (mixed run)")
    parser.add_argument("--submitters", type=int, default=5, help="submitting users (mixed run)")
    parser.add_argument("--only", choices=["readers", "mixed"])
    args = parser.parse_args()
    for mixed in {"readers": [False], "mixed": [True]}.get(args.only or "", [False, True]):
        print(json.dumps(run(args, mixed)), flush=True)
    return 0  # a missed target is a result, not a failure to run


if __name__ == "__main__":
    sys.exit(main())
