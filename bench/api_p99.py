"""Benchmark `api_p99_ms`: task listing and status reads under 50 concurrent clients (locust).

The API (with its scheduler) runs on loopback on the production stack when
PostgreSQL is reachable (else the embedded default), holding 500 tasks, as
`--api-processes` uvicorn workers (default 2, one per core here). Locust,
headless and bounded in time, runs 50 users that each make one request a
second (the task list and single task statuses), started 0.1 s apart; the
statistics restart once all run. The line reports the p99 over all requests
(target <= 100 ms) and the failures (target 0).

    python -m bench.api_p99 [--users 50] [--seconds 30]
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

from bench.services import PG_SERVER, example_project  # noqa: E402
from polytrain.stack import GroupSetup, LocalStack  # noqa: E402
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


def seed(stack: LocalStack) -> list[int]:
    """A project with `TASKS` queued tasks (no agent runs them); their ids."""
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
        ]


def run_locust(stack: LocalStack, ids: list[int], users: int, seconds: int, out: Path) -> dict:
    env = {
        **os.environ,
        "POLYTRAIN_BENCH_TOKEN": stack.headers["Authorization"][7:],
        "POLYTRAIN_BENCH_TASKS": ",".join(map(str, ids)),
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
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="polytrain-bench-"))
    name = f"pt_bench_api_{os.getpid()}"
    on_pg = _admin(f'CREATE DATABASE "{name}"')
    database = make_url(PG_SERVER).set(database=name).render_as_string(hide_password=False)
    stack = LocalStack(
        data_dir=workdir / "stack",
        port=free_port(),
        groups=[GroupSetup("cpu-a", 1)],
        database_url=database if on_pg else None,
        extra_env={"WEB_CONCURRENCY": str(args.api_processes)},
    )
    stack.groups, ensure = [], stack.groups  # the API alone: no agent takes the tasks
    try:
        with stack:
            stack._ensure_group(ensure[0])
            rows = run_locust(stack, seed(stack), args.users, args.seconds, workdir)
    finally:
        if on_pg:
            _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(workdir, ignore_errors=True)
    total = rows["Aggregated"]
    p99, failures = float(total["99%"]), int(total["Failure Count"])
    line = {
        "benchmark": "api_p99_ms",
        "value": p99,
        "target": 100.0,
        "unit": "ms",
        "stat": "p99",
        "failures": failures,
        "requests": int(total["Request Count"]),
        "rps": round(float(total["Requests/s"]), 1),
        "p50_ms": float(total["50%"]),
        "users": args.users,
        "seconds": args.seconds,
        "tool": "locust",
        "spawn_rate_per_s": SPAWN_RATE,
        "api_processes": args.api_processes,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "database": "postgresql" if on_pg else "sqlite",
        "tasks": TASKS,
        "by_request_p99_ms": {n: float(r["99%"]) for n, r in rows.items() if n != "Aggregated"},
    }
    print(json.dumps(line))
    return 0  # a missed target is a result, not a failure to run


if __name__ == "__main__":
    sys.exit(main())
