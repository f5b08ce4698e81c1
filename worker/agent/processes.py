"""Second-level dispatch: the worker processes of one group on this host."""

import ctypes
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from worker.agent.sandbox import (
    Lease,
    Sandbox,
    check_rank_env,
    rank_environment,
)

log = logging.getLogger(__name__)
REFILL_RETRY_S = 5.0

PR_SET_PDEATHSIG = 1
Cause = Literal["user", "infra", "peer"]


def _die_with_parent(parent_pid: int) -> None:
    """In the child before exec: SIGKILL this process when the agent that started it dies.

    The kernel sends the signal when the starting thread exits; the agent
    starts ranks from its long-lived Celery pool threads. Linux only; elsewhere
    the torch.distributed timeout ends orphans.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the agent died before prctl took effect
        os._exit(1)


def _popen(command: list[str], env: Mapping[str, str]) -> subprocess.Popen[str]:
    parent = os.getpid()
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        command, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        preexec_fn=lambda: _die_with_parent(parent),
    )


@dataclass
class Slot:
    """A sandboxed interpreter (`worker.agent.warm`) in its own rank directory, awaiting its rank.

    The agent writes the rank's spec and code into `rank_dir`, then calls
    `begin`; until then no user code runs in the slot.
    """

    popen: subprocess.Popen[str]
    rank_dir: Path
    lease: Lease

    def begin(self, spec_path: Path, env: Mapping[str, str], *, task_id: int,
              peers: Sequence[str], memory_limit_mb: int) -> bool:
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
        order = {"argv": ["--spec", str(spec_path)], "env": dict(env), "cwd": str(self.rank_dir),
                 "memory_limit_bytes": memory_limit_mb * 1024 * 1024}
        try:
            self.popen.stdin.write(json.dumps(order) + "\n")
            self.popen.stdin.close()
        except (BrokenPipeError, OSError):
            return False
        return True


def start_slot(sandbox: Sandbox, *, warm: bool = False) -> Slot:
    """Start an interpreter in a new rank directory inside the sandbox.

    It runs as a sandbox uid leased for it alone, with no network until
    `Slot.begin`; the uid goes back to the pool when the process has ended.
    Its environment is only the allow-listed one (`sandbox.rank_environment`);
    it dies with the agent (parent-death signal, and bwrap's `--die-with-parent`),
    so a killed agent leaves no orphan training processes. `warm`: import torch
    and the engine first, then print `@@warm ready`. Raises SandboxUnavailable
    when every sandbox uid of the host is in use.
    """
    lease = sandbox.pool.lease()
    try:
        rank_dir = sandbox.new_rank_dir(lease.uid)
        argv = ["-m", "worker.agent.warm", *([] if warm else ["--cold"])]
        popen = _popen(sandbox.command(rank_dir, argv, lease.uid),
                       rank_environment({}, rank_dir))
    except BaseException:
        lease.release()
        raise
    threading.Thread(target=_release_when_done, args=(popen, lease), name="uid-lease",
                     daemon=True).start()
    return Slot(popen, rank_dir, lease)


def _release_when_done(popen: subprocess.Popen[str], lease: Lease) -> None:
    popen.wait()
    lease.release()


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
            threading.Thread(target=self._await_ready, args=(slot,), name="warm-wait",
                             daemon=True).start()

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


def node_name(rank: int) -> str:
    """The node label of a rank in logs: `ps` for the parameter server, else `rank-N`."""
    return "ps" if rank == 0 else f"rank-{rank}"


PEER_ERRORS = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
               "Broken pipe", "Connection refused", "DistNetworkError", "DistStoreError")


def error_summary(tail: list[str]) -> str:
    """The last `SomeError: message` line of a traceback, else the last line."""
    lines = [line.strip() for line in tail if line.strip()]
    errors = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (errors or lines or ["(no output)"])[-1][:500]


@dataclass
class RankProcess:
    rank: int
    popen: subprocess.Popen[str]
    tail: list[str] = field(default_factory=list)

    @property
    def node(self) -> str:
        return node_name(self.rank)

    @property
    def returncode(self) -> int | None:
        """The rank's exit code; negative: killed by that signal.

        bwrap exits with 128 + N when the process it runs is killed by signal N
        (a shell's convention); that is mapped back to -N. User code exiting
        with such a code on purpose is then taken for a killed process: at
        worst it spends the task's own restarts.
        """
        code = self.popen.returncode
        if code is not None and 128 < code < 128 + signal.NSIG:
            return -(code - 128)
        return code


class ProcessSet:
    """Processes started in their own sessions; their output lines go to one queue."""

    def __init__(self) -> None:
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.procs: list[RankProcess] = []
        self._readers: list[threading.Thread] = []

    def add(self, rank: int, popen: subprocess.Popen[str]) -> None:
        proc = RankProcess(rank, popen)
        self.procs.append(proc)
        reader = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _pump(self, proc: RankProcess) -> None:
        assert proc.popen.stdout is not None
        for raw in proc.popen.stdout:
            line = raw.rstrip("\n")
            proc.tail = (proc.tail + [line])[-40:]
            self.lines.put((proc.node, line))

    def alive_ranks(self) -> list[int]:
        return [p.rank for p in self.procs if p.popen.poll() is None]

    def failed(self) -> RankProcess | None:
        """A process that exited with a non-zero code, if any: the root cause first.

        When one rank crashes the others fail with collective-communication
        errors; a rank whose output shows no such error is the one to blame.
        """
        failed = [p for p in self.procs if p.popen.poll() not in (None, 0)]
        own = [p for p in failed if not any(m in "\n".join(p.tail) for m in PEER_ERRORS)]
        candidates = own or failed
        return candidates[0] if candidates else None

    def cause(self, proc: "RankProcess") -> Cause:
        """Why `proc` (from `failed`) failed: `infra` if killed by a signal (OOM killer,
        a crashed host process), `peer` if it only saw a peer go away, else `user`."""
        if proc.returncode is not None and proc.returncode < 0:
            return "infra"
        if any(m in "\n".join(proc.tail) for m in PEER_ERRORS):
            return "peer"
        return "user"

    def all_succeeded(self) -> bool:
        return all(p.popen.poll() == 0 for p in self.procs)

    def drain_readers(self, timeout_s: float = 5.0) -> None:
        """Wait for the readers to reach the end of every process's output."""
        for reader in self._readers:
            reader.join(timeout=timeout_s)

    def kill_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process group, SIGKILL what is left after `grace_s` seconds."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in self.procs):
            time.sleep(0.1)
        self._signal(signal.SIGKILL)
        for proc in self.procs:
            proc.popen.wait()

    def _signal(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.popen.pid, sig)
            except ProcessLookupError:
                pass


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

    def snapshot(self) -> list[dict[str, object]]:
        """`[{"task_id", "ranks"}]` of the ranks alive now."""
        with self._lock:
            sets = list(self._sets.items())
        return [{"task_id": t, "ranks": p.alive_ranks()} for t, p in sets if p.alive_ranks()]
