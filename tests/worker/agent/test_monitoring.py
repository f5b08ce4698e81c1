"""The agent's resource samples of its ranks (psutil), as its heartbeats carry them."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from contracts.agent_api import Heartbeat
from worker.agent.monitoring import GpuProbe, ResourceSampler
from worker.agent.processes import ProcessSet, RunningRegistry

# Holds ~50 MiB of touched memory and keeps one core busy until killed.
HOG = "import time\nblock = bytearray(50 * 1024 * 1024)\nwhile True:\n    sum(range(10000))\n"


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
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        proc.kill()
        proc.wait()


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
