"""The one launcher of rank processes on a host: their environment, starting them, reading
their output, stopping them.

:func:`worker.engine.local.launch_local` runs every rank of a task with it (tests,
benchmarks); the agent (:mod:`worker.agent.processes`) runs its group's ranks with it, each
in a sandboxed interpreter. Every process leads a session of its own, so a signal to its
process group reaches all it started.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from worker.engine.spec import RunSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1
TAIL_LINES = 40


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(spec: RunSpec, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment variables that place a process at ``rank`` of the task.

    ``LOCAL_RANK`` is the rank's index inside its group (0 for the parameter
    server and its shards' owners): right when a group's ranks share one host, to be
    overridden otherwise. Raises ValueError if ``rank`` is outside the world.
    """
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} outside world of size {spec.world_size}")
    serves = rank == 0 or spec.is_shard_server(rank)
    local_rank = 0 if serves else spec.group_ranks(spec.group_of(rank)).index(rank)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "LOCAL_RANK": str(local_rank),
        "PYTHONUNBUFFERED": "1",
    }


# Where distributions install jemalloc 5 (Debian and Ubuntu's libjemalloc2, Fedora's and
# RHEL's jemalloc), for POLYTRAIN_JEMALLOC=on.
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)
# Freed pages are kept for reuse rather than purged (a step frees and allocates the same
# sizes again: purged pages would be faulted in afresh every step), and freed address space
# is unmapped rather than retained (it would count against memory_limit_mb, RLIMIT_DATA).
SHARDED_MALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1,retain:false"
JEMALLOC_ON = ("on", "1", "true")  # POLYTRAIN_JEMALLOC's spellings of "the usual paths"


def jemalloc_path(environ: Mapping[str, str] | None = None) -> str | None:
    """The jemalloc shared library to preload into a sharded rank, as ``POLYTRAIN_JEMALLOC``
    asks on the host that starts it: ``on`` (or ``1``, ``true``), the first of
    :data:`JEMALLOC_PATHS` that exists (None where none does); a path, that file; unset,
    ``off`` (``0``, ``false``) or empty, None (glibc's malloc, the default). Raises ValueError
    for a path that is not a regular file under ``/usr`` (what a rank's sandbox shows it)
    owned by root and writable by root alone: the library is loaded into every process the
    agent starts for such a rank, the sandbox's own included."""
    source = os.environ if environ is None else environ
    chosen = source.get("POLYTRAIN_JEMALLOC", "").strip()
    if chosen.lower() in ("", "off", "0", "false"):
        return None
    if chosen.lower() in JEMALLOC_ON:
        return next((p for p in JEMALLOC_PATHS if Path(p).is_file()), None)
    path = Path(chosen)
    try:
        info = path.resolve().stat()
    except OSError:
        info = None
    safe = (
        info is not None
        and path.is_absolute()
        and path.resolve().is_relative_to("/usr")
        and stat.S_ISREG(info.st_mode)
        and info.st_uid == 0
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )
    if not safe:
        raise ValueError(
            f"POLYTRAIN_JEMALLOC={chosen}: not 'on', 'off' or the path of a library under /usr "
            "owned and writable by root alone (Debian: apt-get install libjemalloc2, then 'on')"
        )
    return chosen


