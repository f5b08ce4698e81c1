"""A parameter server in shards (``ps_shards``) under ``periodic``: the run is bitwise the
unsharded one (every rank's parameters and buffers, and the checkpoint a user downloads),
the other shard owners build no model, and a spec the engine cannot run is refused naming
``ps_shards``.

Real gloo processes through the local launcher; a model with BatchNorm buffers
(tests/worker/engine/test_buffers.py) over groups of 2 + 1 workers, averaging every 2 steps.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.worker.engine.reference import run_with_dump
from tests.worker.engine.test_buffers import bn_spec, checkpoint_model
from worker.engine.spec import RunSpec


def _periodic(make_spec: Callable[..., RunSpec], folder: Path, shards: int) -> RunSpec:
    return bn_spec(
        make_spec, folder, sync_strategy="periodic", sync_period=2, epochs=2, ps_shards=shards
    )


def test_a_sharded_server_trains_bitwise_as_one_server(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    one = _periodic(make_spec, tmp_path / "one", 1)
    three = _periodic(make_spec, tmp_path / "three", 3)
    assert (one.world_size, three.world_size) == (4, 6)
    assert three.shard_servers() == [0, 4, 5]
    _, whole = run_with_dump(one, tmp_path / "one" / "dump")
    run, sharded = run_with_dump(three, tmp_path / "three" / "dump")
    # Every rank of the task, server and workers, ends with the same parameters and buffers.
    for rank in range(one.world_size):
        assert whole[rank].numel() > 0
        assert torch.equal(sharded[rank], whole[rank]), rank
    # The other owners hold no model: they built none and dump nothing.
    for rank in (4, 5):
        assert sharded[rank].numel() == 0
        assert f"up: shard {rank - 3} of 3 of the parameter server" in run.text(rank)
    # What a user downloads: the checkpoint's parameters and buffers, the same.
    got = checkpoint_model(three).state_dict()
    want = checkpoint_model(one).state_dict()
    assert set(got) == set(want) and any("running_mean" in name for name in got)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sync_strategy": "sync"}, "ps_shards 2 runs with sync_strategy 'periodic' only"),
        ({"sync_strategy": "diloco"}, "not 'diloco' (use ps_shards 1)"),
    ],
)
def test_a_sharded_server_the_engine_cannot_run_is_refused(
    make_spec: Callable[..., RunSpec], overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make_spec(ps_shards=2, **overrides)


def test_the_other_owners_are_in_no_group(make_spec: Callable[..., RunSpec]) -> None:
    spec = make_spec(sync_strategy="periodic", ps_shards=2)
    assert spec.world_size == 5 and spec.is_shard_server(4) and not spec.is_shard_server(3)
    with pytest.raises(ValueError, match="rank 4 is the parameter server's"):
        spec.group_of(4)
    with pytest.raises(ValueError, match="ps_shards"):
        make_spec(sync_strategy="periodic", ps_shards=0)
