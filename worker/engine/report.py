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
``rank`` 0 is the task's own value (the agent stores it without a rank).

Per-step series are ``metric`` events too, told apart by their name's prefix
:data:`STEP_SERIES` (``step/``); every other metric is per epoch (or per worker, per
epoch). Every ``N`` steps (:func:`step_every`: the task's ``step_metrics_every``, default
about :data:`POINTS_PER_EPOCH` points an epoch) one rank reports, at rank 0, the steps
since the last point (:class:`StepCurve`)::

    {"type": "metric", "name": "step/train_loss", "value": float, "step": int, "epoch": int,
     "rank": 0}   (sample-weighted mean loss of the window's samples, every group's)
    {"type": "metric", "name": "step/samples_per_s", ...}   (the window's samples over its
     wall seconds)
    {"type": "metric", "name": "step/lr", ...}   (the user's optimizer's first ``lr``)

and, where the training code opts in (``STEP_METRICS = True``,
:mod:`worker.engine.contract`), every compute worker reports its ``metrics`` on its own
part of the step's batch as ``step/train_<name>`` with its own rank.
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


def emit_all(events: list[dict[str, Any]]) -> None:
    """Print several event lines in one write (one flush); none: nothing."""
    if not events:
        return
    print(
        "\n".join(PREFIX + json.dumps(e, separators=(",", ":"), allow_nan=False) for e in events),
        flush=True,
    )


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
    emit(metric_event(name, value, step=step, epoch=epoch, rank=rank))


def metric_event(name: str, value: float, *, step: int, epoch: int, rank: int) -> dict[str, Any]:
    """The ``metric`` event of one scalar (:func:`metric`)."""
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
    return event


def checkpoint(
    path: str,
    *,
    step: int,
    epoch: int,
    provenance: dict[str, Any] | None = None,
    parts: list[str] | None = None,
) -> None:
    """Report that a checkpoint file was written (by the parameter server), with the shard
    provenance of the samples trained since the previous one when given, and ``parts``, the
    ``folder/file`` names of its sharded optimizer state (contracts/sharded_state.py) where
    its state folder holds it."""
    event: dict[str, Any] = {"type": "checkpoint", "path": path, "step": step, "epoch": epoch}
    if provenance is not None:
        event["provenance"] = provenance
    if parts:
        event["parts"] = parts
    emit(event)


def checkpoint_part(path: str) -> None:
    """Report a file of a checkpoint's state folder this worker wrote (``path``:
    ``<checkpoint_dir>/<name>.dcp/<file>``), for its agent to upload."""
    emit({"type": "checkpoint_part", "path": path})


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


def rendezvous_port(line: str) -> int | None:
    """The port rank 0's rendezvous store listens on, from its ``rendezvous`` event
    (:func:`worker.engine.distributed.rendezvous_store`); None for any other line, or an
    event whose port is not a TCP port (rank 0 runs the user's code: its output is not
    trusted)."""
    event = parse_event(line)
    if event is None or event["type"] != "rendezvous":
        return None
    port = event.get("port")
    valid = isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
    return port if valid else None


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


STEP_SERIES = "step/"
"""The name prefix of a per-step series (``step/train_loss``); a metric without it is per
epoch. The API filters on it (``GET /tasks/{id}/metrics?scale=step``)."""

STEP_FLUSH_S = 1.0
"""A rank writes its per-step points at most about this often, seconds (:class:`StepCurve`)."""

POINTS_PER_EPOCH = 100
"""About this many per-step points an epoch by default (:func:`step_every`)."""


