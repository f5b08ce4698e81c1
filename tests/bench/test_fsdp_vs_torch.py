"""bench.fsdp_vs_torch: the engine's step time read as bench.engine_vs_ddp reads it, and the
lines of a tiny run (one round: the engine and plain FSDP2 side by side)."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from bench import fsdp_vs_torch
from bench.common import cores
from bench.fsdp_vs_torch import engine_step_s, steps_for
from bench.workloads import deep_mlp
from worker.engine.local import LocalRun
from worker.engine.ranks import jemalloc_path


def _epoch_time(value: float | None, rank: int = 0) -> dict[str, object]:
    return {"type": "metric", "name": "epoch_time_s", "value": value, "rank": rank}


def test_engine_step_time_is_each_later_epochs_time_over_its_steps() -> None:
    events = [_epoch_time(9.0), _epoch_time(5.0, rank=1), _epoch_time(1.6), _epoch_time(None)]
    run = LocalRun(pids={0: 1}, returncodes={0: 0}, output={0: []}, wall_s=1.0, events=events)
    # the first epoch warms up; a worker's metric and a non-finite value count for nothing
    assert engine_step_s(run, 8) == [pytest.approx(0.2)]


def test_steps_per_epoch_and_sizes() -> None:
    assert steps_for(deep_mlp.width("1M")) == 32 and steps_for(deep_mlp.width("10M")) == 8
    assert deep_mlp.label("10M") == "10M" and deep_mlp.label("64") == "0.046M"


@pytest.mark.skipif(cores() < 2, reason="each compute process is pinned to a core of its own")
def test_a_tiny_run_gives_one_line_per_size_and_the_summary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["fsdp_vs_torch", "--rounds", "1", "--sizes", "64"])
    fsdp_vs_torch.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["benchmark"] for line in lines] == [
        "fsdp_vs_torch_step_ratio_0.046M",
        "fsdp_vs_torch_step_ratio",
    ]
    size, total = lines
    assert size["parameters"] == deep_mlp.parameters(64) and size["target"] == "<= 1.10"
    steps = size["step_ms"]
    # the engine on jemalloc too, where the host has it (POLYTRAIN_JEMALLOC=on for that arm)
    has_jemalloc = jemalloc_path({"POLYTRAIN_JEMALLOC": "on"}) is not None
    arms = {"torch", "torch_mmap", "engine"} | ({"engine_jemalloc"} if has_jemalloc else set())
    assert set(steps) == arms and all(len(v) == 1 and v[0] > 0 for v in steps.values())
    if has_jemalloc:
        on_jemalloc = steps["engine_jemalloc"][0] / steps["torch"][0]
        assert size["ratio_jemalloc"] == pytest.approx(on_jemalloc, rel=0.02)
    else:
        assert "ratio_jemalloc" not in size
    engine, plain = steps["engine"][0], steps["torch"][0]
    # step_ms is rounded to 0.01 ms, the ratio to 1e-4: within both roundings
    slack = engine / plain * (0.005 / engine + 0.005 / plain) + 1e-4
    assert size["ratios"] == [pytest.approx(engine / plain, abs=slack)]
    assert size["value"] == pytest.approx(statistics.median(size["ratios"]))
    same = steps["engine"][0] / steps["torch_mmap"][0]
    assert size["ratio_same_allocator"] == pytest.approx(same, rel=0.02)
    assert size["ci95"] == [size["value"], size["value"]]  # one round: no interval
    assert total["value"] == size["value"] and total["sizes"] == ["0.046M"]
