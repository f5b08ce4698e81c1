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

`--only environment` (issue 35): what a code version's own packages cost a task once its
agents have them cached, on the embedded default with the warm pools. Two uploads of the
same tiny model (`tiny_regression`): one plain, one that also imports einops and declares
`einops` as its requirement (resolved at upload into a non-empty lock). After one plain
warm-up (a fresh stack's pools are still warming), one submission of the latter builds the
environment on each agent (`environment_build_s`: its submit to first step); then `--runs`
submissions of each, alternating (the order reversed in every other round,
`bench.stats.paired_rounds`), `--pause` seconds apart.
`submit_to_first_step_cached_env_extra_s` = median with the environment - median without
(target <= 0.3 s; ideal 0: a cached environment costs a lease, one `/ready` round trip and
one hard-link pass per rank). Where the difference goes, per run, from the server's and
the agents' timestamps: submit -> RUNNING, each part's claim -> prepared, each agent's
ranks started, and the ranks' own start-up parts (`timeline`).

    python -m bench.submit_to_first_step [--runs 5] [--only redis|embedded|cold|environment]
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
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psycopg  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from bench.services import PG_SERVER, example_project, redis_server  # noqa: E402
from bench.stats import paired_rounds, summary  # noqa: E402
from polytrain.stack import GroupSetup, LocalStack  # noqa: E402
from worker.engine.ranks import free_port  # noqa: E402

TARGETS = {"redis": 2.0, "embedded": 5.0}
COLD_TARGET_S = 3.0
CACHED_ENV_TARGET_S = 0.3
ROOT = Path(__file__).resolve().parents[1]
# The environment's requirement: a small pure-Python wheel the platform lacks.
REQUIREMENTS = "einops\n"
GROUPS = [GroupSetup("cpu-a", 2), GroupSetup("cpu-b", 1)]


def _admin(sql: str) -> None:
    dsn = make_url(PG_SERVER).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql)


def first_step_s(api: httpx.Client, version: dict) -> float:
    """Seconds from submission to progress > 0; the task is then cancelled and released."""
    return first_step(api, version)[0]


def first_step(api: httpx.Client, version: dict) -> tuple[float, int]:
    """(seconds from submission to progress > 0, the task's id); the task is then cancelled
    and released."""
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
    return elapsed, int(task["id"])


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


def upload(api: httpx.Client, project_id: int, code: str, requirements: str | None) -> dict:
    """A code version of `code` (a module) through the upload route, its `requirements`
    resolved by the API (real uv, the package index)."""
    return (
        api.post(
            f"/api/v1/projects/{project_id}/code-versions/upload",
            files={"file": ("train.py", code.encode(), "text/x-python")},
            data={"requirements": requirements} if requirements else {},
            timeout=300,
        )
        .raise_for_status()
        .json()
    )


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _at(stamp: str) -> datetime:
    """An API timestamp (UTC, with or without its zone) as an aware datetime."""
    at = datetime.fromisoformat(stamp)
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def timeline(api: httpx.Client, task_id: int) -> dict:
    """Where a task's start went, from the server's and the agents' timestamps, seconds after
    its submission: RUNNING (`to_running_s`), each preparing part's claim -> prepared (its
    agent's environment lease and `/ready`, `prepare_s`), each agent's "environment ...
    cached/built" line (`env_ready_s`) and "started ranks" line (`ranks_started_s`: the
    environment linked into each rank, every rank given its order); and the ranks' own
    start-up parts (`startup_s`: each part's slowest rank; `model` includes loading the
    user's module, so its `import einops`)."""
    task = api.get(f"/api/v1/tasks/{task_id}").json()
    events = api.get(f"/api/v1/tasks/{task_id}/events").json()
    logs = api.get(f"/api/v1/tasks/{task_id}/logs").json()
    created = _at(task["created_at"])
    running = [e for e in events if e["kind"] == "status" and e["to_status"] == "RUNNING"]
    claims: dict[str, datetime] = {}
    prepare: list[float] = []
    details: list[str] = []
    for event in events:
        if event["kind"] != "phase":
            continue
        at, reason = _at(event["created_at"]), event["reason"]
        if "prepares group" in reason:
            claims[reason.split(" prepares ")[1].split(":")[0]] = at
        elif " prepared" in reason:
            part = reason.split(" prepared")[0]
            if part in claims:
                prepare.append((at - claims[part]).total_seconds())
            details.append(reason.split(": ", 1)[-1])
    env_ready: dict[str, float] = {}
    ranks_started: dict[str, float] = {}
    startup: dict[str, float] = {}
    for line in logs:
        after = (_at(line["time"]) - created).total_seconds()
        text = line["text"]
        if line["node"].startswith("agent-") and text.startswith("environment "):
            env_ready[line["node"]] = round(after, 3)
        elif line["node"].startswith("agent-") and ": started ranks " in text:
            ranks_started[line["node"]] = round(after, 3)
        elif " start-up " in text and ": " in text:  # "rank R start-up T s: part s, ..."
            for part in text.split(": ", 1)[1].split(", "):
                name, _, seconds = part.rpartition(" ")
                startup[name] = max(startup.get(name, 0.0), float(seconds))
    return {
        "to_running_s": (_at(running[0]["created_at"]) - created).total_seconds()
        if running
        else None,
        "prepare_s": prepare,
        "details": details,
        "env_ready_s": env_ready,
        "ranks_started_s": ranks_started,
        "startup_s": startup,
    }


