"""Runs one sub-task (a task's share on this agent's group) from claim to result."""

import logging
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from backend.scheduler.payload import SubTaskPayload
from worker.agent.client import Conflict, InternalApi
from worker.agent.processes import ProcessSet, RunningRegistry, error_summary
from worker.agent.reporter import Reporter
from worker.config import AgentSettings
from worker.engine.local import rank_env, start_rank_process
from worker.engine.spec import GroupPlan, RunSpec

log = logging.getLogger(__name__)
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class SubTaskRunner:
    """Claims the sub-task, starts the group's processes, reports until they end.

    The agent that hosts the parameter server picks the rendezvous port and
    publishes it through the backend; the other groups' agents wait for it.
    """

    def __init__(self, settings: AgentSettings, api: InternalApi, agent_id: int,
                 registry: RunningRegistry | None = None) -> None:
        self.settings, self.api, self.agent_id = settings, api, agent_id
        self.registry = registry or RunningRegistry()

    def run(self, raw: dict[str, Any]) -> str:
        payload = SubTaskPayload.model_validate(raw)
        try:
            self.api.claim(payload.sub_task_id, agent_id=self.agent_id,
                           host=self.settings.advertise_addr)
        except Conflict as exc:
            log.info("ignoring sub-task %s: %s", payload.sub_task_id, exc)
            return "ignored"
        procs = ProcessSet()
        reporter = Reporter(self.api, payload.task_id, group=payload.group.name)
        self.registry.add(payload.task_id, procs)
        try:
            succeeded, detail = self._run_claimed(payload, procs, reporter)
        except Exception:
            succeeded, detail = False, traceback.format_exc()
            reporter.agent_line(f"agent error: {detail}")
        finally:
            procs.kill_all()
            self.registry.remove(payload.task_id)
            procs.drain_readers()
            reporter.pump(procs.lines)
            reporter.flush()
        self.api.finished(payload.sub_task_id, succeeded=succeeded, detail=detail)
        return "succeeded" if succeeded else "failed"

    def _run_claimed(
        self, payload: SubTaskPayload, procs: ProcessSet, reporter: Reporter
    ) -> tuple[bool, str]:
        spec_path = self._write_spec(payload)
        addr, port = self._rendezvous(payload)
        ranks = ([0] if payload.hosts_parameter_server else []) + payload.ranks
        spec = RunSpec.model_validate_json(spec_path.read_text())
        for rank in ranks:
            env = rank_env(spec, rank, addr, port)
            env["POLYTRAIN_DIST_TIMEOUT_S"] = str(self.settings.dist_timeout_s)
            procs.add(rank, start_rank_process(spec_path, env))
        reporter.agent_line(f"started ranks {ranks} on {self.settings.advertise_addr}, "
                            f"rendezvous {addr}:{port}")
        return self._watch(payload, procs, reporter)

    def _watch(self, payload: SubTaskPayload, procs: ProcessSet, reporter: Reporter
               ) -> tuple[bool, str]:
        last_status_check = 0.0
        while True:
            reporter.pump(procs.lines)
            failed = procs.failed()
            if failed is not None:
                return False, (f"{failed.node} exited with code {failed.popen.returncode}: "
                               f"{error_summary(failed.tail)}\n" + "\n".join(failed.tail[-20:]))
            if procs.all_succeeded():
                return True, "all processes exited cleanly"
            if time.monotonic() - last_status_check > 1.0:
                last_status_check = time.monotonic()
                status = self.api.task_status(payload.task_id)
                if status in TERMINAL:
                    reporter.agent_line(f"task is {status}: stopping this group's processes")
                    return False, f"stopped: task is {status}"
            time.sleep(0.2)

    def _write_spec(self, payload: SubTaskPayload) -> Path:
        workdir = Path(self.settings.data_dir).resolve() / "agent" / f"task-{payload.task_id}"
        workdir.mkdir(parents=True, exist_ok=True)
        code_path = workdir / f"code-{payload.group_index}.py"
        code_path.write_bytes(self.api.code(payload.task_id))
        spec = RunSpec(
            task_id=payload.task_id, code=str(code_path), epochs=payload.epochs,
            global_batch_size=payload.global_batch_size, seed=payload.seed,
            groups=[GroupPlan(**g.model_dump()) for g in payload.groups],
            checkpoint_dir=str(workdir / "checkpoints"),
        )
        spec_path = workdir / f"spec-{payload.group_index}.json"
        spec_path.write_text(spec.model_dump_json(indent=2))
        return spec_path

    def _rendezvous(self, payload: SubTaskPayload) -> tuple[str, int]:
        if payload.hosts_parameter_server:
            addr, port = self.settings.advertise_addr, free_port()
            self.api.set_rendezvous(payload.task_id, addr, port)
            return addr, port
        deadline = time.monotonic() + self.settings.rendezvous_timeout_s
        while time.monotonic() < deadline:
            found = self.api.rendezvous(payload.task_id)
            if found["status"] in TERMINAL:
                raise RuntimeError(f"task is {found['status']} before rendezvous")
            if found["master_port"]:
                return str(found["master_addr"]), int(found["master_port"])
            time.sleep(0.5)
        raise TimeoutError(f"no parameter server rendezvous within "
                           f"{self.settings.rendezvous_timeout_s:.0f} s")
