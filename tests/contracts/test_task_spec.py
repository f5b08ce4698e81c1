"""The stored task spec reads into `TaskSpec` and writes back with the same JSON."""

import json

from contracts.plan import GroupPlan
from contracts.task_spec import TaskSpec

SUBMITTED = {
    "epochs": 2,
    "global_batch_size": 64,
    "seed": 0,
    "groups": [],
    "request": [
        {
            "device_type": "cpu",
            "workers": 3,
            "placement": "uniform",
            "labels": {},
            "speed_factor": 0.5,
        }
    ],
    "split_policy": "even",
    "sync_strategy": "quorum",
    "sync_period": 1,
    "quorum": 4,
    "max_staleness": 2,
    "exchange_fraction": 0.0,
    "checkpoint_every": None,
    "rebalance_every": 10,
    "on_nonfinite": "fail",
    "preprocess": [
        {"op": "resize", "size": [28, 28]},
        {"op": "normalize", "mean": None, "std": None},
    ],
    "limits": {"max_runtime_s": 86400, "memory_limit_mb": 4096},
    "depends_on": [],
}
OLD = {
    "epochs": 1,
    "global_batch_size": 8,
    "seed": 0,
    "split_policy": "even",
    "groups": [{"name": "cpu-a", "device_type": "cpu", "workers": 2}],
}


def test_stored_json_round_trips() -> None:
    for stored in (SUBMITTED, OLD, {}):
        assert TaskSpec.model_validate(stored).stored() == stored
    # what `submit` stores comes back key for key, in the same order
    assert json.dumps(TaskSpec.model_validate(SUBMITTED).stored()) == json.dumps(SUBMITTED)


def test_placing_groups_keeps_the_rest_of_the_spec() -> None:
    placed = GroupPlan.model_validate({"name": "cpu-a", "device_type": "cpu", "workers": 3})
    spec = TaskSpec.model_validate(SUBMITTED).model_copy(update={"groups": [placed]})
    assert spec.stored() == {
        **SUBMITTED,
        "groups": [{"name": "cpu-a", "device_type": "cpu", "workers": 3}],
    }
    assert spec.speed_factor(spec.groups[0]) == 0.5  # from the device-type request item
    assert spec.engine_options()["quorum"] == 1  # no more than the placed groups
    assert "checkpoint_every" not in spec.engine_options()


def test_a_spec_from_before_the_request_form_requests_its_groups() -> None:
    spec = TaskSpec.model_validate(OLD)
    assert [item.model_dump(exclude_unset=True) for item in spec.requested()] == OLD["groups"]
    assert spec.named_groups() == {"cpu-a"}


def test_a_group_takes_the_sharding_of_the_request_item_that_names_it() -> None:
    spec = TaskSpec.model_validate(
        {
            "sharding": "none",
            "request": [
                {"name": "g1", "workers": 1},
                {"device_type": "cpu", "workers": 2, "sharding": "fsdp"},
            ],
        }
    )
    named = GroupPlan(name="g1", device_type="cpu", workers=1)
    placed = GroupPlan(name="g2", device_type="cpu", workers=2)
    # g1's item sets none (the task's applies), not the device-type item's.
    assert spec.sharding_of(named) is None
    assert spec.sharding_of(placed) == "fsdp"
