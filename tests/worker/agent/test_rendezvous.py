"""Rank 0 hosts the rendezvous store on a port it binds itself (no window to take it first)."""

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from worker.engine.distributed import ClusterEnv, rendezvous_store
from worker.engine.report import parse_event


def test_rank_0_binds_a_port_the_kernel_picks_and_reports_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = ClusterEnv(rank=0, world_size=2, master_addr="127.0.0.1", master_port=0)
    store = rendezvous_store(env, timedelta(seconds=10))
    events = [parse_event(line) for line in capsys.readouterr().out.splitlines()]
    assert events == [{"type": "rendezvous", "port": store.port}]
    assert store.port > 0
    with socket.socket() as squatter, pytest.raises(OSError):  # already bound by the store
        squatter.bind(("", store.port))
    peer = rendezvous_store(
        ClusterEnv(rank=1, world_size=2, master_addr="127.0.0.1", master_port=store.port),
        timedelta(seconds=10),
    )
    peer.set("hello", "world")
    assert store.get("hello") == b"world"
    assert capsys.readouterr().out == ""  # only rank 0 with port 0 reports
    assert isinstance(peer, dist.TCPStore)
