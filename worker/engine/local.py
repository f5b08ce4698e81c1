"""Run a whole task (parameter server + every worker) as subprocesses on this host.

Used by tests and ``polytrain train-local``. The agent uses the building blocks
:func:`rank_env` and :func:`start_rank_process` to start its own group's ranks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.engine.report import parse_event
from worker.engine.spec import RunSpec

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LocalRun:
    """Outcome of :func:`launch_local`.

    ``output[rank]`` holds the rank's stdout and stderr lines (merged, without
    newlines); ``returncodes[rank]`` is its exit code (negative: killed by that
    signal); ``pids[rank]`` its process id, which is also its session id.
    ``timed_out`` is True when the run was killed at ``timeout_s``, ``stopped``
    when it was killed because ``stop_when`` matched an event; ``events`` are
    the parsed event lines of every rank, each with ``_rank`` (the emitter) added.
    """

    pids: dict[int, int]
    returncodes: dict[int, int]
    output: dict[int, list[str]]
    wall_s: float
    timed_out: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False

    @property
    def ok(self) -> bool:
        """True when every rank exited 0."""
        return (
            not self.timed_out
            and not self.stopped
            and all(code == 0 for code in self.returncodes.values())
        )

    def text(self, rank: int) -> str:
        """All output of ``rank`` as one string."""
        return "\n".join(self.output[rank])

    def metrics(self, name: str, rank: int = 0) -> list[float | None]:
        """Values of metric ``name`` reported by ``rank``, in order."""
        return [
            e["value"]
            for e in self.events
            if e["type"] == "metric" and e["name"] == name and e["rank"] == rank
        ]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(spec: RunSpec, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment variables that place a process at ``rank`` of the task.

    ``LOCAL_RANK`` is the rank's index inside its group (0 for the parameter
    server): right when a group's ranks share one host, to be overridden otherwise.
    Raises ValueError if ``rank`` is outside the world.
    """
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} outside world of size {spec.world_size}")
    local_rank = 0 if rank == 0 else spec.group_ranks(spec.group_of(rank)).index(rank)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "LOCAL_RANK": str(local_rank),
        "PYTHONUNBUFFERED": "1",
    }


def start_rank_process(
    spec_path: str | os.PathLike[str], env: Mapping[str, str], python: str = sys.executable
) -> subprocess.Popen[str]:
    """Start ``python -m worker.engine.launch --spec spec_path`` with ``env`` over os.environ.

    stdout and stderr are merged into one text pipe, line-buffered; the process
    leads a new session, so ``os.killpg(proc.pid, sig)`` reaches its whole tree.
    """
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    return subprocess.Popen(
        [python, "-m", "worker.engine.launch", "--spec", str(spec_path)],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )


def kill_tree(proc: subprocess.Popen[str], grace_s: float = 3.0) -> None:
    """SIGTERM the process's session, then SIGKILL it if still alive after ``grace_s`` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


StopWhen = Callable[[dict[str, Any]], bool]


def _pump(
    proc: subprocess.Popen[str], sink: list[str], stop_when: StopWhen | None, stop: threading.Event
) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sink.append(line.rstrip("\n"))
        if stop_when is not None and (event := parse_event(sink[-1])) is not None:
            if stop_when(event):
                stop.set()


def _kill_all(procs: dict[int, subprocess.Popen[str]]) -> None:
    for p in procs.values():
        if p.poll() is None:
            kill_tree(p, grace_s=0.5)


def _supervise(
    procs: dict[int, subprocess.Popen[str]],
    timeout_s: float,
    fail_grace_s: float,
    stop: threading.Event,
) -> bool:
    """Wait for every rank; after a failure give the others ``fail_grace_s`` seconds, then kill.

    Kills every rank at once when ``stop`` is set. Returns True if the overall
    timeout was hit.
    """
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs.values()):
        if stop.is_set():
            _kill_all(procs)
            return False
        if any((p.poll() or 0) != 0 for p in procs.values()):
            deadline = min(deadline, time.monotonic() + fail_grace_s)
        if time.monotonic() > deadline:
            timed_out = all((p.poll() or 0) == 0 for p in procs.values())
            for p in procs.values():
                if p.poll() is None:
                    kill_tree(p)
            return timed_out
        time.sleep(0.05)
    return False


def launch_local(
    spec: RunSpec,
    *,
    port: int | None = None,
    env_extra: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    fail_grace_s: float = 10.0,
    stop_when: StopWhen | None = None,
) -> LocalRun:
    """Run every rank of ``spec`` on 127.0.0.1 and wait for all of them.

    ``port`` defaults to a free one; ``env_extra`` is added to each rank's
    environment. When a rank fails, the others get ``fail_grace_s`` seconds to
    notice and exit before they are killed; at ``timeout_s`` seconds all are
    killed. ``stop_when(event)`` returning True for any rank's event kills
    every rank at once (an interruption, for resume tests). Never raises for a
    failed run: inspect the returned LocalRun.
    """
    port = port or free_port()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="polytrain-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec.model_dump_json())
        procs: dict[int, subprocess.Popen[str]] = {}
        output: dict[int, list[str]] = {}
        pumps = []
        stop = threading.Event()
        for rank in range(spec.world_size):
            env = {**rank_env(spec, rank, "127.0.0.1", port), **(env_extra or {})}
            procs[rank] = start_rank_process(spec_path, env)
            output[rank] = []
            pumps.append(
                threading.Thread(
                    target=_pump, args=(procs[rank], output[rank], stop_when, stop), daemon=True
                )
            )
            pumps[-1].start()
        timed_out = _supervise(procs, timeout_s, fail_grace_s, stop)
        for pump in pumps:
            pump.join(timeout=5.0)
    events = [
        {**e, "_rank": rank}
        for rank in sorted(output)
        for line in output[rank]
        if (e := parse_event(line)) is not None
    ]
    return LocalRun(
        pids={r: p.pid for r, p in procs.items()},
        returncodes={r: int(p.returncode) for r, p in procs.items()},
        output=output,
        wall_s=time.monotonic() - started,
        timed_out=timed_out,
        events=events,
        stopped=stop.is_set(),
    )
