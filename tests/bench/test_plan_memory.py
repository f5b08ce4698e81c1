"""bench.plan_memory: a process's peak data memory read from /proc as the trial reads its own,
and the line of a tiny run (the plan's prediction and the task's peak for both arms)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import plan_memory
from bench.workloads import deep_mlp
from worker.engine import memory


def test_the_data_peak_of_a_live_process_and_none_once_it_is_gone() -> None:
    own = plan_memory.data_peak_kib(os.getpid())
    kib = memory.status_kib()
    assert own is not None and kib is not None
    assert own >= kib["VmData"]  # the data memory now, plus the resident peak's rise above now
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert plan_memory.data_peak_kib(proc.pid) is None


def test_a_tiny_run_predicts_and_measures_both_arms(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["plan_memory", "--size", "64"])
    plan_memory.main()
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert line["benchmark"] == "plan_memory_error"
    assert line["parameters"] == deep_mlp.parameters(64)
    for arm in ("none", "fsdp"):
        predicted, measured = line["predicted_mib"][arm], line["measured_mib"][arm]
        assert predicted > 0 and measured > 0
        assert line["errors"][arm] == pytest.approx(predicted / measured - 1, abs=1e-3)
    assert line["value"] == line["errors"][line["worst_arm"]]
    assert line["met"] == all(0 <= e <= 0.2 for e in line["errors"].values())
