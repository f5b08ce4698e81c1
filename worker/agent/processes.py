"""Second-level dispatch: the worker processes of one group on this host.

Ranks are started, read and stopped by the engine's launcher (:mod:`worker.engine.ranks`),
each in a sandboxed interpreter (:mod:`worker.agent.sandbox`); this module keeps those
interpreters ready and tells why a rank failed.
"""

import json
import logging
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.agent.monitoring import ResourceSampler
from worker.agent.sandbox import Sandbox, check_rank_env, env_dir, rank_environment
from worker.agent.uids import Lease
from worker.engine.ranks import RankProcess, RankSet, spawn

log = logging.getLogger(__name__)
REFILL_RETRY_S = 5.0

Cause = Literal["user", "infra", "peer"]


@dataclass
class Slot:
    """A sandboxed interpreter (`worker.agent.warm`) in its own rank directory, awaiting its rank.

    The agent writes the rank's spec and code into `rank_dir`, then calls
    `begin`; until then no user code runs in the slot.
    """

    popen: subprocess.Popen[str]
    rank_dir: Path
    lease: Lease

    def begin(
        self,
        spec_path: Path,
        env: Mapping[str, str],
        *,
        task_id: int,
        peers: Sequence[str],
        memory_limit_mb: int,
    ) -> bool:
        """Hand the slot its rank of task `task_id`: open the slot's network to that task's
        ranks (here and on the hosts `peers`), then run the spec with `env` (RANK, ...)
        under the memory limit.

        `memory_limit_mb` becomes the process's RLIMIT_DATA (heap and private
        writable mappings, in MiB). False if the interpreter has already died.
        Raises KeyError if `env` sets a variable outside `sandbox.RANK_ENV`,
        NetworkPolicyUnavailable if the kernel refused the network rules.
        """
        check_rank_env(env)
        if self.popen.poll() is not None or self.popen.stdin is None:
            return False
        try:
            self.lease.admit(task_id, peers)
        except RuntimeError:  # released: the interpreter ended meanwhile
            if self.popen.poll() is not None:
                return False
            raise
        order = {
            "argv": ["--spec", str(spec_path)],
            "env": dict(env),
            "cwd": str(self.rank_dir),
            "memory_limit_bytes": memory_limit_mb * 1024 * 1024,
        }
        try:
            self.popen.stdin.write(json.dumps(order) + "\n")
            self.popen.stdin.close()
        except (BrokenPipeError, OSError):
            return False
        return True


def start_slot(
    sandbox: Sandbox, *, warm: bool = False, env: Mapping[str, str] | None = None
) -> Slot:
    """Start an interpreter in a new rank directory inside the sandbox.

    It runs as a sandbox uid leased for it alone, with no network until
    `Slot.begin`; the uid goes back to the pool when the process has ended.
    Its environment is only the allow-listed one (`sandbox.rank_environment`);
    it dies with the agent (parent-death signal, and bwrap's `--die-with-parent`),
    so a killed agent leaves no orphan training processes. `warm`: import torch
    and the engine first, then print `@@warm ready`. `env`: variables the interpreter must
    start with (of `sandbox.RANK_ENV`; a sharded worker's allocator,
    `worker.engine.ranks.allocator_env`). Raises SandboxUnavailable
    when every sandbox uid of the host is in use.
    """
    lease = sandbox.pool.lease()
    try:
        rank_dir = sandbox.new_rank_dir(lease.uid)
        argv = ["-m", "worker.agent.warm", *([] if warm else ["--cold"])]
        # Started from the pool's long-lived thread (or the runner's), so the parent-death
        # signal fires when the agent dies, not when a short-lived thread ends.
        popen = spawn(
            sandbox.command(rank_dir, argv, lease.uid),
            rank_environment(dict(env or {}), rank_dir),
            stdin=True,
            die_with_parent=True,
        )
    except BaseException:
        lease.release()
        raise
    threading.Thread(
        target=_release_when_done, args=(popen, lease, rank_dir), name="uid-lease", daemon=True
    ).start()
    return Slot(popen, rank_dir, lease)


def _release_when_done(popen: subprocess.Popen[str], lease: Lease, rank_dir: Path) -> None:
    """When the interpreter has ended: its uid back to the pool, its links to an environment
    gone (so an evicted environment's disk is freed)."""
    popen.wait()
    lease.release()
    shutil.rmtree(env_dir(rank_dir), ignore_errors=True)


