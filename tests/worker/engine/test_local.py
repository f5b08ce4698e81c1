"""The local launcher starts the other ranks on the port rank 0's rendezvous store bound."""

from __future__ import annotations

from collections.abc import Callable

from worker.engine.local import launch_local
from worker.engine.spec import RunSpec


def test_the_ranks_meet_on_the_port_rank_0_picked(make_spec: Callable[..., RunSpec]) -> None:
    spec = make_spec(epochs=1)
    spawned: list[dict[int, int]] = []
    run = launch_local(spec, timeout_s=300, on_spawn=spawned.append)
    assert run.ok, run.text(0)
    assert spawned == [run.pids]  # once, with every rank
    told = [e for e in run.events if e["type"] == "rendezvous"]
    assert len(told) == 1 and told[0]["_rank"] == 0  # rank 0 bound port 0 and said which
    assert 0 < told[0]["port"] < 65536
    assert sorted(run.returncodes) == list(range(spec.world_size))  # every rank then joined


def test_no_other_rank_starts_when_rank_0_fails_first(
    make_spec: Callable[..., RunSpec],
) -> None:
    # rank 0 cannot read its timeout, so it exits before its store listens
    spawned: list[dict[int, int]] = []
    run = launch_local(
        make_spec(),
        env_extra={"POLYTRAIN_DIST_TIMEOUT_S": "soon"},
        timeout_s=60,
        on_spawn=spawned.append,
    )
    assert not run.ok and not run.timed_out
    assert spawned == [] and run.text(1) == ""
    assert list(run.returncodes) == [0] and run.returncodes[0] == 1
    assert "could not convert string to float" in run.text(0)
    assert not [e for e in run.events if e["type"] == "rendezvous"]