def step_every(setting: int | None, steps_per_epoch: int) -> int:
    """Steps between two per-step points: ``setting`` (the task's ``step_metrics_every``;
    0: none) when given, else ``max(1, steps_per_epoch // POINTS_PER_EPOCH)``."""
    if setting is not None:
        return max(0, setting)
    return max(1, steps_per_epoch // POINTS_PER_EPOCH)


class StepCurve:
    """The per-step series of one rank: a window of steps, reported every ``every`` steps.

    The rank that knows a step's loss adds it (:meth:`add`: the loss sum and the samples it
    already holds, no device sync, no collective); a point is due when the global step
    crosses a multiple of ``every`` (:meth:`due`: a strategy whose steps come in rounds
    reports at the first step past the mark); :meth:`point` reports the window (the
    sample-weighted mean loss, the samples over the window's wall seconds, the learning
    rate), then opens the next. :meth:`restart` opens a window at an epoch's
    start: a point never spans an epoch's end (validation, checkpoint), and the steps of an
    epoch after its last mark are not reported. ``observed``: the last step whose batch was
    passed to the user's per-step ``metrics`` (:meth:`observe_due`).

    Points (and the user's per-step ``metrics``, :meth:`send`) are held and written
    together when :data:`STEP_FLUSH_S` has passed since the last write, and a point whose
    window lasted that long is written at once: a write every point while points are a
    second or more apart, at most about one a second when they come faster, so a point is
    written at most about ``STEP_FLUSH_S`` plus one window after it was measured.
    :meth:`flush` writes the rest at an epoch's end (or when it raises; a rank killed by a
    signal loses what it holds, at most that). Each write wakes the process that reads the
    rank's output (the agent) on the cores the ranks compute on: a write per point cost a
    400-step epoch of 2 ms steps about 3 % against a write a second (docs/benchmarks.md,
    "Per-step curves").
    """

    __slots__ = ("every", "last", "observed", "loss_sum", "samples", "opened", "held", "written")

    def __init__(self, every: int = 0) -> None:
        self.every = every
        self.last = self.observed = 0
        self.loss_sum, self.samples = 0.0, 0
        self.opened = time.perf_counter()
        self.held: list[dict[str, Any]] = []  # points not written yet (their events)
        self.written = float("-inf")  # when the last write was (perf_counter seconds)

    def restart(self, step: int, every: int) -> None:
        """A new window from global step ``step`` (an epoch's start), points every ``every``."""
        self.every, self.last, self.observed = every, step, step
        self.loss_sum, self.samples = 0.0, 0
        self.opened = time.perf_counter()

    def add(self, loss_sum: float, samples: int) -> None:
        """Steps of the window: their loss sum (``loss_fn`` times each step's count) and
        samples (skipped steps add none)."""
        self.loss_sum += loss_sum
        self.samples += samples

    def due(self, step: int) -> bool:
        """True when global step ``step`` crossed a multiple of ``every`` since the last
        point."""
        every = self.every
        return every > 0 and step // every > self.last // every

    def observe_due(self, step: int) -> bool:
        """True (once) when the batch of global step ``step`` is to be passed to the user's
        per-step ``metrics``: the step crossed a multiple of ``every`` since the last one."""
        every = self.every
        if every > 0 and step // every > self.observed // every:
            self.observed = step
            return True
        return False

    def point(self, *, step: int, epoch: int, lr: float | None, send: bool = True) -> None:
        """Report the window at ``step`` (rank 0: the task's series) when ``send``, then
        open the next one (a rank that does not report keeps its window in step). What is
        held is written when :data:`STEP_FLUSH_S` passed since the last write or the window
        lasted that long."""
        now = time.perf_counter()
        events: list[dict[str, Any]] = []
        if send:
            seconds = now - self.opened
            if self.samples:
                mean = self.loss_sum / self.samples
                events.append(
                    metric_event(STEP_SERIES + "train_loss", mean, **self._at(step, epoch))
                )
            rate = self.samples / seconds if seconds > 0 else 0.0
            events.append(
                metric_event(STEP_SERIES + "samples_per_s", rate, **self._at(step, epoch))
            )
            if lr is not None:
                events.append(metric_event(STEP_SERIES + "lr", float(lr), **self._at(step, epoch)))
        # A slow window's point goes at once: the next call may be far off. (Under sync the
        # source worker's metrics were sent a moment ago in this step and may have written.)
        self.send(events, now, due=now - self.opened >= STEP_FLUSH_S)
        self.last, self.loss_sum, self.samples, self.opened = step, 0.0, 0, now

    def send(
        self, events: list[dict[str, Any]], now: float | None = None, *, due: bool = False
    ) -> None:
        """Hold ``events`` (a point's, or the user's per-step ``metrics`` of this rank's part
        of a batch) with the others, and write them all when ``due`` or when
        :data:`STEP_FLUSH_S` passed since the last write."""
        now = time.perf_counter() if now is None else now
        self.held.extend(events)
        if due or now - self.written >= STEP_FLUSH_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Write the points held, in one write (none: nothing)."""
        if self.held:
            emit_all(self.held)
            self.held = []
            self.written = time.perf_counter() if now is None else now

    @staticmethod
    def _at(step: int, epoch: int) -> dict[str, int]:
        return {"step": step, "epoch": epoch, "rank": 0}


def first_lr(optimizer: Any) -> float | None:
    """The learning rate of ``optimizer``'s first parameter group (None without one, or when
    it is not a number, e.g. a tensor of another device: never a device sync)."""
    if optimizer is None or not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    return float(lr) if isinstance(lr, int | float) else None
