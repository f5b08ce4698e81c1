"""Real CPU throttling for the heterogeneity benchmarks: cgroup v1 CFS quotas and core pinning.

A *throttled group* is a cgroup under the v1 ``cpu`` controller (``/sys/fs/cgroup/cpu``,
root only) with a CFS bandwidth limit: in every ``cpu.cfs_period_us`` (:data:`PERIOD_US`) its
processes together run at most ``cpu.cfs_quota_us = fraction * period`` µs, then wait for
the next period (the kernel's CFS bandwidth control, Documentation/scheduler/
sched-bwc.rst). Each group's processes are also pinned to one core
(``os.sched_setaffinity`` on every thread in ``/proc/<pid>/task``; threads and processes
started later inherit it), so a group at ``fraction`` 1/3 has a third of one core and a
group at 1.0 a whole core of its own: two pinned groups on two cores do not take compute
from each other, as devices of their own would not. The parameter server (rank 0) of a
task and the benchmark process stay in the root group, unthrottled and unpinned: the
kernel runs them wherever a core is free (usually the throttled core during its idle part
of each period), and they mostly wait.

Placing a process writes its pid to the group's ``cgroup.procs``, which in cgroup v1 moves
its whole thread group; children started afterwards (DataLoader workers) inherit the
cgroup and the affinity. :class:`Throttle` is a context manager that removes everything
it created on exit, also on an exception or KeyboardInterrupt: the processes still in a
group are moved back to the root group first (a non-empty cgroup cannot be removed).

Where the controller is missing or not writable (not root, no cgroup v1 ``cpu``
hierarchy mounted, a read-only mount) every operation raises :class:`ThrottleError`;
benchmarks turn it into a message and a non-zero exit (:func:`exit_unavailable`), never a
silent fallback to unthrottled runs.

    with Throttle(prefix="ptbench-thr") as throttle:
        slow = throttle.group("slow", fraction=1 / 3, core=1)
        slow.place(pid)          # the process and all its threads: quota and core 1
        slow.set_fraction(2 / 3) # while it runs
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
# 10 ms, not the kernel's default 100 ms: with 100 ms a process at a third of a core runs
# 33 ms at full speed, then stalls 67 ms, bursts that a slower device never has and that
# steps of tens of ms feel whole (hetero_gain_real, sync, 34k, one round each at load 1.8:
# 0.59 at 100 ms, 0.83 at 10 ms, 0.79 at 2 ms, where the kernel's own cost grows).
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses quotas below 1 ms
# The heterogeneity benchmarks' two groups: "fast" with a core of its own, "slow" with a
# quota on the other core.
FAST_CORE, SLOW_CORE = 0, 1


class ThrottleError(RuntimeError):
    """The cgroup v1 cpu controller is missing or not writable, or a cgroup operation failed."""


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as err:
        raise ThrottleError(f"cannot write {value!r} to {path}: {err}") from err


def threads_of(pid: int) -> list[int]:
    """Thread ids of process ``pid`` (``/proc/<pid>/task``); raises ThrottleError if it is gone."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError as err:
        raise ThrottleError(f"process {pid} not found: {err}") from err


def pin(pid: int, core: int) -> None:
    """Restrict every thread of process ``pid`` to CPU ``core`` (``sched_setaffinity``).

    Threads it starts later inherit the affinity of the thread that starts them;
    the thread list is read again until no new thread appeared, so one started
    while pinning is not missed. Raises ThrottleError if the process is gone or
    ``core`` is not one this process may use.
    """
    done: set[int] = set()
    while todo := set(threads_of(pid)) - done:
        for tid in todo:
            try:
                os.sched_setaffinity(tid, {core})
            except ProcessLookupError:
                pass  # the thread ended meanwhile
            except OSError as err:
                raise ThrottleError(f"cannot pin thread {tid} to core {core}: {err}") from err
        done |= todo


def affinity(pid: int) -> set[int]:
    """The cores any thread of ``pid`` may run on (the union over its threads)."""
    cores: set[int] = set()
    for tid in threads_of(pid):
        try:
            cores |= os.sched_getaffinity(tid)
        except ProcessLookupError:
            pass
    return cores


