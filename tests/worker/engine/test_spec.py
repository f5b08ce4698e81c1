"""The run specification: rank layout of groups, validation."""

from __future__ import annotations

import pydantic
import pytest

from worker.engine.ranks import rank_env
from worker.engine.spec import RunSpec

GROUPS = [
    {"name": "gpu", "device_type": "cuda", "workers": 2},
    {"name": "cpu", "device_type": "cpu", "workers": 3},
]


def spec(**overrides: object) -> RunSpec:
    fields = {
        "task_id": 7,
        "code": "example:tiny_regression",
        "epochs": 1,
        "global_batch_size": 8,
        "groups": GROUPS,
        "checkpoint_dir": "/tmp/x",
    }
    return RunSpec.model_validate({**fields, **overrides})


def test_groups_occupy_contiguous_ranks_after_the_parameter_server() -> None:
    s = spec()
    assert s.world_size == 6
    assert s.group_ranks(0) == [1, 2] and s.group_ranks("cpu") == [3, 4, 5]
    assert [s.group_of(r) for r in range(1, 6)] == [0, 0, 1, 1, 1]
    assert s.leader_ranks() == [1, 3]


def test_rank_zero_and_outside_ranks_have_no_group() -> None:
    s = spec()
    with pytest.raises(ValueError):
        s.group_of(0)
    with pytest.raises(ValueError):
        s.group_of(6)
    with pytest.raises(KeyError):
        s.group_ranks("tpu")


def test_spec_rejects_duplicate_group_names_and_empty_groups() -> None:
    with pytest.raises(pydantic.ValidationError):
        spec(groups=[GROUPS[0], GROUPS[0]])
    with pytest.raises(pydantic.ValidationError):
        spec(groups=[])
    with pytest.raises(pydantic.ValidationError):
        spec(groups=[{"name": "x", "device_type": "tpu", "workers": 1}])


def test_spec_round_trips_through_json() -> None:
    s = spec(resume_from="/tmp/x/epoch-0.pt")
    assert RunSpec.model_validate_json(s.model_dump_json()) == s


def test_rank_env_places_a_process() -> None:
    env = rank_env(spec(), 4, "10.0.0.5", 29500)
    assert env["RANK"] == "4" and env["WORLD_SIZE"] == "6" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.5" and env["MASTER_PORT"] == "29500"
    assert rank_env(spec(), 0, "h", 1)["LOCAL_RANK"] == "0"
    with pytest.raises(ValueError):
        rank_env(spec(), 6, "h", 1)


def test_heterogeneity_options_default_to_even_synchronous_training() -> None:
    s = spec()
    assert (s.split_policy, s.sync_strategy, s.exchange_fraction) == ("even", "sync", 0.0)
    assert s.speed_factor_of(1) == 1.0 and s.quorum_size == 1 and s.preprocess == []


@pytest.mark.parametrize(
    "overrides",
    [
        {"groups": [{**GROUPS[0], "speed_factor": 0.0}]},
        {"groups": [{**GROUPS[0], "speed_factor": 1.5}]},
        {"exchange_fraction": 1.2},
        {"exchange_fraction": -0.1},
        {"quorum": 3},
        {"global_batch_size": 4},
        {"split_policy": "fastest"},
        {"sync_strategy": "gossip"},
        {"preprocess": [{"op": "resize", "size": [28, 28]}, {"op": "tokenize"}]},
        {"preprocess": [{"op": "rotate"}]},
    ],
)
def test_spec_refuses_out_of_range_heterogeneity_options(overrides: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        spec(**overrides)


def test_preprocess_steps_parse_by_op() -> None:
    steps = [{"op": "tokenize", "vocab_size": 100}, {"op": "normalize", "mean": [0.5]}]
    s = spec(preprocess=steps)
    assert [type(step).__name__ for step in s.preprocess] == ["Tokenize", "Normalize"]
    assert RunSpec.model_validate_json(s.model_dump_json()) == s
