"""Event lines on stdout and the cluster environment read from variables."""

from __future__ import annotations

import math

import pytest

from worker.engine import report
from worker.engine.distributed import ClusterEnv


def test_events_round_trip_through_parse_event(capsys: pytest.CaptureFixture[str]) -> None:
    report.metric("val_loss", 0.25, step=10, epoch=1, rank=0)
    report.metric("train_loss", math.nan, step=10, epoch=1, rank=0)
    report.metric("grad_norm", -math.inf, step=10, epoch=1, rank=2)
    report.checkpoint("/c/epoch-1.pt", step=10, epoch=1)
    report.progress(epoch=1, step=10, steps_per_epoch=5, epochs=3)
    report.done()
    report.log("an ordinary log line")
    lines = capsys.readouterr().out.splitlines()
    events = [report.parse_event(line) for line in lines]
    assert events == [
        {"type": "metric", "name": "val_loss", "value": 0.25, "step": 10, "epoch": 1, "rank": 0},
        {
            "type": "metric",
            "name": "train_loss",
            "value": None,
            "step": 10,
            "epoch": 1,
            "rank": 0,
            "nonfinite": "nan",
        },
        {
            "type": "metric",
            "name": "grad_norm",
            "value": None,
            "step": 10,
            "epoch": 1,
            "rank": 2,
            "nonfinite": "-inf",
        },
        {"type": "checkpoint", "path": "/c/epoch-1.pt", "step": 10, "epoch": 1},
        {"type": "progress", "epoch": 1, "step": 10, "steps_per_epoch": 5, "epochs": 3},
        {"type": "done"},
        None,
    ]


@pytest.mark.parametrize(
    "line",
    [
        "",
        "@@polytrain",
        "@@polytrain {bad json",
        "@@polytrain [1]",
        '@@polytrain {"no_type": 1}',
        'x @@polytrain {"type":"done"}',
    ],
)
def test_malformed_event_lines_are_log_lines(line: str) -> None:
    assert report.parse_event(line) is None


@pytest.mark.parametrize(
    ("line", "port"),
    [
        ('@@polytrain {"type": "rendezvous", "port": 29500}', 29500),
        ('@@polytrain {"type": "rendezvous", "port": 0}', None),
        ('@@polytrain {"type": "rendezvous", "port": 65536}', None),
        ('@@polytrain {"type": "rendezvous", "port": "29500"}', None),
        ('@@polytrain {"type": "rendezvous", "port": true}', None),
        ('@@polytrain {"type": "rendezvous"}', None),
        ('@@polytrain {"type": "done", "port": 29500}', None),
        ("rendezvous at 29500", None),
    ],
)
def test_only_a_rendezvous_event_with_a_tcp_port_gives_the_port(
    line: str, port: int | None
) -> None:
    # Rank 0 runs the user's code: a line it prints must not set where the others connect.
    assert report.rendezvous_port(line) == port


def test_cluster_env_from_variables() -> None:
    env = ClusterEnv.from_env(
        {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    )
    assert env == ClusterEnv(rank=2, world_size=4, master_addr="h", master_port=29500)
    with pytest.raises(KeyError, match="MASTER_PORT"):
        ClusterEnv.from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"})
