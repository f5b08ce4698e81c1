"""Benchmark `fleet_faults`: an API process killed, Redis restarted and PostgreSQL restarted
while 1,000 simulated agents run tasks (issue 37, item 5; docs/scaling.md reads its results).

The fleet is bench/agent_fleet.py's (the simulated agents of bench/fleet.py, with the real
agent's request bodies and its retries; 40 `cuda` groups; tasks submitted through the REST
API to keep half the agents busy, a quarter of them across two groups), against
`polytrain api --workers 2` on a PostgreSQL server of its own (`initdb` in a scratch
folder, so it can be restarted without touching the host's) and a Redis of its own with an
append-only file, as a production broker keeps one. Sub-tasks "train" 20-40 s here
(`--task-s`). Once every agent has joined and settled, one fault every `--gap-s` seconds:

1. the elected API process (the one whose session holds the scheduler's lock) is killed
   with SIGKILL; uvicorn starts a new process in its place;
2. Redis is stopped (SIGTERM), and started again `--outage-s` seconds later on the same
   port and file;
3. PostgreSQL is stopped (`pg_ctl stop -m fast`: every session ends), and started again
   `--outage-s` seconds later.

Submissions stop `--gap-s` after the last fault; the run ends once every task has ended (or
at `--drain-s`). Then the database is held against what the simulated agents were told
(`bench.fleet.Ledger`):

- `tasks_not_succeeded`: tasks that did not end SUCCEEDED (the agents fail nothing);
- `booked_twice`: sub-tasks claimed (204) by more than one agent;
- `parts_held_unknowingly`: sub-tasks the database holds as run (RUNNING or SUCCEEDED) by
  an agent that was never told it had claimed them (a claim committed whose answer was
  lost, then refused on the retry);
- `log_lines_lost`: lines a report carried that the API answered 2xx but the database
  lacks, `log_lines_dropped`: lines an agent gave up on (its last report failed after
  every retry), and `parts_failed_for_reports`: parts an agent failed because the API
  failed every report for `worker.agent.reporter.OUTAGE_LIMIT_S`;
- `agents_declared_lost`: the most agents marked offline at once (sampled every second;
  every simulated agent stays healthy), and the tasks restarted because an agent "stopped
  sending heartbeats".

One JSON line per fault (what was done, how long it took, when the scheduler led again),
then the summary `fleet_faults_violations` (their sum; target 0) with each count, and per
window (`before` the faults, one per fault, `after` them) the requests that failed after
every retry, by kind, the retries, and the heartbeat p50/p99.

    python -m bench.fleet_faults [--agents 1000] [--api-processes 2] [--generators 2]
                                 [--gap-s 30] [--outage-s 5] [--task-s 20,40]

About 5 minutes; it needs PostgreSQL's server programs (`initdb`, `pg_ctl`; run as the
`postgres` user when this runs as root) and `redis-server` on the PATH.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402

from backend.scheduler.leader import (  # noqa: E402
    LEADING_SESSION_PARAMS,
    LEADING_SESSION_SQL,
    leader_pid_in,
)
from bench.agent_fleet import Submitter, seed, start_generators, step_schedule  # noqa: E402
from bench.fleet import Window, merge  # noqa: E402
from bench.services import redis_server  # noqa: E402
from polytrain.stack import LocalStack  # noqa: E402
from worker.engine.ranks import free_port  # noqa: E402

FAULTS = ("kill_api_leader", "restart_redis", "restart_postgresql")
"""The faults in their order, each at the start of a `--gap-s` window named after it."""


def _server_program(name: str) -> str:
    """Where PostgreSQL's `name` (initdb, pg_ctl) is: on the PATH or Debian's versioned
    folder. Raises FileNotFoundError naming it."""
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None:
        raise FileNotFoundError(f"{name} not found: install PostgreSQL's server programs")
    return found


class ScratchPostgres:
    """A PostgreSQL server of this run's own: a cluster made by `initdb` in `folder`,
    listening on 127.0.0.1:`port` with trust authentication, so restarting it disturbs
    nothing else on the host. As root, its programs run as the `postgres` user."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.data = folder / "data"
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, stdout=subprocess.DEVNULL)

    def start(self) -> None:
        if self._as:
            shutil.chown(self.folder, "postgres")
        self._run(_server_program("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        self._up()
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE polytrain")

    def _up(self) -> None:
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=400"
        )
        self._run(
            _server_program("pg_ctl"),
            *("-D", str(self.data), "-o", options, "-l", str(self.folder / "log"), "-w", "start"),
        )

    def restart(self, outage_s: float) -> float:
        """Stop it (fast shutdown: every session ends), wait `outage_s`, start it again; the
        seconds it was down."""
        started = time.monotonic()
        self._run(_server_program("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        time.sleep(outage_s)
        self._up()
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop it at once if it runs; never raises (it runs on the way out of errors)."""
        if (self.data / "postmaster.pid").exists():
            ctl = [_server_program("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"]
            subprocess.run([*self._as, *ctl], check=False, stdout=subprocess.DEVNULL)

    def dsn(self, database: str = "polytrain") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/polytrain"


class PersistentRedis:
    """A Redis of this run's own with an append-only file in `folder` (fsync every second,
    Redis's default), as a production broker keeps one; restartable on the same port."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = redis_server(self.port, "--maxclients", "10000")
        command += ["--appendonly", "yes", "--dir", str(self.folder)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: Redis writes its file and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, outage_s: float) -> float:
        """Stop it, wait `outage_s`, start it again on the same file; the seconds it was down."""
        started = time.monotonic()
        self.stop()
        time.sleep(outage_s)
        self.start()
        return time.monotonic() - started

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def read_row(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The first row of `sql` on a connection of its own, None when there is none or the
    database did not answer within 2 s (it restarts during the run)."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as conn:
            return conn.execute(sql, params).fetchone()
    except psycopg.Error:
        return None


def leader_pid(dsn: str) -> int | None:
    """The pid of the API process that leads the scheduler (the session holding its lock,
    `backend.scheduler.leader`), None while none does or the database is unreachable."""
    row = read_row(dsn, LEADING_SESSION_SQL, LEADING_SESSION_PARAMS)
    return leader_pid_in(row[0]) if row else None


def wait_for_leader(dsn: str, other_than: int | None, timeout_s: float) -> tuple[int | None, float]:
    """The leading pid once one other than `other_than` leads, and the seconds waited;
    (None, timeout_s) if none did in time."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        pid = leader_pid(dsn)
        if pid is not None and pid != other_than:
            return pid, time.monotonic() - started
        time.sleep(0.2)
    return None, timeout_s


class OfflineSampler(threading.Thread):
    """Every second, how many registered agents the database holds offline; the most at
    once and when (a read that fails while PostgreSQL restarts is skipped)."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.most, self.reads, self.failed = 0, 0, 0
        self.samples: list[tuple[float, int]] = []  # (time.time(), agents offline)
        self.stop = threading.Event()

    def most_in(self, windows: list[Window]) -> dict[str, int]:
        """The most agents offline at once in each window, by its label."""
        return {
            w.label: max((n for t, n in self.samples if w.start <= t < w.end), default=0)
            for w in windows
        }

    def run(self) -> None:
        while not self.stop.wait(1.0):
            row = read_row(self.dsn, "SELECT count(*) FROM agent WHERE NOT online")
            if row is None:
                self.failed += 1
                continue
            self.reads += 1
            self.samples.append((time.time(), int(row[0])))
            self.most = max(self.most, int(row[0]))


def all_ended(dsn: str) -> bool | None:
    """Whether every task has ended (None: the database did not answer)."""
    row = read_row(
        dsn, "SELECT count(*) FROM task WHERE status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED')"
    )
    return None if row is None else int(row[0]) == 0


def checks(dsn: str, ledger: dict[str, Any]) -> dict[str, Any]:
    """The database against the agents' ledger (`bench.fleet.Ledger`): the counts of the
    module's docstring, each 0 when the platform kept its promises."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        statuses: dict[str, int] = {
            str(status): int(n)
            for status, n in conn.execute("SELECT status, count(*) FROM task GROUP BY status")
        }
        restarted = conn.execute("SELECT count(*) FROM task WHERE attempt > 1").fetchone()
        lost_events = conn.execute(
            "SELECT count(DISTINCT task_id) FROM task_event "
            "WHERE reason LIKE '%stopped sending heartbeats%'"
        ).fetchone()
        held: dict[tuple[int, str], dict[str, Any]] = {
            (int(row[0]), str(row[1])): {
                "sub_task": int(row[0]),
                "agent": str(row[1]),
                "status": str(row[2]),
                "attempt": int(row[3]),
                "task": int(row[4]),
                "task_status": str(row[5]),
                "task_attempt": int(row[6]),
                "updated_at": str(row[7]),
            }
            for row in conn.execute(
                "SELECT s.id, a.name, s.status, s.attempt, t.id, t.status, t.attempt, "
                "s.updated_at FROM sub_task s JOIN agent a ON a.id = s.agent_id "
                "JOIN task t ON t.id = s.task_id WHERE s.status IN ('RUNNING', 'SUCCEEDED')"
            )
        }
        stored: set[tuple[int, int, str, int]] = {
            (int(t), int(a), str(n), int(s))
            for t, a, n, s in conn.execute("SELECT task_id, attempt, node, seq FROM log_line")
        }
    acked = [
        (int(task), int(attempt), node, seq)
        for key, seqs in ledger["acked"].items()
        for task, attempt, node in [key.split(":", 2)]
        for seq in seqs
    ]
    claims = Counter(sub_task for sub_task, _agent in ledger["claims"])
    claimed_twice = len([n for n in claims.values() if n > 1])
    told = {(int(sub), str(agent)) for sub, agent in ledger["claims"]}
    unknowing = [pair for pair in held if pair not in told]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for pair in unknowing:  # what explains it: the agent's answers, the task's timeline
            held[pair]["agent_was_answered"] = [
                answer for sub, agent, answer in ledger.get("refused", []) if (sub, agent) == pair
            ]
            held[pair]["task_events"] = [
                f"{at} {to}: {reason[:200]}"
                for at, to, reason in conn.execute(
                    "SELECT created_at, to_status, reason FROM task_event WHERE task_id = %s "
                    "ORDER BY id",
                    (held[pair]["task"],),
                )
            ]
    return {
        "tasks_by_status": statuses,
        "tasks_not_succeeded": sum(n for status, n in statuses.items() if status != "SUCCEEDED"),
        "tasks_restarted": int(restarted[0]) if restarted else 0,
        "tasks_restarted_for_a_lost_agent": int(lost_events[0]) if lost_events else 0,
        "booked_twice": claimed_twice,
        "parts_held_unknowingly": len(unknowing),
        "parts_held_unknowingly_detail": [held[pair] for pair in unknowing],
        "sub_tasks_claimed": len(claims),
        "log_lines_acknowledged": len(acked),
        "log_lines_lost": sum(1 for line in acked if line not in stored),
        "log_lines_dropped": int(ledger["dropped"]),
        "parts_failed_for_reports": int(ledger["gave_up"]),
    }


def logged_errors(log: Path, top: int = 6) -> dict[str, int]:
    """The exceptions the API's processes logged (a traceback's last line, cut to 120
    characters), the `top` most frequent with their counts."""
    if not log.exists():
        return {}
    found: Counter[str] = Counter()
    lines = log.read_text(errors="replace").splitlines()
    for before, line in zip(lines, lines[1:], strict=False):
        if before.startswith("  ") and not line.startswith(" ") and ":" in line:
            name = line.split(":", 1)[0]  # e.g. kombu.exceptions.OperationalError
            last = name.rsplit(".", 1)[-1]
            if name.replace(".", "").replace("_", "").isalnum() and last[:1].isupper():
                found[line[:120]] += 1
    return dict(found.most_common(top))


def kill_leader(dsn: str, api_parent: psutil.Process) -> dict[str, Any]:
    """SIGKILL the elected API process; when another led, and whether uvicorn replaced it."""
    pid, _ = wait_for_leader(dsn, None, 30.0)
    if pid is None:
        return {"fault": "kill_api_leader", "error": "no process led"}
    before = {p.pid for p in api_parent.children()}
    os.kill(pid, signal.SIGKILL)
    new, took = wait_for_leader(dsn, pid, 60.0)
    deadline, replaced = time.monotonic() + 30, False
    while time.monotonic() < deadline and not replaced:
        replaced = len({p.pid for p in api_parent.children()} - before) > 0
        time.sleep(0.5)
    return {
        "fault": "kill_api_leader",
        "killed_pid": pid,
        "new_leader_pid": new,
        "led_again_after_s": round(took, 2),
        "process_replaced": replaced,
    }


def run(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    postgres = ScratchPostgres(workdir / "pg", free_port())
    (workdir / "pg").mkdir()
    (workdir / "redis").mkdir()
    broker = PersistentRedis(workdir / "redis", free_port())
    lines: list[dict[str, Any]] = []
    generators: list[subprocess.Popen[bytes]] = []
    sampler = OfflineSampler(postgres.dsn())
    try:
        postgres.start()
        broker.start()
        stack = LocalStack(
            data_dir=workdir / "stack",
            port=free_port(),
            database_url=postgres.url(),
            broker_url=broker.url,
            extra_env={
                "WEB_CONCURRENCY": str(args.api_processes),
                "POLYTRAIN_RATE_LIMIT_STORAGE_URL": f"redis://127.0.0.1:{broker.port}/1",
            },
        )
        with stack:
            body = seed(stack, args.agents)
            start = time.time() + 5
            plans, _windows, ramps = step_schedule(
                [args.agents], start, args.ramp_s, args.settle_s, 0.0
            )
            faults_at = ramps[0] + args.settle_s
            submit_until = faults_at + 3 * args.gap_s
            until = submit_until + args.drain_s
            names = ["before", *FAULTS, "after"]
            edges = [start, *(faults_at + k * args.gap_s for k in range(4)), until]
            windows = [Window(n, a, b) for n, a, b in zip(names, edges, edges[1:], strict=False)]
            task_s = tuple(float(s) for s in args.task_s.split(","))
            stop_file = workdir / "stop"
            plan = {
                "api_url": stack.url,
                "token": stack.token,
                "broker_url": broker.url,
                "generators": args.generators,
                "plans": [p.__dict__ for p in plans],
                "windows": [w.__dict__ for w in windows],
                "until": until,
                "stop_file": str(stop_file),
                "rates": {"task_s": list(task_s)},
            }
            generators, outs = start_generators(workdir, plan)
            submitter = Submitter(
                stack,
                body,
                [args.agents],
                ramps,
                submit_until,
                args.busy_fraction,
                sum(task_s) / 2,
            )
            submitter.start()
            sampler.start()
            api_parent = psutil.Process(stack._children["api"].proc.pid)
            time.sleep(max(0.0, faults_at - time.time()))
            lines.append(
                {**kill_leader(postgres.dsn(), api_parent), "t": round(time.time() - start, 1)}
            )
            time.sleep(max(0.0, faults_at + args.gap_s - time.time()))
            seconds = broker.restart(args.outage_s)
            lines.append(
                {
                    "fault": "restart_redis",
                    "down_s": round(seconds, 2),
                    "t": round(time.time() - start, 1),
                }
            )
            time.sleep(max(0.0, faults_at + 2 * args.gap_s - time.time()))
            pid = leader_pid(postgres.dsn())
            seconds = postgres.restart(args.outage_s)
            new, took = wait_for_leader(postgres.dsn(), None, 60.0)
            lines.append(
                {
                    "fault": "restart_postgresql",
                    "down_s": round(seconds, 2),
                    "leader_before": pid,
                    "leader_after": new,
                    "led_again_after_s": round(took, 2),
                    "t": round(time.time() - start, 1),
                }
            )
            submitter.join(timeout=max(0.0, submit_until - time.time()) + 60)
            while time.time() < until and all_ended(postgres.dsn()) is not True:
                time.sleep(2.0)
            drained = all_ended(postgres.dsn()) is True
            sampler.stop.set()  # the agents stop beating now: what follows is no verdict
            stop_file.touch()
            for proc in generators:
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
            reports = [json.loads(out.read_text()) for out in outs if out.exists()]
            if len(reports) < len(outs):
                raise RuntimeError(f"{len(outs) - len(reports)} generator(s) wrote no report")
            merged = merge(reports)
            found = checks(postgres.dsn(), merged["ledger"])
            api_errors = logged_errors(workdir / "stack" / "api.log")
            if args.keep_log:
                shutil.copy(workdir / "stack" / "api.log", args.keep_log)
    finally:  # each step on its own: a failed one must not leave a server running
        sampler.stop.set()
        for proc in generators:
            if proc.poll() is None:
                proc.kill()
        try:
            broker.stop()
        finally:
            postgres.stop()
    for line in lines:
        line["benchmark"] = "fleet_faults_step"
    failed = {
        w["label"]: {kind: r["errors"] for kind, r in w["requests"].items() if r["errors"]}
        for w in merged["windows"]
    }
    heartbeat = {
        w["label"]: [w["requests"].get("heartbeat", {}).get(q) for q in ("p50_ms", "p99_ms")]
        for w in merged["windows"]
    }
    retries = {
        w["label"]: sum(r["retries"] for r in w["requests"].values()) for w in merged["windows"]
    }
    found["agents_declared_lost"] = sampler.most
    violations = (
        found["tasks_not_succeeded"]
        + found["booked_twice"]
        + found["parts_held_unknowingly"]
        + found["log_lines_lost"]
        + found["log_lines_dropped"]
        + found["parts_failed_for_reports"]
        + found["agents_declared_lost"]
        + found["tasks_restarted_for_a_lost_agent"]
    )
    summary = {
        "benchmark": "fleet_faults_violations",
        "value": violations,
        "target": 0,
        "met": violations == 0 and drained,
        "agents": args.agents,
        "registered": merged["registered"],
        "drained": drained,
        **found,
        "agents_offline_most_by_window": sampler.most_in(windows),
        "agents_offline_over_time": [  # (seconds from the start, agents offline), when any
            (round(t - start, 1), n) for t, n in sampler.samples if n
        ],
        "offline_samples": {"reads": sampler.reads, "failed_reads": sampler.failed},
        "tasks_submitted": submitter.submitted,
        "task_submissions_failed": submitter.failed,
        "requests_failed_after_retries": failed,
        "retries": retries,
        "heartbeat_p50_p99_ms": heartbeat,
        "api_log_errors": api_errors,
        "api_processes": args.api_processes,
        "host_cores": psutil.cpu_count(),
        "database": "postgresql (own server)",
        "broker": "redis (append-only file)",
    }
    return [*lines, summary]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000, help="simulated agents")
    parser.add_argument("--ramp-s", type=float, default=30.0, help="seconds to add the agents")
    parser.add_argument("--settle-s", type=float, default=20.0, help="seconds before the faults")
    parser.add_argument("--gap-s", type=float, default=30.0, help="seconds between faults")
    parser.add_argument(
        "--drain-s", type=float, default=240.0, help="most seconds to wait for tasks to end"
    )
    parser.add_argument(
        "--outage-s", type=float, default=5.0, help="seconds Redis and PostgreSQL stay down"
    )
    parser.add_argument("--task-s", default="20,40", help="a sub-task's seconds, min,max")
    parser.add_argument("--generators", type=int, default=2, help="load-generator processes")
    parser.add_argument("--api-processes", type=int, default=2, help="API processes")
    parser.add_argument(
        "--busy-fraction", type=float, default=0.5, help="agents running a sub-task"
    )
    parser.add_argument("--keep-log", type=Path, help="copy the API's log here")
    args = parser.parse_args()
    if args.api_processes < 2:
        parser.error("--api-processes must be at least 2: one is killed")
    with tempfile.TemporaryDirectory(prefix="polytrain-faults-") as workdir:
        os.chmod(workdir, 0o755)  # the postgres user reaches its folder inside
        lines = run(args, Path(workdir))
    print("\n".join(json.dumps(line) for line in lines), flush=True)
    return 0  # a broken promise is a result, not a failure to run


if __name__ == "__main__":
    sys.exit(main())
