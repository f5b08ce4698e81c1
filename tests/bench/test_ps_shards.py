"""bench.ps_shards: the JSON line reads each arm's median and the paired ratios right, and a
short real run of every arm over real gloo processes gives one line with every figure."""

from __future__ import annotations

import json
import sys

import pytest

from bench import ps_shards
from bench.comm_scaling import MB


def test_the_line_gives_medians_and_paired_ratios_per_size() -> None:
    small, large = 16 * MB, 64 * MB
    by_size = {
        small: {
            "ps_round_s1": [0.020, 0.030, 0.040],
            "ps_round_s2": [0.010, 0.030, 0.020],
            "allreduce_ring": [0.010, 0.010, 0.010],
            "allreduce_gloo": [0.020, 0.020, 0.020],
        },
        large: {
            "ps_round_s1": [0.100, 0.200, 0.400],
            "ps_round_s2": [0.050, 0.100, 0.300],
            "allreduce_ring": [0.100, 0.100, 0.100],
            "allreduce_gloo": [0.100, 0.100, 0.100],
        },
    }
    line = ps_shards.report(2, [1, 2], by_size, 12.0)
    assert line["benchmark"] == "ps_round"
    # value: the paired ratios 0.5, 0.5, 0.75 at 64 MB -> median 0.5
    assert line["value"] == 0.5
    assert line["ratio_to_one_shard"]["64MB"]["s2"]["values"] == [0.5, 0.5, 0.75]
    assert line["ratio_to_one_shard"]["16MB"]["s2"]["values"] == [0.5, 1.0, 0.5]
    assert line["ratio_to_allreduce_ring"]["16MB"]["s1"]["median"] == 3.0
    assert line["median_ms"]["64MB"] == {
        "ps_round_s1": 200.0,
        "ps_round_s2": 100.0,
        "allreduce_ring": 100.0,
        "allreduce_gloo": 100.0,
    }
    assert line["processes"] == 4


def test_a_short_run_measures_every_arm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "ps_shards",
        "--groups",
        "2",
        "--shards",
        "1",
        "2",
        "--sizes-mb",
        "0.25",
        "--rounds",
        "1",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    ps_shards.main()
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line["median_ms"]["0.25MB"]) == {
        "ps_round_s1",
        "ps_round_s2",
        "allreduce_ring",
        "allreduce_gloo",
    }
    assert all(ms > 0 for ms in line["median_ms"]["0.25MB"].values())
    assert line["shards"] == [1, 2] and line["groups"] == 2


def test_bad_counts_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["ps_shards", "--shards", "0"])
    with pytest.raises(SystemExit):
        ps_shards.main()