def allocator_env(sharded: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a rank starts with for its memory allocator: for a worker of a group
    with ``sharding: fsdp`` on a host that asks for it (``POLYTRAIN_JEMALLOC``,
    :func:`jemalloc_path`), jemalloc preloaded (``LD_PRELOAD``) with
    :data:`SHARDED_MALLOC_CONF`; nothing otherwise.

    The trade-off (docs/benchmarks.md, "Sharding inside a group"): an FSDP2 worker allocates
    and frees every unit's gathered parameters and gradients each step. glibc's malloc with
    the fixed mmap threshold the engine sets (:func:`worker.engine.fsdp.return_freed_memory`)
    hands each back at once and maps it afresh the next step: the least memory, but a
    10M-parameter step took 650 ms against plain FSDP2's 290. jemalloc keeps the freed pages
    for the next gather: 300 ms, at 10-15 % more peak memory per worker (0.63-0.68 of an
    unsharded worker's against 0.56-0.59), and more than the plan's trial measured for a
    sharded worker (it runs on glibc). The variables must be set when the interpreter
    starts, so such a rank starts in a fresh one (not a warm one, nor a test's fork
    server)."""
    path = jemalloc_path(environ) if sharded else None
    return {} if path is None else {"LD_PRELOAD": path, "MALLOC_CONF": SHARDED_MALLOC_CONF}


def node_name(rank: int) -> str:
    """The node label of a rank in logs: `ps` for the parameter server, else `rank-N`."""
    return "ps" if rank == 0 else f"rank-{rank}"


def _die_with_parent(parent_pid: int) -> None:
    """In the child before exec: SIGKILL this process when the thread that started it ends.

    The agent starts ranks from long-lived threads. Linux only; elsewhere the
    torch.distributed timeout ends orphans.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def spawn(
    command: list[str],
    env: Mapping[str, str],
    *,
    stdin: bool = False,
    die_with_parent: bool = False,
) -> subprocess.Popen[str]:
    """Start ``command`` with exactly ``env``, leading a new session.

    stdout and stderr are merged into one line-buffered text pipe; ``stdin``
    gives the process a pipe to read from (else it inherits this one's).
    ``die_with_parent``: the process is SIGKILLed when the thread that started
    it ends (the agent: a killed agent leaves no orphan ranks).
    """
    parent = os.getpid()
    return subprocess.Popen(
        command,
        env=dict(env),
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
        preexec_fn=(lambda: _die_with_parent(parent)) if die_with_parent else None,
    )


@dataclass
class RankProcess:
    """One rank's process and its last output lines (all of them in a set that keeps all)."""

    rank: int
    popen: subprocess.Popen[str]
    tail: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None  # reads `popen.stdout` into `tail` (RankSet)

    @property
    def node(self) -> str:
        return node_name(self.rank)

    @property
    def returncode(self) -> int | None:
        """The rank's exit code; negative: killed by that signal.

        A sandboxed rank runs under bubblewrap, which exits with 128 + N when
        the process it runs is killed by signal N (a shell's convention); that
        is mapped back to -N. User code exiting with such a code on purpose is
        then taken for a killed process: at worst it spends the task's own restarts.
        """
        code = self.popen.returncode
        if code is not None and 128 < code < 128 + signal.NSIG:
            return -(code - 128)
        return code


class RankSet:
    """Rank processes started in their own sessions; a reader thread per process puts each
    output line, with the rank's node name, on the one queue `lines` and keeps the last
    `keep` lines (all with None) in the process's `tail`."""

    def __init__(self, keep: int | None = TAIL_LINES) -> None:
        self.keep = keep
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.procs: list[RankProcess] = []
        self._readers: list[threading.Thread] = []

    def add(self, rank: int, popen: subprocess.Popen[str]) -> RankProcess:
        proc = RankProcess(rank, popen)
        self.procs.append(proc)
        proc.reader = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        proc.reader.start()
        self._readers.append(proc.reader)
        return proc

    def _pump(self, proc: RankProcess) -> None:
        assert proc.popen.stdout is not None
        for raw in proc.popen.stdout:
            line = raw.rstrip("\n")
            if self.keep is None:
                proc.tail.append(line)
            else:
                proc.tail = (proc.tail + [line])[-self.keep :]
            self.lines.put((proc.node, line))

    def alive_ranks(self) -> list[int]:
        return [p.rank for p in self.procs if p.popen.poll() is None]

    def exited_with_error(self, read_timeout_s: float = 5.0) -> list[RankProcess]:
        """The processes that have exited with a non-zero code, in start order, each with its
        output read to the end (waiting up to `read_timeout_s` in all): a process can exit
        before its reader has taken its last lines, the ones that say why it failed."""
        failed = [p for p in self.procs if p.popen.poll() not in (None, 0)]
        deadline = time.monotonic() + read_timeout_s
        for proc in failed:
            if proc.reader is not None:
                proc.reader.join(timeout=max(0.0, deadline - time.monotonic()))
        return failed

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
        while time.monotonic() < deadline and self.alive_ranks():
            time.sleep(0.1)
        self._signal(signal.SIGKILL)
        for proc in self.procs:
            proc.popen.wait()

    def _signal(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.popen.pid, sig)
            except ProcessLookupError:
                # No group of that id: the process is gone, or (forked, tests only) not yet
                # its session's leader. Only a child not yet reaped still owns its pid.
                if proc.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.popen.pid, sig)


def rank_command(spec_path: str | os.PathLike[str], python: str = sys.executable) -> list[str]:
    """The command line of one unsandboxed rank: ``python -m worker.engine.launch --spec PATH``."""
    return [python, "-m", "worker.engine.launch", "--spec", str(spec_path)]


def checkout_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` over this process's environment, with this checkout first on PYTHONPATH."""
    full = {**os.environ, **env}
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full.get("PYTHONPATH", "")) if p
    )
    return full
