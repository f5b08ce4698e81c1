"""Across hosts: API, broker and agents in network namespaces (scripts/netns_cluster.sh).

Group cpu-a spans two hosts (agents a1 and a2, one worker each) and cpu-b is a third; one
task takes all three workers. Its Celery traffic, the allreduce inside cpu-a and the
parameter-server exchange cross the namespaces; its nodes run on the agents' own addresses,
and its final parameters equal a single-process replay of the same seeded batches (1e-5).
A machine that refuses network namespaces (not root, no CAP_NET_ADMIN) fails this test: CI
runs as root, so a refusal there is a broken environment, not a reason to skip.
"""

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "netns_cluster.sh"
A1, A2, B = "10.77.0.3", "10.77.0.5", "10.77.0.4"


def test_task_spans_a_group_on_two_hosts_and_a_second_group() -> None:
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["status"] == "SUCCEEDED"
    assert result["compute_hosts"] == [["cpu-a", A1], ["cpu-a", A2], ["cpu-b", B]]
    # cpu-a's two workers are two parts, one per agent, ranks 1 and 2; the parameter server
    # runs with the first part, on one of cpu-a's hosts.
    assert result["parts"] == [
        ["cpu-a", 0, 1, 1, True],
        ["cpu-a", 1, 2, 1, False],
        ["cpu-b", 0, 3, 1, False],
    ]
    assert result["master_addr"] in (A1, A2)
    assert result["max_abs_difference"] is not None and result["max_abs_difference"] <= 1e-5
    # Every rank tried a listener on a host that runs none of the task's ranks: none got in,
    # though the listener was there for a process outside the sandbox.
    assert result["control_probe"] == "connected"
    assert result["probes"] and all(p.startswith("probe refused") for p in result["probes"])
