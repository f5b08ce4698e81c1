"""bench.sharded_memory: a rank's peak resident set read from /proc, the per-size figures
(the larger worker's peak, never the parameter server's), and the lines of a tiny run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from bench import sharded_memory
from bench.sharded_memory import PeakWatch, peak_kib, size_figures
from bench.workloads import deep_mlp

# A child that touches 256 MiB, says so, and exits when its stdin closes.
HOLDER = (
    "import sys; block = bytearray(256 * 2**20); block[::4096] = b'x' * len(block[::4096]); "
    "print('ready', flush=True); sys.stdin.read()"
)


def test_the_peak_of_a_live_process_and_none_once_it_is_gone() -> None:
    assert (peak_kib(os.getpid()) or 0) > 1024
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert peak_kib(proc.pid) is None


def test_the_watch_keeps_a_ranks_peak_after_it_exits() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    watch = PeakWatch()
    watch({0: proc.pid})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while watch.kib.get(0, 0) < 256 * 1024 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.communicate()  # closes stdin: the child exits; its peak stays with the watch
    assert watch.mib(1)[0] >= 256
    with pytest.raises(RuntimeError, match=r"no peak read for ranks \[1\]"):
        watch.mib(2)
    with pytest.raises(RuntimeError, match="never started"):
        PeakWatch().mib(1)


def test_figures_take_the_larger_worker_and_leave_the_server_apart() -> None:
    peaks = {
        "none": {0: 2000.0, 1: 1100.0, 2: 1000.0},
        "fsdp": {0: 1500.0, 1: 700.0, 2: 720.0},
    }
    found = size_figures(25_000_000, peaks, {"none": 300.0, "fsdp": 320.0})
    assert found["ratio"] == pytest.approx(720 / 1100)
    assert found["ratio_above_baseline"] == pytest.approx((720 - 320) / (1100 - 300), abs=1e-4)
    assert found["peak_mib"] == {"none": 1100.0, "fsdp": 720.0}
    assert found["worker_peak_mib"] == {"none": [1100.0, 1000.0], "fsdp": [700.0, 720.0]}
    assert found["server_peak_mib"] == {"none": 2000.0, "fsdp": 1500.0}
    assert found["state_mib"] == pytest.approx(25e6 * 16 / 2**20, abs=0.1)


@pytest.mark.parametrize("size", sorted(deep_mlp.WIDTHS))
def test_each_size_is_what_its_label_says_and_each_hidden_layer_is_a_unit(
    size: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.engine.fsdp import size_units

    monkeypatch.setenv("POLYTRAIN_BENCH_HIDDEN", str(deep_mlp.WIDTHS[size]))
    with torch.device("meta"):  # no memory for the 100M model
        model = deep_mlp.build_model()
    params = sum(p.numel() for p in model.parameters())
    assert params == deep_mlp.parameters(deep_mlp.width(size))
    assert params == pytest.approx(float(size.removesuffix("M")) * 1e6, rel=0.01)
    hidden = [m for m in list(model.children())[2:-1] if isinstance(m, torch.nn.Linear)]
    assert len(hidden) == deep_mlp.LAYERS
    assert all(any(layer is unit for unit in size_units(model)) for layer in hidden)


def test_a_tiny_run_gives_one_line_per_size_and_the_summary(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["sharded_memory", "--sizes", "64"])
    sharded_memory.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["benchmark"] for line in lines] == [
        "sharded_memory_ratio_0.046M",
        "sharded_memory_ratio",
    ]
    size, total = lines
    assert size["parameters"] == deep_mlp.parameters(64) and size["target"] == "<= 0.6"
    peaks = size["peak_mib"]
    assert size["value"] == pytest.approx(peaks["fsdp"] / peaks["none"], abs=1e-3)
    for arm in ("none", "fsdp"):
        assert len(size["worker_peak_mib"][arm]) == 2
        assert peaks[arm] == max(size["worker_peak_mib"][arm]) > 0
        assert size["server_peak_mib"][arm] > 0 and size["baseline_mib"][arm] > 0
    assert size["torch_fsdp_peak_mib"] > 0
    assert total["value"] == size["value"] and total["sizes"] == ["0.046M"]
