"""Run a whole task (parameter server + every worker) as subprocesses on this host.

Used by tests and benchmarks; the ranks run unsandboxed, with this process's
environment (trusted code only, docs/security.md). It starts, reads and stops
them with :mod:`worker.engine.ranks`, the launcher the agent uses too.
"""

from __future__ import annotations

import queue
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from worker.engine import prefork
from worker.engine.ranks import (
    RankSet,
    allocator_env,
    checkout_env,
    rank_command,
    rank_env,
    spawn,
)
from worker.engine.report import parse_event, rendezvous_port
from worker.engine.spec import RunSpec


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
        """All output of ``rank`` as one string ("" for a rank that never started: rank 0
        failed before the others were started)."""
        return "\n".join(self.output.get(rank, []))

    def metrics(self, name: str, rank: int = 0) -> list[float | None]:
        """Values of metric ``name`` reported by ``rank``, in order."""
        return [
            e["value"]
            for e in self.events
            if e["type"] == "metric" and e["name"] == name and e["rank"] == rank
        ]


StopWhen = Callable[[dict[str, Any]], bool]


def _stop_requested(ranks: RankSet, stop_when: StopWhen | None) -> bool:
    """Take every output line waiting; True if one is an event ``stop_when`` matches."""
    matched = False
    while True:
        try:
            _node, line = ranks.lines.get_nowait()
        except queue.Empty:
            return matched
        if stop_when is not None and (event := parse_event(line)) is not None:
            matched = matched or stop_when(event)


def _supervise(
    ranks: RankSet, timeout_s: float, fail_grace_s: float, stop_when: StopWhen | None
) -> tuple[bool, bool]:
    """Wait for every rank; after a failure give the others ``fail_grace_s`` seconds, then kill.

    Kills every rank at once when ``stop_when`` matches an event. Returns
    ``(timed_out, stopped)``: the overall timeout was hit (with no rank failed),
    ``stop_when`` matched.
    """
    deadline = time.monotonic() + timeout_s
    while ranks.alive_ranks():
        if _stop_requested(ranks, stop_when):
            ranks.kill_all(grace_s=0.5)
            return False, True
        if ranks.exited_with_error(read_timeout_s=0.0):
            deadline = min(deadline, time.monotonic() + fail_grace_s)
        if time.monotonic() > deadline:
            timed_out = not ranks.exited_with_error(read_timeout_s=0.0)
            ranks.kill_all(grace_s=3.0)
            return timed_out, False
        time.sleep(0.05)
    return False, False


def _rendezvous_port(ranks: RankSet, deadline: float) -> int | None:
    """The port rank 0 (the only rank started) reports in its ``rendezvous`` event
    (:func:`worker.engine.distributed.rendezvous_store`), read from its output as its reader
    keeps it (``tail``; the queue of lines is left to ``stop_when``); None when rank 0's
    output ends or ``deadline`` (time.monotonic) passes first."""
    (proc,) = ranks.procs
    read = 0
    while time.monotonic() < deadline:
        ended = proc.reader is not None and not proc.reader.is_alive()  # before reading
        for line in proc.tail[read:]:
            read += 1
            port = rendezvous_port(line)
            if port is not None:
                return port
        if ended:
            return None
        time.sleep(0.02)
    return None


def _start(spec_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """One rank: a fresh interpreter, or forked from the preloaded fork server once tests
    asked for it (:mod:`worker.engine.prefork`); always a fresh one for a rank that preloads
    a library (:func:`worker.engine.ranks.allocator_env`), which a fork could not load."""
    if prefork.enabled() and "LD_PRELOAD" not in env:
        # ForkedRank has the part of Popen that RankSet uses (pid, stdout, poll, wait).
        return cast("subprocess.Popen[str]", prefork.ForkedRank(["--spec", str(spec_path)], env))
    return spawn(rank_command(spec_path), env)


def launch_local(
    spec: RunSpec,
    *,
    port: int | None = None,
    env_extra: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    fail_grace_s: float = 10.0,
    stop_when: StopWhen | None = None,
    on_spawn: Callable[[dict[int, int]], None] | None = None,
) -> LocalRun:
    """Run every rank of ``spec`` on 127.0.0.1 and wait for all of them.

    ``port`` defaults to one rank 0's rendezvous store picks and reports (the other ranks
    start once it has: no other socket can take it first, as one could take a port chosen
    here for rank 0 to bind later); when rank 0 fails before that, no other rank starts.
    ``env_extra`` is added to each rank's environment. When a rank fails, the others get
    ``fail_grace_s`` seconds to notice and exit before they are killed; at ``timeout_s``
    seconds all are killed (rank 0's wait for its port included). ``stop_when(event)``
    returning True for any rank's event kills every rank at once (an interruption, for
    resume tests). ``on_spawn(pids)`` is called once every rank has started, with each
    rank's process id, while the others are still importing and rank 0 waits for them at
    its store (benchmarks place ranks in CPU cgroups with it, bench/throttle.py, before any
    computes or starts a child), and not at all when rank 0 failed first; if it raises, or
    the wait is interrupted (KeyboardInterrupt, a test's timeout), every rank is killed and
    the error propagates.
    Otherwise never raises for a failed run: inspect the returned LocalRun.
    """
    started = time.monotonic()
    ranks = RankSet(keep=None)
    with tempfile.TemporaryDirectory(prefix="polytrain-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec.model_dump_json())

        def start(rank: int, port: int) -> None:
            env = {
                **rank_env(spec, rank, "127.0.0.1", port),
                **allocator_env(spec.rank_sharded(rank)),
                **(env_extra or {}),
            }
            ranks.add(rank, _start(spec_path, checkout_env(env)))

        try:  # a rank that fails to start, on_spawn's error, an interrupt: no rank outlives it
            start(0, port or 0)
            # Without a port, rank 0's store listens on one the kernel picked.
            met = port or _rendezvous_port(ranks, deadline=started + timeout_s)
            if met is not None:
                for rank in range(1, spec.world_size):
                    start(rank, met)
                if on_spawn is not None:
                    on_spawn({p.rank: p.popen.pid for p in ranks.procs})
            left_s = started + timeout_s - time.monotonic()  # one timeout for the whole run
            timed_out, stopped = _supervise(ranks, left_s, fail_grace_s, stop_when)
        except BaseException:
            ranks.kill_all(grace_s=0.5)
            raise
        ranks.drain_readers()
        stopped = _stop_requested(ranks, stop_when) or stopped
    output = {p.rank: p.tail for p in ranks.procs}
    events = [
        {**e, "_rank": rank}
        for rank in sorted(output)
        for line in output[rank]
        if (e := parse_event(line)) is not None
    ]
    return LocalRun(
        pids={p.rank: p.popen.pid for p in ranks.procs},
        returncodes={p.rank: int(p.popen.returncode) for p in ranks.procs},
        output=output,
        wall_s=time.monotonic() - started,
        timed_out=timed_out,
        events=events,
        stopped=stopped,
    )
