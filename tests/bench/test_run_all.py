"""bench.run_all: a benchmark that leaves a process behind still ends the run, and the process
is killed (`make bench` once waited for good on a plain DDP rank orphaned at its rendezvous)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from bench.run_all import BENCHMARKS, MORE, ROOT, selection

DRIVER = """
import json
from bench import run_all
run_all._adopt_orphans()
lines, ok = run_all.run("tests.bench.leaves_a_rank")
print(json.dumps({"lines": lines, "ok": ok}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the subreaper is Linux's prctl")
def test_a_benchmark_that_leaves_a_process_behind_ends_and_the_process_is_killed() -> None:
    # In a fresh interpreter: adopting orphans would change this test process for good.
    # The timeout bounds a hung run (the left process sleeps 600 s); it is no speed expected.
    done = subprocess.run(
        [sys.executable, "-c", DRIVER],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] is True
    [line] = result["lines"]
    assert line["benchmark"] == "leaves_a_rank" and line["seconds"] >= 0
    assert "killed the processes it left running" in done.stderr
    assert not psutil.pid_exists(line["value"])  # killed (its 600 s sleep cut short)


def test_bench_all_runs_each_full_benchmark_once_in_place_of_its_shortened_run() -> None:
    everything = selection(everything=True)
    assert selection(everything=False) == BENCHMARKS
    assert "bench.hetero_real --rounds 2 --strategies sync_guarded,diloco_overlapped" in BENCHMARKS
    assert "bench.hetero_real" in everything
    assert not any(m.startswith("bench.hetero_real ") for m in everything)  # the full run only
    assert everything.count("bench.rebalance_tracking") == 1
    # runs of one module with other options stay (the environment and the cold start)
    assert "bench.submit_to_first_step --only environment" in everything
    assert set(MORE) <= set(everything)