class WarmPool:
    """Up to `size` warm sandboxed interpreters (`worker.agent.warm`), refilled in the background.

    `acquire` hands out a ready one (milliseconds to start a rank) or, if none
    is ready, a cold one. Interpreters are forked by one long-lived thread,
    since the parent-death signal fires when the forking thread ends. Each has
    its own empty rank directory from the start, so a warm interpreter never
    sees another task's files.
    """

    def __init__(self, size: int, sandbox: Sandbox) -> None:
        self.size, self.sandbox = size, sandbox
        self._ready: queue.Queue[Slot] = queue.Queue()
        self._wanted = threading.Semaphore(size)
        self._stop = threading.Event()
        threading.Thread(target=self._refill, name="warm-pool", daemon=True).start()

    def _refill(self) -> None:
        while not self._stop.is_set():
            self._wanted.acquire()
            if self._stop.is_set():
                return
            try:
                slot = start_slot(self.sandbox, warm=True)
            except Exception as exc:  # e.g. every uid of the host in use: wait, then again
                log.warning("warm pool: %s; trying again in %s s", exc, REFILL_RETRY_S)
                self._wanted.release()
                self._stop.wait(REFILL_RETRY_S)
                continue
            # Interpreters warm up side by side (each mostly imports: a few seconds), so a
            # pool emptied by one task is full again in about one interpreter's start.
            threading.Thread(
                target=self._await_ready, args=(slot,), name="warm-wait", daemon=True
            ).start()

    def _await_ready(self, slot: Slot) -> None:
        assert slot.popen.stdout is not None
        if slot.popen.stdout.readline().strip() == "@@warm ready" and not self._stop.is_set():
            self._ready.put(slot)
        else:  # it failed to import (no retry loop: ranks start cold), or the pool closed
            slot.popen.kill()

    def acquire(self) -> Slot:
        """A sandboxed interpreter awaiting its rank, warm if one is ready."""
        while True:
            try:
                slot = self._ready.get_nowait()
            except queue.Empty:
                return start_slot(self.sandbox)
            self._wanted.release()
            if slot.popen.poll() is None:
                return slot

    def close(self) -> None:
        """Stop refilling, end the idle interpreters and remove their unused directories."""
        self._stop.set()
        self._wanted.release()
        while not self._ready.empty():
            slot = self._ready.get_nowait()
            slot.popen.kill()
            slot.popen.wait()
            shutil.rmtree(slot.rank_dir, ignore_errors=True)
            shutil.rmtree(env_dir(slot.rank_dir), ignore_errors=True)


PEER_ERRORS = (
    "DistBackendError",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "DistNetworkError",
    "DistStoreError",
)


def error_summary(tail: list[str]) -> str:
    """The last `SomeError: message` line of a traceback, else the last line."""
    lines = [line.strip() for line in tail if line.strip()]
    errors = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (errors or lines or ["(no output)"])[-1][:500]


class ProcessSet(RankSet):
    """A sub-task's rank processes (:class:`worker.engine.ranks.RankSet`), and which failed why."""

    def failed(self) -> RankProcess | None:
        """A process that exited with a non-zero code, if any: the root cause first.

        When one rank crashes the others fail with collective-communication
        errors; a rank whose output shows no such error is the one to blame.
        """
        failed = self.exited_with_error()
        own = [p for p in failed if not any(m in "\n".join(p.tail) for m in PEER_ERRORS)]
        candidates = own or failed
        return candidates[0] if candidates else None

    @staticmethod
    def cause(proc: RankProcess) -> Cause:
        """Why `proc` (from `failed`) failed: `infra` if killed by a signal (OOM killer,
        a crashed host process), `peer` if it only saw a peer go away, else `user`."""
        if proc.returncode is not None and proc.returncode < 0:
            return "infra"
        if any(m in "\n".join(proc.tail) for m in PEER_ERRORS):
            return "peer"
        return "user"


class RunningRegistry:
    """The process sets of every sub-task this agent runs, for its heartbeats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[int, ProcessSet] = {}

    def add(self, task_id: int, procs: ProcessSet) -> None:
        with self._lock:
            self._sets[task_id] = procs

    def remove(self, task_id: int, procs: ProcessSet | None = None) -> None:
        """Forget the task's process set (only `procs`, if given: not a newer attempt's)."""
        with self._lock:
            if procs is None or self._sets.get(task_id) is procs:
                self._sets.pop(task_id, None)

    def wait_gone(self, task_id: int, *, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds until no process set of the task is registered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if task_id not in self._sets:
                    return True
            time.sleep(0.1)
        return False

    def snapshot(self, sampler: ResourceSampler | None = None) -> list[dict[str, object]]:
        """`[{"task_id", "ranks"}]` of the ranks alive now; with `sampler`, when a sample is
        due, also each rank's resource use (`samples`, :mod:`worker.agent.monitoring`)."""
        with self._lock:
            sets = list(self._sets.items())
        alive = {t: [q for q in p.procs if q.popen.poll() is None] for t, p in sets}
        alive = {t: procs for t, procs in alive.items() if procs}
        entries: list[dict[str, object]] = [
            {"task_id": t, "ranks": [q.rank for q in procs]} for t, procs in alive.items()
        ]
        if sampler is not None and sampler.due():
            pids = {(t, q.rank): q.popen.pid for t, procs in alive.items() for q in procs}
            try:
                found = sampler.sample(pids)
            except Exception:  # a failed measurement must not cost the heartbeat
                log.warning("could not measure the ranks' resource use", exc_info=True)
                return entries
            for entry, (t, procs) in zip(entries, alive.items(), strict=True):
                entry["samples"] = [
                    {"rank": q.rank, **found[(t, q.rank)]} for q in procs if (t, q.rank) in found
                ]
        return entries
