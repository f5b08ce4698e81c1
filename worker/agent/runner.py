"""Runs one sub-task (a task's share on this agent's group) from claim to result."""

import logging
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from backend.scheduler.payload import SubTaskPayload
from worker.agent.client import Conflict, InternalApi
from worker.agent.processes import (
    ProcessSet,
    RunningRegistry,
    WarmPool,
    error_summary,
    start_rank,
)
from worker.agent.reporter import Reporter
from worker.config import AgentSettings
from worker.engine.local import rank_env
from worker.engine.spec import GroupPlan, RunSpec

log = logging.getLogger(__name__)
LIVE = {"SCHEDULED", "RUNNING"}
Outcome = tuple[bool, str, str]  # (succeeded, detail, cause)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class SubTaskRunner:
    """Claims the sub-task, starts the group's processes, reports until they end.

    The agent that hosts the parameter server picks the rendezvous port and
    publishes it through the backend; the other groups' agents wait for it.
    A later attempt's parameter server resumes from the checkpoint the backend
    names. Processes stop as soon as the task is no longer SCHEDULED or
    RUNNING in this attempt (cancelled, failed, or restarted elsewhere).
    """

    def __init__(self, settings: AgentSettings, api: InternalApi, agent_id: int,
                 registry: RunningRegistry | None = None, pool: WarmPool | None = None) -> None:
        self.settings, self.api, self.agent_id = settings, api, agent_id
        self.registry = registry or RunningRegistry()
        self.pool = pool

    def run(self, raw: dict[str, Any]) -> str:
        """Run one validated payload to its end; "ignored" for a sub-task already taken."""
        payload = SubTaskPayload.model_validate(raw)
        try:
            self.api.claim(payload.sub_task_id, agent_id=self.agent_id,
                           host=self.settings.advertise_addr, attempt=payload.attempt)
        except Conflict as exc:
            log.info("ignoring sub-task %s: %s", payload.sub_task_id, exc)
            if exc.field == "agent_id":
                # Drained or disabled by an admin: the backend publishes the sub-task again;
                # stay off the queue for a while so an active agent of the group takes it.
                time.sleep(self.settings.heartbeat_interval_s)
            return "ignored"
        # An earlier attempt's processes of this task on this host end first.
        self.registry.wait_gone(payload.task_id, timeout_s=30.0)
        procs = ProcessSet()
        reporter = Reporter(self.api, payload.task_id, group=payload.group.name,
                            attempt=payload.attempt)
        self.registry.add(payload.task_id, procs)
        try:
            succeeded, detail, cause = self._run_claimed(payload, procs, reporter)
        except Exception:
            succeeded, detail, cause = False, traceback.format_exc(), "infra"
            reporter.agent_line(f"agent error: {detail}")
        finally:
            procs.kill_all()
            procs.drain_readers()
            reporter.pump(procs.lines)
            reporter.flush()
            self.registry.remove(payload.task_id, procs)
        self.api.finished(payload.sub_task_id, succeeded=succeeded, detail=detail, cause=cause)
        return "succeeded" if succeeded else "failed"

    def _run_claimed(
        self, payload: SubTaskPayload, procs: ProcessSet, reporter: Reporter
    ) -> Outcome:
        spec_path = self._write_spec(payload)
        addr, port = self._rendezvous(payload)
        ranks = ([0] if payload.hosts_parameter_server else []) + payload.ranks
        spec = RunSpec.model_validate_json(spec_path.read_text())
        for rank in ranks:
            env = rank_env(spec, rank, addr, port)
            env["POLYTRAIN_DIST_TIMEOUT_S"] = str(self.settings.dist_timeout_s)
            procs.add(rank, self.pool.start(spec_path, env) if self.pool
                      else start_rank(spec_path, env))
        reporter.agent_line(f"attempt {payload.attempt}: started ranks {ranks} on "
                            f"{self.settings.advertise_addr}, rendezvous {addr}:{port}")
        return self._watch(payload, procs, reporter)

    def _watch(self, payload: SubTaskPayload, procs: ProcessSet, reporter: Reporter
               ) -> Outcome:
        last_status_check = 0.0
        while True:
            reporter.pump(procs.lines)
            failed = procs.failed()
            if failed is not None:
                return False, (f"{failed.node} exited with code {failed.popen.returncode}: "
                               f"{error_summary(failed.tail)}\n" + "\n".join(failed.tail[-20:])
                               ), procs.cause(failed)
            if procs.all_succeeded():
                return True, "all processes exited cleanly", "user"
            if time.monotonic() - last_status_check > 1.0:
                last_status_check = time.monotonic()
                status, attempt = self.api.task_state(payload.task_id)
                if status not in LIVE or attempt != payload.attempt:
                    reporter.agent_line(f"task is {status} in attempt {attempt}: stopping "
                                        f"attempt {payload.attempt} of this group's processes")
                    return False, f"stopped: task is {status} in attempt {attempt}", "stopped"
            time.sleep(0.1)

    def _resume_from(self, payload: SubTaskPayload, workdir: Path) -> str | None:
        """Download the checkpoint to resume from (parameter server host only), else None."""
        if not payload.hosts_parameter_server or payload.resume_checkpoint_id is None:
            return None
        path = workdir / f"resume-{payload.resume_checkpoint_id}.pt"
        path.write_bytes(self.api.fetch_checkpoint(payload.task_id,
                                                   payload.resume_checkpoint_id))
        return str(path)

    def _write_spec(self, payload: SubTaskPayload) -> Path:
        workdir = Path(self.settings.data_dir).resolve() / "agent" / f"task-{payload.task_id}"
        if payload.attempt > 1:
            workdir = workdir / f"attempt-{payload.attempt}"
        workdir.mkdir(parents=True, exist_ok=True)
        code_path = workdir / f"code-{payload.group_index}.py"
        code_path.write_bytes(self.api.code(payload.task_id))
        spec = RunSpec(
            task_id=payload.task_id, code=str(code_path), epochs=payload.epochs,
            global_batch_size=payload.global_batch_size, seed=payload.seed,
            groups=[GroupPlan(**g.model_dump()) for g in payload.groups],
            split_policy=payload.split_policy, **payload.engine,
            checkpoint_dir=str(workdir / "checkpoints"),
            resume_from=self._resume_from(payload, workdir),
        )
        spec_path = workdir / f"spec-{payload.group_index}.json"
        spec_path.write_text(spec.model_dump_json(indent=2))
        return spec_path

    def _rendezvous(self, payload: SubTaskPayload) -> tuple[str, int]:
        if payload.hosts_parameter_server:
            addr, port = self.settings.advertise_addr, free_port()
            self.api.set_rendezvous(payload.task_id, addr, port, attempt=payload.attempt)
            return addr, port
        deadline = time.monotonic() + self.settings.rendezvous_timeout_s
        while time.monotonic() < deadline:
            found = self.api.rendezvous(payload.task_id)
            if found["status"] not in LIVE or found.get("attempt", payload.attempt) != \
                    payload.attempt:
                raise RuntimeError(f"task is {found['status']} before rendezvous")
            if found["master_port"]:
                return str(found["master_addr"]), int(found["master_port"])
            time.sleep(0.1)
        raise TimeoutError(f"no parameter server rendezvous within "
                           f"{self.settings.rendezvous_timeout_s:.0f} s")
