"""The portal's names and formats of a spec's stored settings (the task page's settings, the
comparison's settings that differ): words and units
(`Predicted time` `25 s`, `Rebalance every` `10 steps`) instead of the raw field names and
values (`predicted s` `24.94944633685312`).

`SETTINGS` maps a field to its label and formatter; a field it does not name (a setting
added later, an unknown key of an old spec) is shown under its name made readable
(`some_field` -> `Some field`) with its value formatted by its type (:func:`plain`).
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backend.web.templating import format_duration

Formatter = Callable[[Any], str | None]
"""A stored value as the page shows it; None: not shown (e.g. an empty list)."""


def number(value: float) -> str:
    """A number rounded for reading: whole numbers without a point, others to two decimals
    at 1 or more (`24.95`), else to three significant digits (`0.0001`, `0.123`)."""
    if isinstance(value, bool):
        return yes_no(value)
    if float(value).is_integer():
        return str(int(value))
    if abs(value) >= 1:
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{value:.3g}"


def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def plain(value: Any) -> str | None:
    """A value by its type: `—` for none, yes/no, a rounded number, a list of names joined
    by commas; None (not shown) for an empty list, a mapping or a list of anything else."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return yes_no(value)
    if isinstance(value, int | float):
        return number(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return ", ".join(value)
    return None


def count(unit: str, *, zero: str | None = None, none: str = "—") -> Formatter:
    """A whole number of ``unit``s (`1 step`, `10 steps`); ``zero`` and ``none``: what 0
    and a missing value mean for the setting."""

    def shown(value: Any) -> str | None:
        if value is None:
            return none
        if value == 0 and zero is not None:
            return zero
        return f"{number(value)} {unit}{'' if value == 1 else 's'}"

    return shown


def seconds(value: Any) -> str | None:
    """Seconds as `25 s`, `3 min 5 s` or `1 h 2 min`."""
    return "—" if value is None else format_duration(float(value))


def fraction(value: Any) -> str | None:
    """A 0..1 fraction of each worker's shard passed on per epoch; 0: none."""
    if value is None or value == 0:
        return "none"
    return f"{number(value * 100)}% of each shard per epoch"


def checkpoints(value: Any) -> str | None:
    """Checkpoints: at each epoch end, and every N steps when ``checkpoint_every`` is set."""
    steps = count("step")(value) if value else None
    return "each epoch end" if steps is None else f"every {steps} and each epoch end"


def plan(value: Any) -> str | None:
    return "—" if value is None else f"plan {value}"


@dataclass(frozen=True)
class Setting:
    """How one field is shown: its label and its value's formatter."""

    label: str
    show: Formatter = plain


SETTINGS: dict[str, Setting] = {
    "sync_strategy": Setting("Sync strategy"),
    "sync_period": Setting("Sync period", count("step")),
    "quorum": Setting("Quorum", count("group")),
    "max_staleness": Setting("Max staleness", count("step")),
    "outer_lr": Setting("Outer learning rate"),
    "outer_momentum": Setting("Outer momentum"),
    "diloco_exchange": Setting("DiLoCo exchange"),
    "guard": Setting("Guard"),
    "sharding": Setting("Sharding"),
    "fsdp_units": Setting("FSDP units"),
    "fsdp_param_dtype": Setting("FSDP compute dtype"),
    "ps_shards": Setting("Parameter-server shards", count("shard")),
    "exchange_fraction": Setting("Neighbour exchange", fraction),
    "checkpoint_every": Setting("Checkpoints", checkpoints),
    "rebalance_every": Setting("Rebalance every", count("step", zero="each epoch end")),
    "on_nonfinite": Setting("On a non-finite loss"),
    "on_disagreement": Setting("On disagreement"),
    "agreement_every": Setting("Agreement check every", count("step", zero="before training only")),
    "step_metrics_every": Setting(
        "Per-step curves every", count("step", zero="off", none="about 100 points an epoch")
    ),
    "on_group_loss": Setting("On group loss"),
    "plan_id": Setting("Submitted from", plan),
    "predicted_s": Setting("Predicted time", seconds),
}


def humanised(name: str) -> str:
    """A field name made readable: `some_field` -> `Some field`."""
    return name.replace("_", " ").strip().capitalize() or name


def shown_setting(key: str, value: Any) -> dict[str, str] | None:
    """`{"key", "label", "value"}` of one stored setting as the page shows it; None: not
    shown (a mapping, an empty list)."""
    setting = SETTINGS.get(key) or Setting(humanised(key))
    text = setting.show(value)
    if text is None:
        return None
    return {"key": key, "label": setting.label, "value": text}


def shown_difference(path: str, values: Sequence[Any]) -> dict[str, Any]:
    """`{"field", "label", "cells"}` of one setting that differs between compared tasks
    (`backend.tasks.compare.differences`: a flattened path such as `groups.0.workers`): a
    top-level setting under its label, a nested one under its path; each value formatted as
    the task page shows it, else as JSON (a mapping, a list of numbers). Values that read
    the same in words (a setting left unset against its default given, 77.2 s against
    77.4 s) are shown as stored instead, `unset` for none."""
    setting = SETTINGS.get(path) or Setting(path if "." in path else humanised(path))
    cells = []
    for value in values:
        text = setting.show(value)
        cells.append(json.dumps(value, sort_keys=True) if text is None else text)
    if len(set(cells)) == 1:
        cells = ["unset" if v is None else json.dumps(v, sort_keys=True) for v in values]
    return {"field": path, "label": setting.label, "cells": cells}
