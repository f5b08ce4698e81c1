"""worker.engine.distributed.Arrivals: the parameter server takes messages from its links to
several workers in the order they arrive (quorum's reports, diloco's asynchronous rounds),
each link a two-rank gloo group, and a worker that is gone fails the taking, not a hang.

Real gloo process groups in fresh processes; the order of the messages is set by the test
(a worker sends only once the server has taken the other's), not by timing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.worker.engine.reference import run_ranks
from worker.engine.distributed import Arrivals, Topology

TAG = 7


def _rank(rank: int, init: str, out: str) -> None:
    from datetime import timedelta

    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=3, timeout=timeout)
    links = {peer: dist.new_group([0, peer], backend="gloo") for peer in (1, 2)}
    topo = Topology(
        rank=rank,
        world_size=3,
        n_workers=2,
        group_index=None if rank == 0 else rank - 1,
        group=None,
        group_ranks=() if rank == 0 else (rank,),
        device=torch.device("cpu"),
        links={peer: link for peer, link in links.items() if rank in (0, peer)},
        timeout=timeout,
    )
    token = torch.zeros(1)
    if rank == 0:
        arrivals = Arrivals(topo, TAG)
        refused = []
        try:
            arrivals.take()
        except RuntimeError as exc:
            refused.append(str(exc))
        for peer in (1, 2):
            arrivals.expect(peer, torch.zeros(3))
        try:
            arrivals.expect(1, torch.zeros(3))
        except RuntimeError as exc:
            refused.append(str(exc))
        first, first_values = arrivals.take()
        dist.send(token, dst=1, group=topo.link(1))  # rank 1 sends only now
        second, second_values = arrivals.take()
        arrivals.expect(2, torch.zeros(3))
        dist.send(token, dst=2, group=topo.link(2))  # rank 2 leaves without sending
        try:
            arrivals.take()
            failed = ""
        except Exception as exc:  # noqa: BLE001 (what the test records)
            failed = type(exc).__name__
        record = {
            "order": [first, second],
            "values": [first_values.tolist(), second_values.tolist()],
            "refused": refused,
            "failed": failed,
        }
        Path(out).write_text(json.dumps(record))
    elif rank == 1:
        dist.recv(token, src=0, group=topo.link(0))
        dist.send(torch.full((3,), 1.0), dst=0, group=topo.link(0), tag=TAG)
    else:
        dist.send(torch.full((3,), 2.0), dst=0, group=topo.link(0), tag=TAG)
        dist.recv(token, src=0, group=topo.link(0))
    os._exit(0)  # no teardown: rank 0's last receive has failed on purpose


def test_messages_are_taken_in_arrival_order_and_a_gone_worker_fails_the_take(
    tmp_path: Path,
) -> None:
    out = tmp_path / "record.json"
    assert run_ranks(_rank, 3, f"file://{tmp_path / 'store'}", str(out)) == [0, 0, 0]
    record = json.loads(out.read_text())
    assert record["order"] == [2, 1]
    assert record["values"] == [[2.0] * 3, [1.0] * 3]
    assert record["refused"] == [
        "no message is expected",
        "a message from rank 1 is already expected",
    ]
    assert record["failed"], "a receive from a worker that exited must fail, not wait"