def check_controller(root: Path = CPU_ROOT) -> None:
    """Raise ThrottleError unless ``root`` is a writable cgroup v1 cpu hierarchy with CFS quotas."""
    quota = root / "cpu.cfs_quota_us"
    if not quota.is_file():
        raise ThrottleError(
            f"no cgroup v1 cpu controller at {root} ({quota.name} missing): real throttling "
            "needs the v1 'cpu' hierarchy mounted there"
        )
    if not os.access(root, os.W_OK):
        raise ThrottleError(
            f"the cgroup v1 cpu controller at {root} is not writable by uid {os.getuid()}: "
            "real throttling needs root"
        )


class CpuGroup:
    """One cgroup under the cpu controller, its CFS quota and the core its processes use.

    ``fraction`` is the share of one core per period (None: no limit); ``core`` the
    CPU its processes are pinned to (None: not pinned). Made by :meth:`Throttle.group`.
    """

    def __init__(self, path: Path, fraction: float | None, core: int | None, period_us: int):
        self.path = path
        self.core = core
        self.period_us = period_us
        self.fraction: float | None = None
        _write(path / "cpu.cfs_period_us", str(period_us))
        self.set_fraction(fraction)

    @property
    def name(self) -> str:
        return self.path.name

    def set_fraction(self, fraction: float | None) -> None:
        """Limit the group to ``fraction`` of one core from now on (None: unlimited).

        Writes ``cpu.cfs_quota_us = fraction * cfs_period_us`` (at least 1 ms);
        takes effect from the next period, also while the processes run. Raises
        ValueError for a fraction not above 0, ThrottleError if the write fails.
        """
        if fraction is not None and fraction <= 0:
            raise ValueError(f"fraction must be > 0, got {fraction}")
        quota = -1 if fraction is None else max(MIN_QUOTA_US, round(fraction * self.period_us))
        _write(self.path / "cpu.cfs_quota_us", str(quota))
        self.fraction = fraction

    @property
    def quota_us(self) -> int:
        """The group's ``cpu.cfs_quota_us`` as the kernel holds it (-1: no limit)."""
        return int((self.path / "cpu.cfs_quota_us").read_text())

    def place(self, pid: int) -> None:
        """Move process ``pid`` with all its threads into this group and pin it to ``core``.

        Raises ThrottleError if the process is gone or the cgroup write fails.
        """
        _write(self.path / "cgroup.procs", str(pid))
        if self.core is not None:
            pin(pid, self.core)

    def pids(self) -> list[int]:
        """The processes (thread-group ids) in the group now."""
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def stat(self) -> dict[str, int]:
        """``cpu.stat``: ``nr_periods``, ``nr_throttled`` (periods in which the quota ran
        out), ``throttled_time`` (ns), since the group was made."""
        lines = (self.path / "cpu.stat").read_text().split("\n")
        return {key: int(value) for key, value in (line.split() for line in lines if line)}


