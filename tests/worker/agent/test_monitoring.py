"""The agent's resource samples of its ranks (psutil), as its heartbeats carry them."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from contracts.agent_api import Heartbeat
from worker.agent.monitoring import MIB, GpuProbe, K, ResourceSampler
from worker.agent.processes import ProcessSet, RunningRegistry
from worker.agent.sandbox import Sandbox, rank_environment

# Holds ~50 MiB of touched memory and keeps one core busy until killed.
HOG = "import time\nblock = bytearray(50 * 1024 * 1024)\nwhile True:\n    sum(range(10000))\n"


def kill_tree(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and every process under it, wherever they are: a sandbox may start the
    interpreter in a session of its own (`bwrap --new-session`), which a kill of the
    parent, its process group or its session does not reach; a hog left behind holds a
    core for the rest of the suite."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.kill()
    proc.wait()
    psutil.wait_procs(children, timeout=10)


@pytest.fixture
def rank() -> Iterator[subprocess.Popen[str]]:
    """A rank as the sandbox starts one: a parent (`sh`, like `bwrap`) whose child is the
    interpreter that uses the memory."""
    script = f"{sys.executable} -c '{HOG}'; true"
    proc = subprocess.Popen(
        ["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        yield proc
    finally:
        kill_tree(proc)


def _sampler() -> ResourceSampler:
    return ResourceSampler(every_s=0, gpus=GpuProbe())


def _until_rss(sampler: ResourceSampler, pid: int, mb: float) -> dict[str, float | None]:
    deadline = time.monotonic() + 20
    while True:
        found = sampler.sample({"r": pid})["r"]
        if found["rss_mb"] is not None and found["rss_mb"] > mb or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_rank_s_process_tree_is_measured(rank: subprocess.Popen[str]) -> None:
    sampler = _sampler()
    first = _until_rss(sampler, rank.pid, 40)
    assert first["rss_mb"] is not None and first["rss_mb"] > 40  # the child's memory counts
    time.sleep(0.5)
    again = sampler.sample({"r": rank.pid})["r"]
    assert again["cpu_percent"] is not None and again["cpu_percent"] > 1  # since the last one
    assert again["gpu_util"] is None and again["gpu_mem_mb"] is None  # no GPU here


def test_a_process_that_is_gone_is_left_out() -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert _sampler().sample({"r": ended.pid}) == {}


def test_heartbeat_samples_are_due_every_interval_and_fit_the_contract(
    rank: subprocess.Popen[str],
) -> None:
    _until_rss(_sampler(), rank.pid, 40)  # a process just started may show no memory yet
    registry, procs = RunningRegistry(), ProcessSet()
    procs.add(1, rank)
    registry.add(9, procs)
    sampler = ResourceSampler(every_s=3600, gpus=GpuProbe())
    first = Heartbeat.model_validate({"running": registry.snapshot(sampler)})
    [entry] = first.running
    assert (entry.task_id, entry.ranks, [s.rank for s in entry.samples]) == (9, [1], [1])
    assert entry.samples[0].rss_mb > 40
    assert registry.snapshot(sampler) == [{"task_id": 9, "ranks": [1]}]  # not due yet
    assert registry.snapshot() == [{"task_id": 9, "ranks": [1]}]  # no sampler: no samples


def test_a_sandboxed_rank_is_measured_across_its_uid(tmp_path: Path) -> None:
    """The rank runs as a sandbox uid under `bwrap` (two of them, then the interpreter)."""
    sandbox = Sandbox.detect(user="polytrain-run", data_dir=tmp_path)
    lease = sandbox.pool.lease()
    rank_dir = sandbox.new_rank_dir(lease.uid)
    proc = subprocess.Popen(
        sandbox.command(rank_dir, ["-c", HOG], lease.uid),
        env=rank_environment({}, rank_dir),
        start_new_session=True,
    )
    try:
        sampler = _sampler()
        assert (_until_rss(sampler, proc.pid, 40)["rss_mb"] or 0) > 40
        time.sleep(0.5)
        assert (sampler.sample({"r": proc.pid})["r"]["cpu_percent"] or 0) > 1
    finally:
        kill_tree(proc)
        lease.release()


class FakeNvml:
    """Two GPUs; the rank's interpreter (pid 11) uses the second."""

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 (NVML's names)
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, device: int) -> list[SimpleNamespace]:  # noqa: N802
        if device == 0:
            return [SimpleNamespace(pid=99, usedGpuMemory=8 * MIB)]
        return [SimpleNamespace(pid=11, usedGpuMemory=512 * MIB)]

    def nvmlDeviceGetUtilizationRates(self, device: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=[5, 73][device])


def test_gpu_use_is_that_of_the_devices_the_rank_s_processes_hold() -> None:
    probe = GpuProbe(FakeNvml())
    assert probe.usage({10, 11}) == (73.0, 512.0)
    assert probe.usage({12}) == (None, None)  # on no GPU
    assert GpuProbe().usage({11}) == (None, None)  # no NVML


class BrokenSampler(ResourceSampler):
    def sample(self, pids: Mapping[K, int]) -> dict[K, dict[str, float | None]]:
        raise RuntimeError("no /proc")


def test_a_failed_measurement_still_beats(rank: subprocess.Popen[str]) -> None:
    registry, procs = RunningRegistry(), ProcessSet()
    procs.add(1, rank)
    registry.add(9, procs)
    sampler = BrokenSampler(every_s=0, gpus=GpuProbe())
    assert registry.snapshot(sampler) == [{"task_id": 9, "ranks": [1]}]
