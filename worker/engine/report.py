"""Events a rank reports on its stdout, one line each: ``@@polytrain {json}``.

Every other stdout or stderr line is a log line. The agent reads a rank's
output and forwards events to the backend with :func:`parse_event`. Event shapes::

    {"type": "metric", "name": str, "value": float | null, "step": int, "epoch": int, "rank": int,
     "nonfinite": "nan" | "inf" | "-inf" (only when value is null)}
    {"type": "checkpoint", "path": str, "step": int, "epoch": int,
     "provenance": {"n_items": int, "set_hash": str, "records": [...]} (optional; the
     segments :mod:`worker.engine.provenance` closed since the last checkpoint)}
    {"type": "progress", "epoch": int, "step": int, "steps_per_epoch": int, "epochs": int}
    {"type": "rendezvous", "port": int}  (rank 0 only, when told to pick its own port)
    {"type": "alarm", "reason": str, "group": str}  (the parameter server: a group to look at)
    {"type": "guard", "reason": str, "group": str}  (the parameter server: the guard parked a
     group or took it back, :mod:`worker.engine.guard`)
    {"type": "trial", "result": {...}}  (the parameter server: a plan's trial timings,
     :class:`contracts.trial.TrialResult`)
    {"type": "done"}

``epoch`` is 0-based; ``step`` counts optimizer steps completed since the start
of training (global, not per epoch). A metric value that is not finite is null,
with ``nonfinite`` saying which (JSON has no NaN): it is shown, never dropped.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import psutil

PREFIX = "@@polytrain "


def emit(event: dict[str, Any]) -> None:
    """Print one event line to stdout and flush it."""
    print(PREFIX + json.dumps(event, separators=(",", ":"), allow_nan=False), flush=True)


def log(message: str) -> None:
    """Print one log line to stdout and flush it."""
    print(message, flush=True)


def nonfinite_name(value: float) -> str | None:
    """``"nan"``, ``"inf"`` or ``"-inf"`` for a value that is not finite, else None."""
    if math.isfinite(value):
        return None
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def metric(name: str, value: float, *, step: int, epoch: int, rank: int) -> None:
    """Report one scalar metric; a non-finite value is sent as null plus ``nonfinite``."""
    special = nonfinite_name(value)
    event: dict[str, Any] = {
        "type": "metric",
        "name": name,
        "value": None if special else value,
        "step": step,
        "epoch": epoch,
        "rank": rank,
    }
    if special:
        event["nonfinite"] = special
    emit(event)


def checkpoint(
    path: str, *, step: int, epoch: int, provenance: dict[str, Any] | None = None
) -> None:
    """Report that a checkpoint file was written (by the parameter server), with the shard
    provenance of the samples trained since the previous one when given."""
    event: dict[str, Any] = {"type": "checkpoint", "path": path, "step": step, "epoch": epoch}
    if provenance is not None:
        event["provenance"] = provenance
    emit(event)


def progress(*, epoch: int, step: int, steps_per_epoch: int, epochs: int) -> None:
    """Report training progress; ``step`` is global, so done fraction = step / (spe * epochs)."""
    emit(
        {
            "type": "progress",
            "epoch": epoch,
            "step": step,
            "steps_per_epoch": steps_per_epoch,
            "epochs": epochs,
        }
    )


def alarm(reason: str, *, group: str) -> None:
    """Report an alarm about group ``group`` (the task's events show it), e.g. a group whose
    numbers disagree with the parameter server's (:mod:`worker.engine.agreement`)."""
    emit({"type": "alarm", "reason": reason, "group": group})


def guard(reason: str, *, group: str) -> None:
    """Report that the guard parked group ``group`` or took it back (the task's timeline
    shows it, :mod:`worker.engine.guard`)."""
    emit({"type": "guard", "reason": reason, "group": group})


def trial(result: dict[str, Any]) -> None:
    """Report a trial's timings (parameter server, :mod:`worker.engine.trial`)."""
    emit({"type": "trial", "result": result})


def done() -> None:
    """Report that training finished (parameter server, after the final checkpoint)."""
    emit({"type": "done"})


def parse_event(line: str) -> dict[str, Any] | None:
    """The event carried by one output line, or None for a log line.

    A line that starts with the prefix but is not a JSON object with a string
    ``type`` is treated as a log line (None), never an error.
    """
    if not line.startswith(PREFIX):
        return None
    try:
        event = json.loads(line[len(PREFIX) :])
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return None
    return event


RANK_STARTED: float | None = None
"""When this process was given its rank (``time.time()``), where that is later than its
creation: a warm interpreter of the agent's pool (``worker/agent/warm.py``) waits, torch
already imported, until a task needs it. None: the process's creation."""


class StartupClock:
    """Where a rank's start-up went: seconds per part, in order, from the process's creation
    (or :data:`RANK_STARTED`).

    :meth:`mark` closes a part; :meth:`report` logs them in one line and reports the total
    as the metric ``startup_s`` (step 0), so a slow group's start-up (on a third of a core,
    three times the fast group's) shows part by part on the task page and in its log.
    """

    def __init__(self) -> None:
        self.created = self.last = RANK_STARTED or psutil.Process().create_time()
        self.parts: list[tuple[str, float]] = []

    def elapsed(self) -> float:
        """Seconds since the process's creation."""
        return max(0.0, time.time() - self.created)

    def mark(self, part: str) -> None:
        """The part ``part`` ends now."""
        now = time.time()
        self.parts.append((part, max(0.0, now - self.last)))
        self.last = now

    def report(self, rank: int) -> None:
        """Log ``rank R start-up T s: part s, ...`` and report ``startup_s`` = T."""
        total = sum(seconds for _, seconds in self.parts)
        parts = ", ".join(f"{part} {seconds:.2f}" for part, seconds in self.parts)
        log(f"rank {rank} start-up {total:.2f} s: {parts}")
        metric("startup_s", total, step=0, epoch=0, rank=rank)
