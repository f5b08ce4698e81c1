"""The task page's settings in words and units (`backend.web.spec_display`)."""

from datetime import timedelta

import pytest

from backend.core.db import utcnow
from backend.tasks.models import Task, TaskStatus
from backend.web.spec_display import (
    SETTINGS,
    humanised,
    number,
    shown_difference,
    shown_setting,
)
from backend.web.views import measured_time, spec_summary
from contracts.task_spec import ENGINE_OPTIONS, TaskSpec


def shown(key: str, value: object) -> tuple[str, str] | None:
    row = shown_setting(key, value)
    return None if row is None else (row["label"], row["value"])


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("predicted_s", 24.94944633685312, ("Predicted time", "25 s")),
        ("predicted_s", 185.2, ("Predicted time", "3 min 5 s")),
        ("predicted_s", 7500, ("Predicted time", "2 h 5 min")),
        ("plan_id", 7, ("Submitted from", "plan 7")),
        ("guard", True, ("Guard", "yes")),
        ("guard", False, ("Guard", "no")),
        ("sync_period", 1, ("Sync period", "1 step")),
        ("sync_period", 16, ("Sync period", "16 steps")),
        ("rebalance_every", 10, ("Rebalance every", "10 steps")),
        ("rebalance_every", 0, ("Rebalance every", "each epoch end")),
        ("agreement_every", 0, ("Agreement check every", "before training only")),
        ("checkpoint_every", None, ("Checkpoints", "each epoch end")),
        ("checkpoint_every", 50, ("Checkpoints", "every 50 steps and each epoch end")),
        ("exchange_fraction", 0.0, ("Neighbour exchange", "none")),
        ("exchange_fraction", 0.25, ("Neighbour exchange", "25% of each shard per epoch")),
        ("outer_lr", 0.7, ("Outer learning rate", "0.7")),
        ("outer_lr", None, ("Outer learning rate", "—")),
        ("quorum", 2, ("Quorum", "2 groups")),
        ("fsdp_units", ["Block", "Linear"], ("FSDP units", "Block, Linear")),
        ("sync_strategy", "diloco", ("Sync strategy", "diloco")),
    ],
)
def test_known_fields_have_words_and_units(key: str, value: object, expected: tuple) -> None:
    assert shown(key, value) == expected


def test_unknown_fields_get_a_readable_name_and_a_value_by_type() -> None:
    assert shown("warmup_fraction", 0.123456) == ("Warmup fraction", "0.123")
    assert shown("some_rate", 1234.5678) == ("Some rate", "1234.57")
    assert shown("flag", True) == ("Flag", "yes")
    assert shown("steps", 12) == ("Steps", "12")
    assert shown("missing", None) == ("Missing", "—")
    assert shown("fsdp_units", []) is None  # nothing to show
    assert shown("agreement_tolerance", {"cpu/cuda": 0.001}) is None  # mappings are not shown
    assert humanised("on_group_loss") == "On group loss"


def test_numbers_are_rounded_for_reading() -> None:
    assert [number(v) for v in (3, 3.0, 24.949446, 1.5, 0.0001, 0.123456)] == [
        "3",
        "3",
        "24.95",
        "1.5",
        "0.0001",
        "0.123",
    ]


def test_every_engine_option_and_plan_field_has_a_label() -> None:
    """A new setting gets words here too: the readable-name fallback is for keys of old or
    unknown specs, not for the settings the task form offers."""
    shown_elsewhere = {"preprocess", "data", "trial", "agreement_tolerance"}  # not scalars
    named = set(ENGINE_OPTIONS) - shown_elsewhere | {"on_group_loss", "plan_id", "predicted_s"}
    assert named <= set(SETTINGS)


def test_the_summary_shows_no_raw_field_name_or_float() -> None:
    spec = TaskSpec.model_validate(
        {
            "epochs": 3,
            "global_batch_size": 64,
            "groups": [{"name": "cpu-a", "device_type": "cpu", "workers": 1}],
            "sync_strategy": "sync",
            "rebalance_every": 10,
            "guard": True,
            "plan_id": 3,
            "predicted_s": 24.94944633685312,
        }
    )
    rows = {row["key"]: (row["label"], row["value"]) for row in spec_summary(spec)["settings"]}
    assert rows["predicted_s"] == ("Predicted time", "25 s")
    assert rows["plan_id"] == ("Submitted from", "plan 3")
    assert rows["rebalance_every"] == ("Rebalance every", "10 steps")
    assert list(rows) == ["sync_strategy", "guard", "rebalance_every", "plan_id", "predicted_s"]


def test_the_measured_time_once_the_task_ended() -> None:
    now = utcnow()
    ran = {"started_at": now - timedelta(seconds=27), "finished_at": now}
    assert measured_time(Task(status=TaskStatus.SUCCEEDED, **ran), 27.2) == "(took 27 s)"
    assert measured_time(Task(status=TaskStatus.FAILED, **ran), 9.0) == "(ran 9 s)"
    assert measured_time(Task(status=TaskStatus.RUNNING, started_at=now), 5.0) == ""
    assert measured_time(Task(status=TaskStatus.QUEUED), None) == ""


def test_a_compared_difference_is_shown_as_the_task_page_shows_it() -> None:
    """The comparison's settings that differ (predicted_s of two plans: 'PREDICTED_S
    77.15146349036003' before), a nested path under its path, what has no words as JSON."""
    assert shown_difference("predicted_s", [77.15146349036003, 123.09, None]) == {
        "field": "predicted_s",
        "label": "Predicted time",
        "cells": ["1 min 17 s", "2 min 3 s", "—"],
    }
    assert shown_difference("global_batch_size", [16, 8])["cells"] == ["16", "8"]
    assert shown_difference("global_batch_size", [16, 8])["label"] == "Global batch size"
    nested = shown_difference("groups.0.workers", [2, 1])
    assert (nested["label"], nested["cells"]) == ("groups.0.workers", ["2", "1"])
    assert shown_difference("fsdp_units", [[3, 4], None])["cells"] == ["[3, 4]", "—"]
    # the same in words, not the same stored: shown as stored
    assert shown_difference("exchange_fraction", [None, 0])["cells"] == ["unset", "0"]
    assert shown_difference("predicted_s", [77.2, 77.4])["cells"] == ["77.2", "77.4"]
