"""Second-level dispatch: the worker processes of one group on this host."""

import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field


def node_name(rank: int) -> str:
    """The node label of a rank in logs: `ps` for the parameter server, else `rank-N`."""
    return "ps" if rank == 0 else f"rank-{rank}"


PEER_ERRORS = ("DistBackendError", "Connection closed by peer", "Connection reset by peer")


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
        return (own or failed or [None])[0]

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

    def remove(self, task_id: int) -> None:
        with self._lock:
            self._sets.pop(task_id, None)

    def snapshot(self) -> list[dict[str, object]]:
        """`[{"task_id", "ranks"}]` of the ranks alive now."""
        with self._lock:
            sets = list(self._sets.items())
        return [{"task_id": t, "ranks": p.alive_ranks()} for t, p in sets if p.alive_ranks()]
