"""bench.throttle: real CPU cgroups (v1 cpu controller), core pinning, cleanup, errors.

The cgroup tests need root and the v1 cpu hierarchy at /sys/fs/cgroup/cpu (skipped
otherwise); nothing here asserts on wall time: throttling is checked in the kernel's own
accounting (``cpu.stat``, the process's CPU time against the quota's bound).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.throttle import (
    CPU_ROOT,
    PERIOD_US,
    Throttle,
    ThrottleError,
    affinity,
    check_controller,
    place_ranks,
)

PREFIX = f"ptbench-thr-test{os.getpid()}"


def _controller_usable() -> bool:
    try:
        check_controller()
    except ThrottleError:
        return False
    return True


needs_cgroup = pytest.mark.skipif(
    not _controller_usable(), reason="needs root and the cgroup v1 cpu controller"
)

# A busy loop that starts a thread (threads share the cgroup) and then a child process
# (children inherit cgroup and affinity): prints the child's pid, then spins.
BUSY = """
import os, subprocess, sys, threading
threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
input()  # wait until placed
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print(child.pid, flush=True)
while True: pass
"""


def _ours() -> list[str]:
    return [p.name for p in CPU_ROOT.iterdir() if p.name.startswith(PREFIX)]


@needs_cgroup
def test_a_throttled_process_gets_its_quota_on_its_core_and_everything_is_removed() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        with Throttle(prefix=PREFIX) as throttle:
            group = throttle.group("slow", fraction=0.2, core=0)
            assert group.quota_us == round(0.2 * PERIOD_US)
            place_ranks({1: group}, {0: os.getpid(), 1: proc.pid})  # rank 0 stays put
            assert proc.pid in group.pids() and os.getpid() not in group.pids()
            assert affinity(proc.pid) == {0}
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
            child = int(proc.stdout.readline())
            assert child in group.pids() and affinity(child) == {0}  # inherited
            cpu = psutil.Process(proc.pid)
            before, started = sum(cpu.cpu_times()[:2]), time.monotonic()
            time.sleep(1.0)
            used = sum(cpu.cpu_times()[:2]) - before
            elapsed = time.monotonic() - started
            stat = group.stat()
            assert stat["nr_throttled"] > 0 and stat["throttled_time"] > 0
            # Two spinning threads and a child share 20 % of one core: at most its
            # quota over the periods elapsed (plus one period of slack), not 2 cores.
            assert used <= 0.2 * (elapsed + 0.2)
            group.set_fraction(0.5)  # while it runs
            assert group.quota_us == round(0.5 * PERIOD_US)
            assert _ours() == [f"{PREFIX}-slow"]
        assert _ours() == []  # removed, the processes moved back to the root group
        assert str(proc.pid) in (CPU_ROOT / "cgroup.procs").read_text().split()
    finally:
        for p in psutil.Process(proc.pid).children() + [psutil.Process(proc.pid)]:
            p.kill()
        proc.wait()


@needs_cgroup
def test_groups_are_removed_on_an_exception() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(KeyboardInterrupt), Throttle(prefix=PREFIX) as throttle:
            throttle.group("a", fraction=None, core=None).place(proc.pid)
            throttle.group("b", fraction=0.5, core=1)
            raise KeyboardInterrupt
        assert _ours() == []
    finally:
        proc.kill()
        proc.wait()


def test_a_missing_unwritable_or_fake_controller_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ThrottleError, match="no cgroup v1 cpu controller"):
        Throttle(prefix=PREFIX, root=tmp_path / "absent").__enter__()
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")  # looks like one, is a plain directory
    with pytest.raises(ThrottleError, match="not a cgroup hierarchy"):
        with Throttle(prefix=PREFIX, root=tmp_path) as throttle:
            throttle.group("x", fraction=0.5, core=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.cfs_quota_us"]
    if os.geteuid() != 0 and CPU_ROOT.is_dir():
        with pytest.raises(ThrottleError, match="not writable"):
            Throttle(prefix=PREFIX).__enter__()


def test_a_benchmark_without_the_controller_exits_non_zero() -> None:
    script = (
        "from pathlib import Path\n"
        "from bench.throttle import Throttle, ThrottleError, exit_unavailable\n"
        "try:\n"
        "    Throttle(root=Path('/nonexistent/cpu')).__enter__()\n"
        "except ThrottleError as err:\n"
        "    exit_unavailable(err, 'bench.x')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2
    assert "real CPU throttling unavailable" in done.stderr and "/nonexistent/cpu" in done.stderr


def _cpu_cgroup(pid: int) -> str:
    """The cpu-controller cgroup of ``pid`` from /proc/<pid>/cgroup ("/..." path)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise AssertionError(f"no cpu cgroup for {pid}")


@needs_cgroup
def test_launch_local_places_a_rank_and_its_dataloader_processes(tmp_path: Path) -> None:
    from worker.engine.local import launch_local
    from worker.engine.spec import RunSpec

    spec = RunSpec.model_validate(
        {
            "task_id": 0,
            "code": "example:tiny_regression",
            # Stopped at the first progress event: an epoch or two on a fast host ended before
            # that event was read, and its processes with it.
            "epochs": 1000,
            "global_batch_size": 16,
            "groups": [{"name": "g", "device_type": "cpu", "workers": 1}],
            "data": {"path": "streaming", "num_workers": 1},
            "checkpoint_dir": str(tmp_path / "ck"),
        }
    )
    seen: dict[int, tuple[str, set[int]]] = {}  # process -> (cpu cgroup, cores) during the run
    pids: dict[int, int] = {}
    with Throttle(prefix=PREFIX) as throttle:
        group = throttle.group("rank", fraction=None, core=1)

        def on_spawn(started: dict[int, int]) -> None:
            pids.update(started)
            place_ranks({1: group}, started)

        def observe(event: dict) -> bool:
            if event["type"] == "progress" and not seen:
                rank = psutil.Process(pids[1])
                for proc in [rank, *rank.children(recursive=True)]:
                    seen[proc.pid] = (_cpu_cgroup(proc.pid), affinity(proc.pid))
                seen[pids[0]] = (_cpu_cgroup(pids[0]), affinity(pids[0]))
            return bool(seen)  # seen: stop the run

        run = launch_local(spec, timeout_s=60, on_spawn=on_spawn, stop_when=observe)
    assert run.stopped, run.text(1)
    loaders = set(seen) - {pids[0], pids[1]}
    assert loaders, "no DataLoader process seen"
    for pid in [pids[1], *loaders]:
        assert seen[pid] == (f"/{PREFIX}-rank", {1}), pid
    assert seen[pids[0]][0] != f"/{PREFIX}-rank"  # the parameter server stays put
    assert _ours() == []


@needs_cgroup
def test_sigterm_removes_the_groups() -> None:
    script = (
        "import time\n"
        "from bench.throttle import Throttle\n"
        f"with Throttle(prefix={PREFIX!r}) as throttle:\n"
        "    throttle.group('term', fraction=0.5, core=0)\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(30)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    assert _ours() == [f"{PREFIX}-term"]
    proc.terminate()
    assert proc.wait(timeout=10) == 128 + 15
    assert _ours() == []