def _median_of(found: list[dict], key: str) -> dict[str, float]:
    """Per name, the median over runs of `found[i][key][name]`."""
    names = sorted({name for t in found for name in t[key]})
    return {
        name: round(statistics.median(t[key][name] for t in found if name in t[key]), 3)
        for name in names
    }


def run_environment_mode(runs: int, workdir: Path, pause_s: float) -> dict:
    """With the warm pools: a plain tiny_regression against the same module importing einops
    from its cached environment, alternating submissions after one that builds it."""
    plain = (ROOT / "examples" / "tiny_regression.py").read_text()
    with_env = plain.replace(
        "import torch\n", "import einops  # the environment's package\nimport torch\n", 1
    )
    assert with_env != plain
    load_before = os.getloadavg()[0]
    with LocalStack(data_dir=workdir / "environment", port=free_port(), groups=GROUPS) as stack:
        with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
            project = api.post("/api/v1/projects", json={"name": "bench-env"}).raise_for_status()
            project_id = project.json()["id"]
            versions = {"without_env": upload(api, project_id, plain, None)}
            resolving = time.perf_counter()
            versions["with_env"] = upload(api, project_id, with_env, REQUIREMENTS)
            resolve_s = time.perf_counter() - resolving
            # A fresh stack's first task pays more than its environment (the pools are still
            # warming): one plain warm-up first, then the build after the usual pause.
            first_step(api, versions["without_env"])
            time.sleep(pause_s)
            build_s, build_task = first_step(api, versions["with_env"])
            built = timeline(api, build_task)
            tasks: dict[str, list[int]] = {name: [] for name in versions}

            def arm(name: str) -> float:
                time.sleep(pause_s)
                seconds, task_id = first_step(api, versions[name])
                tasks[name].append(task_id)
                return seconds

            timings = paired_rounds(
                {"with_env": lambda: arm("with_env"), "without_env": lambda: arm("without_env")},
                runs,
            )
            timelines = {name: [timeline(api, t) for t in ids] for name, ids in tasks.items()}
    with_s, without_s = timings["with_env"], timings["without_env"]
    medians = {name: statistics.median(values) for name, values in timings.items()}
    extra = [w - o for w, o in zip(with_s, without_s, strict=True)]
    return {
        "benchmark": "submit_to_first_step_cached_env_extra_s",
        "value": round(medians["with_env"] - medians["without_env"], 3),
        "target": CACHED_ENV_TARGET_S,
        "unit": "s",
        "stat": "median with a cached environment - median without, alternating submissions",
        "with_env_s": [round(t, 3) for t in with_s],
        "without_env_s": [round(t, 3) for t in without_s],
        "medians": {name: round(value, 3) for name, value in medians.items()},
        "spread": {
            "with_env_max_s": round(max(with_s), 3),
            "without_env_max_s": round(max(without_s), 3),
            "paired_extra_s": summary(extra, digits=3),
        },
        "environment_build_s": round(build_s, 3),
        "environment_build": built["details"],
        "resolve_at_upload_s": round(resolve_s, 3),
        "packages": [f"{p['name']}=={p['version']}" for p in versions["with_env"]["packages"]],
        "to_running_s": {
            name: [_round(t["to_running_s"]) for t in found] for name, found in timelines.items()
        },
        "prepare_s": [[round(s, 3) for s in t["prepare_s"]] for t in timelines["with_env"]],
        "ranks_started_s": {
            name: [max(t["ranks_started_s"].values(), default=None) for t in found]
            for name, found in timelines.items()
        },
        "env_ready_s": [t["env_ready_s"] for t in timelines["with_env"]],
        "startup_s_median": {
            name: _median_of(found, "startup_s") for name, found in timelines.items()
        },
        "startup_s": {name: [t["startup_s"] for t in found] for name, found in timelines.items()},
        "n": runs,
        "warm_pool": True,
        "pause_s": pause_s,
        "broker": "sqlalchemy+sqlite",
        "database": "sqlite",
        "workers": {g.name: g.workers for g in GROUPS},
        "example": "tiny_regression (uploaded), and with `import einops` + requirement einops",
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


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
    parser.add_argument("--only", choices=[*sorted(TARGETS), "cold", "environment"])
    parser.add_argument(
        "--pause", type=float, default=10.0, help="seconds between submissions (warm pools refill)"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="polytrain-bench-"))
    try:
        for kind in [args.only] if args.only else ["redis", "embedded", "cold", "environment"]:
            if kind == "cold":
                lines = run_embedded_modes(args.runs, workdir)
            elif kind == "environment":
                lines = [run_environment_mode(args.runs, workdir, args.pause)]
            else:
                lines = [run_stack(kind, args.runs, workdir, args.pause)]
            for line in lines:
                print(json.dumps(line), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0  # a missed target is a result, not a failure to run


if __name__ == "__main__":
    sys.exit(main())