class Throttle:
    """Makes throttled CPU groups named ``<prefix>-<name>`` under ``root`` and removes them.

    A context manager: on exit, also after an exception, KeyboardInterrupt or
    SIGTERM (entered in the main thread, it turns SIGTERM into SystemExit(143) until
    it exits), the processes still in its groups move back to the root group and the
    groups are removed. Raises ThrottleError on entry (or from :meth:`group`) where the
    controller is missing or not writable (:func:`check_controller`).
    """

    def __init__(
        self, prefix: str = "ptbench-thr", root: Path = CPU_ROOT, period_us: int = PERIOD_US
    ) -> None:
        self.prefix = prefix
        self.root = Path(root)
        self.period_us = period_us
        self.groups: dict[str, CpuGroup] = {}
        self._sigterm: Any = None

    def __enter__(self) -> Throttle:
        check_controller(self.root)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (a timeout, a supervisor) ends the benchmark through __exit__ too.
            self._sigterm = signal.signal(signal.SIGTERM, _terminate)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def group(self, name: str, fraction: float | None, core: int | None) -> CpuGroup:
        """A new group ``<prefix>-<name>`` at ``fraction`` of one core, pinned to ``core``.

        A leftover group of that name (from a killed run) is reused. Raises ValueError
        for a name taken in this Throttle, ThrottleError if the cgroup cannot be made.
        """
        if name in self.groups:
            raise ValueError(f"group {name!r} exists already")
        check_controller(self.root)
        path = self.root / f"{self.prefix}-{name}"
        try:
            path.mkdir(exist_ok=True)
        except OSError as err:
            raise ThrottleError(f"cannot make cgroup {path}: {err}") from err
        try:
            if not (path / "cpu.cfs_quota_us").is_file():  # the kernel fills a new cgroup
                raise ThrottleError(f"{self.root} is not a cgroup hierarchy: {path} stays empty")
            group = CpuGroup(path, fraction, core, self.period_us)
        except BaseException:
            _remove(path, self.root)
            raise
        self.groups[name] = group
        return group

    def fast_and_slow(self, slow_fraction: float) -> dict[str, CpuGroup]:
        """The heterogeneity benchmarks' pair: ``{"fast": FAST_CORE with no quota, "slow":
        SLOW_CORE at ``slow_fraction`` of it}``."""
        return {
            "fast": self.group("fast", fraction=None, core=FAST_CORE),
            "slow": self.group("slow", fraction=slow_fraction, core=SLOW_CORE),
        }

    def close(self) -> None:
        """Move every process back to the root group and remove every group made here.

        Raises ThrottleError if a group cannot be removed (the others are removed first).
        """
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        failed = []
        for name in list(self.groups):
            group = self.groups.pop(name)
            try:
                _remove(group.path, self.root)
            except ThrottleError as err:
                failed.append(str(err))
        if failed:
            raise ThrottleError("; ".join(failed))


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _remove(path: Path, root: Path) -> None:
    """Move the processes of cgroup ``path`` to ``root`` and remove it (ThrottleError if not)."""
    if not path.exists():
        return
    if not (path / "cgroup.procs").is_file():  # not a cgroup: a directory made by mistake
        path.rmdir()
        return
    for _ in range(10):  # a process may fork while we move its siblings
        pids = (path / "cgroup.procs").read_text().split()
        if not pids:
            break
        for pid in pids:
            try:
                (root / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass  # exited meanwhile
            except OSError as err:
                raise ThrottleError(f"cannot move {pid} out of {path}: {err}") from err
    try:
        path.rmdir()
    except OSError as err:
        raise ThrottleError(f"cannot remove cgroup {path}: {err}") from err


def place_ranks(groups: dict[int, CpuGroup], pids: dict[int, int]) -> None:
    """Put each rank's process in its group: ``groups[rank]``; ranks without one stay put.

    For :func:`worker.engine.local.launch_local`'s ``on_spawn``: called right after
    the ranks start, before they import torch. Raises ThrottleError if a rank is gone.
    """
    for rank, pid in pids.items():
        if rank in groups:
            groups[rank].place(pid)


def placement(
    groups: list[dict[str, Any]], cpu: dict[str, CpuGroup]
) -> Callable[[dict[int, int]], None]:
    """An ``on_spawn`` for a task on ``groups`` (RunSpec group dicts, in rank order): each
    compute rank goes to ``cpu[<its group's name>]``; rank 0 (the parameter server) and the
    ranks of groups not in ``cpu`` stay where they are."""
    ranks: dict[int, CpuGroup] = {}
    rank = 1
    for plan in groups:
        for _ in range(plan.get("workers", 1)):
            if plan["name"] in cpu:
                ranks[rank] = cpu[plan["name"]]
            rank += 1
    return lambda pids: place_ranks(ranks, pids)


def cores_needed(cores: Iterable[int]) -> None:
    """Raise ThrottleError unless this process may use every core in ``cores``."""
    missing = set(cores) - os.sched_getaffinity(0)
    if missing:
        raise ThrottleError(f"cores {sorted(missing)} not available here")


def exit_unavailable(err: ThrottleError, benchmark: str) -> NoReturn:
    """Print why ``benchmark`` cannot throttle and exit with status 2 (no silent fallback)."""
    print(
        f"{benchmark}: real CPU throttling unavailable: {err}. This benchmark measures real, "
        "throttled compute and has no emulated fallback; run it as root on a host with the "
        "cgroup v1 cpu controller at /sys/fs/cgroup/cpu.",
        file=sys.stderr,
    )
    sys.exit(2)
