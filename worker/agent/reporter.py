"""Turns the processes' output into logs, metrics, progress and checkpoints at the backend."""

import logging
import queue
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from contracts import sharded_state
from contracts.agent_api import REPORT_MAX_ITEMS, Alarm, MetricIn, Provenance
from contracts.trial import TrialResult
from worker.agent.client import Conflict, InternalApi, unanswered
from worker.agent.sandbox import read_rank_file
from worker.engine.ranks import node_name
from worker.engine.report import parse_event

log = logging.getLogger(__name__)

OUTAGE_LIMIT_S = 120.0
"""How long the API may fail every flush (transport errors, 5xx answers, each after the
client's retries) while a group's ranks run before the part is failed: a restart of the API
or of its database, seconds, must not stop training through its reports; an API gone for
minutes fails it."""
OUTAGE_RETRY_S = 5.0
"""Seconds between flushes while the API fails them."""


class Reporter:
    """Buffers a group's output and sends it in batches (at most every `interval_s`).

    Each node's log lines are numbered from 0 (`seq`) in each attempt, so a
    batch sent twice after a retry is stored once, and a restarted task's
    nodes start a new gap-free sequence.

    Output lines come from untrusted user code too: a checkpoint event is
    uploaded only from `checkpoints/` of the emitting node's own rank
    directory (`rank_dirs[node]`), read without following links; anything else
    is logged as refused, never read.
    """

    def __init__(
        self,
        api: InternalApi,
        task_id: int,
        *,
        group: str,
        interval_s: float = 0.5,
        attempt: int = 1,
        outage_limit_s: float = OUTAGE_LIMIT_S,
    ) -> None:
        self.api, self.task_id, self.group, self.interval_s = api, task_id, group, interval_s
        self.attempt = attempt
        self.outage_limit_s = outage_limit_s
        self._failing_since: float | None = None  # time.monotonic() of the first failed flush
        self._retry_at = 0.0
        self._seq: dict[str, int] = {}
        self._metric_seq: dict[str, int] = {}  # each node's next metric number (`MetricIn.seq`)
        self._lines: list[dict[str, Any]] = []
        self._metrics: list[dict[str, Any]] = []
        self._progress: tuple[float, int] | None = None
        self._progressed = False
        self._last_flush = 0.0
        self.rank_dirs: dict[str, Path] = {}

    def agent_line(self, text: str) -> None:
        self._line(f"agent-{self.group}", text)

    def _line(self, node: str, text: str) -> None:
        seq = self._seq.get(node, 0)
        self._seq[node] = seq + 1
        self._lines.append(
            {
                "attempt": self.attempt,
                "node": node,
                "seq": seq,
                "time": datetime.now(UTC).replace(tzinfo=None).isoformat(),
                "text": text,
            }
        )

    def pump(self, lines: "queue.Queue[tuple[str, str]]") -> None:
        """Take every waiting output line; flush if the interval has passed."""
        while True:
            try:
                node, text = lines.get_nowait()
            except queue.Empty:
                break
            event = parse_event(text)
            if event is None:
                self._line(node, text)
                continue
            try:
                self._handle(node, event)
            except (KeyError, TypeError, ValueError) as exc:  # rank output is untrusted input
                self.agent_line(
                    f"ignored a malformed {str(event.get('type'))[:40]!r} event "
                    f"from {node}: {str(exc)[:200]}"
                )
        now = time.monotonic()
        if now - self._last_flush >= self.interval_s and now >= self._retry_at:
            self.flush(tolerate=True)

    def _handle(self, node: str, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "metric" and (event.get("value") is not None or event.get("nonfinite")):
            # Rank 0 (the parameter server) reports the task's global metrics: no rank.
            rank, seq = event.get("rank") or None, self._metric_seq.get(node, 0)
            metric = {
                "name": event["name"],
                "value": event["value"],
                "nonfinite": event.get("nonfinite"),
                "step": event.get("step", 0),
                "epoch": event.get("epoch", 0),
                "rank": rank,
                # Numbered per node, as its lines: a report sent again stores it once.
                "attempt": self.attempt,
                "node": node,
                "seq": seq,
            }
            try:  # as the API will, so one bad metric cannot lose its whole batch
                MetricIn.model_validate(metric)
            except ValidationError as exc:
                raise ValueError(f"metric refused: {exc.errors()[0]['msg']}") from None
            self._metric_seq[node] = seq + 1
            self._metrics.append(metric)
        elif kind == "progress":
            done = event["step"]
            total = max(1, event["epochs"] * event["steps_per_epoch"])
            if not self._progressed:  # the first step is news: send it at once
                self._last_flush, self._progressed = 0.0, True
            self._progress = (min(1.0, done / total), int(event["epoch"]))
        elif kind == "checkpoint":
            self._upload(node, event)
        elif kind == "checkpoint_part":
            self._upload_part(node, event)
        elif kind in ("alarm", "guard") and node == node_name(0):  # the PS speaks for the task
            try:
                alarm = Alarm(
                    reason=event["reason"], group=event["group"], attempt=self.attempt, kind=kind
                )
            except ValidationError as exc:
                raise ValueError(f"{kind} refused: {exc.errors()[0]['msg']}") from None
            self.api.alarm(
                self.task_id,
                reason=alarm.reason,
                group=alarm.group,
                attempt=alarm.attempt,
                kind=alarm.kind,
            )

        elif kind == "trial" and node == node_name(0):  # a plan's trial timings
            try:
                result = TrialResult.model_validate(event["result"]).model_dump(mode="json")
            except ValidationError as exc:
                raise ValueError(f"trial refused: {exc.errors()[0]['msg']}") from None
            try:
                self.api.trial(self.task_id, result)
            except httpx.HTTPStatusError as exc:
                self._refused(exc, f"refused the trial timings from {node}")

    def _upload(self, node: str, event: dict[str, Any]) -> None:
        path, rank_dir = Path(str(event.get("path"))), self.rank_dirs.get(node)
        try:
            if rank_dir is None or path.parent != rank_dir / "checkpoints":
                raise PermissionError(f"not in {node}'s checkpoint folder")
            body = read_rank_file(rank_dir, "checkpoints", path.name)
        except (PermissionError, ValueError) as exc:
            self.agent_line(f"refused checkpoint {str(path)[:200]!r} from {node}: {exc}")
            return
        provenance = self._provenance(node, path.name, event.get("provenance"))
        parts = event.get("parts")
        try:
            checkpoint_id = self.api.checkpoint(
                self.task_id,
                name=path.name,
                epoch=int(event["epoch"]),
                step=int(event["step"]),
                body=body,
                attempt=self.attempt,
                parts=[str(p) for p in parts] if isinstance(parts, list) else None,
            )
        except Conflict as exc:
            self.agent_line(f"refused checkpoint {path.name!r} from {node}: {exc}")
            return
        except httpx.HTTPStatusError as exc:
            self._refused(exc, f"refused checkpoint {path.name!r} from {node}")
            return
        if provenance is None:
            return
        try:
            self.api.provenance(self.task_id, checkpoint_id, provenance)
        except httpx.HTTPStatusError as exc:
            self._refused(
                exc,
                f"refused the shard provenance of {path.name!r} from {node} "
                "(the checkpoint is kept)",
            )

    def _upload_part(self, node: str, event: dict[str, Any]) -> None:
        """Upload a file of a checkpoint's state folder its worker wrote (a sharded group's
        member, a sync source worker, a group leader: ``<its checkpoints>/<name>.dcp/<file>``),
        from that worker's own folder only."""
        path, rank_dir = Path(str(event.get("path"))), self.rank_dirs.get(node)
        part = f"{path.parent.name}/{path.name}"
        try:
            if rank_dir is None or path.parent.parent != rank_dir / "checkpoints":
                raise PermissionError(f"not in {node}'s checkpoint folder")
            sharded_state.check_part(part)
            body = read_rank_file(rank_dir, f"checkpoints/{path.parent.name}", path.name)
        except (PermissionError, ValueError) as exc:
            self.agent_line(f"refused checkpoint part {str(path)[:200]!r} from {node}: {exc}")
            return
        try:
            self.api.checkpoint_part(self.task_id, part=part, body=body, attempt=self.attempt)
        except Conflict as exc:
            self.agent_line(f"refused checkpoint part {part!r} from {node}: {exc}")
        except httpx.HTTPStatusError as exc:
            self._refused(exc, f"refused checkpoint part {part!r} from {node}")

    def _refused(self, exc: httpx.HTTPStatusError, what: str) -> None:
        """Log a request the API refused (4xx) as ``what: status body``; re-raise a 5xx."""
        if not exc.response.is_client_error:
            raise exc
        self.agent_line(f"{what}: {exc.response.status_code} {exc.response.text[:200]}")

    def _provenance(self, node: str, name: str, given: Any) -> dict[str, Any] | None:
        """A checkpoint event's shard provenance as the API takes it, or None: none given,
        not from the parameter server (which alone records it), or malformed (logged; the
        checkpoint is kept either way)."""
        if given is None:
            return None
        try:
            if node != node_name(0):
                raise ValueError("only the parameter server records shard provenance")
            return Provenance.model_validate(given).model_dump()
        except ValidationError as exc:
            reason = str(exc.errors()[0]["msg"])[:200]
        except ValueError as exc:
            reason = str(exc)
        self.agent_line(f"refused the shard provenance of {name!r} from {node}: {reason}")
        return None

    def flush(self, *, tolerate: bool = False) -> None:
        """Send everything buffered now: log lines, metrics and the latest progress in one
        request (`Report`), none when nothing is buffered; more than a report may carry
        (`REPORT_MAX_ITEMS` lines or metrics) goes in several, in order, the progress with
        the last. What was sent leaves the buffers; a failed request keeps the rest for the
        next flush. (One report of everything was refused, 422, once a burst of output
        passed the limit, and every flush after it sent the same report again: a task's
        logs and metrics from that agent stopped.)

        With ``tolerate`` (the flushes while the ranks run, :meth:`pump`), a failure the API
        can recover from (a transport error or a 5xx, after the client's retries) is logged
        and the next flush comes ``OUTAGE_RETRY_S`` later; it raises only once every flush
        has failed for ``outage_limit_s`` seconds (counted from the first failing flush's
        start). Without it, or for a 4xx, it raises (httpx.TransportError,
        httpx.HTTPStatusError). A restart of the API or its database so no longer fails a
        running part through its reports (it failed every part that flushed during one, the
        client's retries of a 5xx lasting 2.5 s: bench/fleet_faults.py). The client tries
        a report only `CALLER_RETRIES` more times (0.5 and 1 s later), so a flush returns
        to the watch loop within seconds and this clock decides; the part's other calls
        (checkpoint uploads, alarms, the rendezvous) ride out an outage in the client's own
        retries (`run_agent`: 30, about 137 s of waits).
        """
        began = time.monotonic()  # the client's retries of a failing flush count as outage
        try:
            self._send()
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            now = time.monotonic()
            self._failing_since = self._failing_since or began
            if (
                not (tolerate and unanswered(exc))
                or now - self._failing_since > self.outage_limit_s
            ):
                raise
            self._retry_at = now + OUTAGE_RETRY_S
            log.warning(
                "task %s: report not sent (%s), kept for %.0f s more; next try in %.0f s",
                self.task_id,
                exc,
                self.outage_limit_s - (now - self._failing_since),
                OUTAGE_RETRY_S,
            )
            return
        self._failing_since, self._retry_at = None, 0.0

    def flush_last(self) -> None:
        """The last flush, once the ranks have ended: everything still buffered is sent,
        riding out an outage as the flushes while they ran do (tried again every
        `OUTAGE_RETRY_S`). Raises as :meth:`flush` once every flush has failed for
        ``outage_limit_s`` seconds, or at once for a 4xx."""
        while True:
            self.flush(tolerate=True)
            if not (self._lines or self._metrics or self._progress is not None):
                return
            time.sleep(max(0.0, self._retry_at - time.monotonic()))

    def _send(self) -> None:
        self._last_flush = time.monotonic()
        if not (self._lines or self._metrics or self._progress is not None):
            return
        progress = None
        if self._progress is not None:
            done, epoch = self._progress
            progress = {"progress": done, "epoch": epoch, "attempt": self.attempt}
        while True:
            lines, metrics = self._lines[:REPORT_MAX_ITEMS], self._metrics[:REPORT_MAX_ITEMS]
            last = len(lines) == len(self._lines) and len(metrics) == len(self._metrics)
            self.api.report(
                self.task_id, lines=lines, metrics=metrics, progress=progress if last else None
            )
            del self._lines[: len(lines)], self._metrics[: len(metrics)]
            if last:
                break
        self._progress = None
