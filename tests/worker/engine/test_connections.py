"""A task's TCP connections grow with its groups, not with its world (issue 37 item 3).

The world group carries nothing and, made with gloo's lazy connections, opens none; every
message goes through a resource group, a link between the parameter server and a group
leader, or under sync a link between neighbouring leaders of a ring
(worker/engine/distributed.py, "Process groups"). So a task holds Σ W_g (W_g − 1) / 2 + G
connections (issue 37's bound), and G more under sync (the ring; 1 for two groups). The
test's training code records, from every compute worker,
its established TCP connections during the last epoch's validation (by then every collective
of an epoch, its end and its checkpoint has run twice); the connections to the rendezvous
store (one a rank) are left out. Before, the same task held 69 connections (every process
group a full mesh, the world's 28 among them); then 20 (a leaders' group of the server and
every leader, a full mesh too); then 14 under sync (the leaders a full mesh among
themselves, G (G − 1) / 2 = 6); now 8 under diloco and 12 under sync.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import combinations
from pathlib import Path

import pytest

from tests.worker.engine.reference import run_with_dump
from worker.engine.spec import RunSpec

RECORDS_CONNECTIONS = """
import json, os
import psutil
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn

def metrics(output, target):
    sockets = [
        [list(c.laddr), list(c.raddr)]
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr
    ]
    record = {"rank": int(os.environ["RANK"]), "store": int(os.environ["MASTER_PORT"]),
              "sockets": sockets}
    with open(os.path.join(FOLDER, f"rank-{record['rank']}.json"), "w") as out:
        json.dump(record, out)
    return {}
"""

GROUPS = [
    {"name": "a", "device_type": "cpu", "workers": 3},
    {"name": "b", "device_type": "cpu", "workers": 2},
    {"name": "c", "device_type": "cpu", "workers": 1},
    {"name": "d", "device_type": "cpu", "workers": 1},
]


def connections(folder: Path) -> tuple[set[frozenset[int]], int]:
    """The pairs of ranks holding a connection (rank 0 for an end no worker holds: the
    parameter server), and how many connections there are, from the workers' records."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("rank-*.json"))]
    owner = {tuple(local): r["rank"] for r in records for local, _ in r["sockets"]}
    seen: set[frozenset[tuple[str, int]]] = set()
    pairs: set[frozenset[int]] = set()
    for record in records:
        for local, remote in record["sockets"]:
            if remote[1] == record["store"]:
                continue  # this rank's client of the rendezvous store
            seen.add(frozenset({tuple(local), tuple(remote)}))
            pairs.add(frozenset({record["rank"], owner.get(tuple(remote), 0)}))
    return pairs, len(seen)


@pytest.mark.parametrize("strategy", ["sync", "diloco", "sync-sharded"])
def test_a_four_group_task_connects_inside_groups_and_leaders_to_the_server(
    make_spec: Callable[..., RunSpec], tmp_path: Path, strategy: str
) -> None:
    """``sync-sharded``: group a (3 workers) shards its model (``sharding: fsdp``), so its
    two other workers have a link of their own to the server too."""
    sharded = strategy == "sync-sharded"
    strategy = strategy.removesuffix("-sharded")
    folder = tmp_path / "sockets"
    folder.mkdir()
    module = tmp_path / "records_connections.py"
    module.write_text(f"FOLDER = {str(folder)!r}\n" + RECORDS_CONNECTIONS)
    spec = make_spec(
        code=str(module),
        groups=[{**GROUPS[0], "sharding": "fsdp"}, *GROUPS[1:]] if sharded else GROUPS,
        epochs=3,
        global_batch_size=14,
        sync_strategy=strategy,
        sync_period=2,
    )
    run, _ = run_with_dump(spec, tmp_path / "params")
    assert len(list(folder.glob("rank-*.json"))) == spec.n_workers, run.text(0)
    pairs, count = connections(folder)
    groups = [spec.group_ranks(g) for g in range(len(spec.groups))]
    leaders = spec.leader_ranks()
    inside = {frozenset(p) for g in groups for p in combinations(g, 2)}
    linked = [*leaders, *(groups[0][1:] if sharded else [])]
    to_server = {frozenset({0, rank}) for rank in linked}
    ring = {frozenset({a, b}) for a, b in zip(leaders, [*leaders[1:], leaders[0]], strict=True)}
    among_leaders = ring if strategy == "sync" else set()
    assert pairs == inside | to_server | among_leaders, sorted(map(sorted, pairs))
    # Σ W_g (W_g − 1) / 2 = 3 + 1 inside the groups and G = 4 links to the parameter server: 8
    # (issue 37's bound), under sync the ring of the leaders' allreduce, G = 4 more (a mesh of
    # the leaders was 4 × 3 / 2 = 6), and with group a sharded its other W_g − 1 = 2 workers'
    # links; the world group alone held 28
    g = len(spec.groups)
    expected = len(inside) + g + (g if strategy == "sync" else 0)
    expected += len(groups[0]) - 1 if sharded else 0
    want = {"sync": 12, "diloco": 8}[strategy] + (2 if sharded else 0)
    assert count == expected == want, sorted(map(sorted, pairs))
    assert count < spec.world_size * (spec.world_size - 1) // 2 == 28
