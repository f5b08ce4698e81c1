"""Runs one sub-task (a task's part of this agent's group, booked for this agent) from claim
to result."""

import logging
import queue
import secrets
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx

from contracts import sharded_state
from contracts.agent_api import ACTIVE_STATUSES
from contracts.packages import Environment
from contracts.payload import SubTaskPayload
from worker.agent.client import Conflict, InternalApi, unanswered
from worker.agent.environments import BuildStopped, EnvironmentBuildFailed, EnvironmentCache
from worker.agent.netpolicy import NetworkPolicyUnavailable
from worker.agent.processes import (
    ProcessSet,
    RunningRegistry,
    Slot,
    WarmPool,
    error_summary,
    start_slot,
)
from worker.agent.reporter import OUTAGE_LIMIT_S, OUTAGE_RETRY_S, Reporter
from worker.agent.sandbox import Sandbox, link_environment, write_rank_file
from worker.agent.states import StateWatch, TaskStates, stop_reason
from worker.agent.uids import Lease
from worker.config import AgentSettings
from worker.engine.ranks import RankProcess, allocator_env, node_name, rank_env
from worker.engine.report import rendezvous_port
from worker.engine.spec import RunSpec

log = logging.getLogger(__name__)
Outcome = tuple[bool, str, str]  # (succeeded, detail, cause)
OUTCOME_LIMIT_S = 600.0
"""How long an agent keeps trying to report a part's outcome to an API that cannot answer
(`SubTaskRunner._finished`), beyond its client's retries: longer than any other call, as
nothing else ends the part's task while its agent lives."""

# How an allocation beyond RLIMIT_DATA shows in a rank's output (Python, torch, C++).
MEMORY_ERRORS = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "std::bad_alloc")


class Peers:
    """The hosts the ranks of one sub-task may reach, kept current: the hosts its task's
    agents claimed the current attempt's sub-tasks from (`worker.agent.netpolicy`).

    Agents claim one after another, so the list grows until every sub-task is
    claimed; each change re-admits the sub-task's sandbox uids (`leases`).
    """

    REFRESH_S = 0.5

    def __init__(self, api: InternalApi, task_id: int, attempt: int, hosts: list[str]) -> None:
        self.api, self.task_id, self.attempt = api, task_id, attempt
        self.hosts, self.complete = sorted(set(hosts)), False
        self.leases: list[Lease] = []
        self._checked = 0.0

    def refresh(self) -> None:
        """Ask the backend (at most every `REFRESH_S` seconds, until complete) and re-admit.

        Stops at another attempt (this one's ranks are being stopped); a rule the
        kernel refused is logged and tried again at the next refresh, so a
        running task is not failed for it.
        """
        if self.complete or time.monotonic() - self._checked < self.REFRESH_S:
            return
        self._checked = time.monotonic()
        found = self.api.rendezvous(self.task_id)
        if found.get("attempt", self.attempt) != self.attempt:
            self.complete = True
            return
        hosts = sorted(set(self.hosts) | set(found.get("peer_hosts") or []))
        if hosts != self.hosts:
            try:
                for lease in self.leases:
                    try:
                        lease.admit(self.task_id, hosts)
                    except RuntimeError:  # released: its rank has ended
                        pass
            except NetworkPolicyUnavailable:
                log.exception("task %s: peers %s not admitted yet", self.task_id, hosts)
                return
            self.hosts = hosts
        self.complete = bool(found.get("peers_complete"))


class SubTaskRunner:
    """Claims the sub-task, starts the group's processes, reports until they end.

    On the agent that hosts the parameter server, rank 0 binds the rendezvous
    port and reports it; the agent publishes it through the backend and the
    other groups' agents wait for it.
    A later attempt's parameter server resumes from the checkpoint the backend
    names. Processes stop as soon as the task is no longer SCHEDULED or
    RUNNING in this attempt (cancelled, failed, or restarted elsewhere).
    """

    def __init__(
        self,
        settings: AgentSettings,
        api: InternalApi,
        agent_id: int,
        sandbox: Sandbox,
        registry: RunningRegistry | None = None,
        pool: WarmPool | None = None,
        environments: EnvironmentCache | None = None,
        states: TaskStates | None = None,
    ) -> None:
        """`states`: what the agent knows of its tasks' states (shared with its heartbeats,
        which name the watched tasks and feed their answers in); each part long-polls its
        task's state into it (`StateWatch`)."""
        self.settings, self.api, self.agent_id = settings, api, agent_id
        self.states = states or TaskStates()
        self.sandbox = sandbox
        self.registry = registry or RunningRegistry()
        self.pool = pool
        self.environments = environments or EnvironmentCache(
            Path(settings.data_dir).resolve() / "agent" / "envs",
            settings.package_index(),
            max_bytes=settings.env_cache_max_mb * 1024 * 1024,
        )

    def run(self, payload: SubTaskPayload) -> str:
        """Run one payload (validated by the caller, once) to its end; "ignored" for a
        sub-task already taken."""
        try:
            self._claim(payload)
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
        reporter = Reporter(
            self.api, payload.task_id, group=payload.group.name, attempt=payload.attempt
        )
        self.registry.add(payload.task_id, procs)
        held = ExitStack()  # what the ranks use until they are gone (their environment)
        # A cancellation or a restart comes through the part's long-poll, not a poll.
        watch = StateWatch(self.api, self.states, payload.task_id, payload.attempt).start()
        try:
            succeeded, detail, cause = self._run_claimed(payload, procs, reporter, held)
        except Exception:
            succeeded, detail, cause = False, traceback.format_exc(), "infra"
            reporter.agent_line(f"agent error: {detail}")
        finally:
            procs.kill_all()
            held.close()
            procs.drain_readers()
            try:
                reporter.pump(procs.lines)
                reporter.flush_last()
            except Exception:  # the outcome must still be reported, or the task hangs
                log.exception("task %s: last output not sent", payload.task_id)
            watch.close()  # before the registry lets a later attempt's part of the task in
            self.registry.remove(payload.task_id, procs)
        self._finished(payload, succeeded=succeeded, detail=detail, cause=cause)
        return "succeeded" if succeeded else "failed"

    def _finished(
        self, payload: SubTaskPayload, *, succeeded: bool, detail: str, cause: str
    ) -> None:
        """Report the part's outcome, tried again while the API cannot answer for up to
        `OUTCOME_LIMIT_S` (:func:`ride_out`): an outcome lost leaves the part RUNNING, and
        its task waiting, with no agent running it. The same outcome sent again changes
        nothing (`fate.finish`)."""
        ride_out(
            lambda: self.api.finished(
                payload.sub_task_id, succeeded=succeeded, detail=detail, cause=cause
            ),
            f"outcome of sub-task {payload.sub_task_id}",
            OUTCOME_LIMIT_S,
        )

    def _claim(self, payload: SubTaskPayload) -> None:
        """Claim the part, tried again with the same claim id while the API cannot answer,
        for up to `OUTAGE_LIMIT_S` (:func:`ride_out`): a claim taken whose answer was lost
        in an outage is answered when the API is back, where giving up would leave the
        part claimed and not run. Raises Conflict (refused), or the last error after the
        limit or for a 4xx."""
        claim_id = secrets.token_hex(16)
        ride_out(
            lambda: self.api.claim(
                payload.sub_task_id,
                agent_id=self.agent_id,
                host=self.settings.advertise_addr,
                attempt=payload.attempt,
                preparing=payload.environment is not None,
                claim_id=claim_id,
            ),
            f"claim of sub-task {payload.sub_task_id}",
            OUTAGE_LIMIT_S,
        )

    def _run_claimed(
        self, payload: SubTaskPayload, procs: ProcessSet, reporter: Reporter, held: ExitStack
    ) -> Outcome:
        """Build or find the code version's environment (a phase of its own: the task is
        not started until it is there), start each rank in its own sandboxed slot and
        directory, then watch them."""
        code = self.api.code(payload.task_id)
        task_dir = self._task_dir(payload)
        peers = Peers(self.api, payload.task_id, payload.attempt, [self.settings.advertise_addr])
        site: Path | None = None
        if payload.environment is not None:
            try:
                site = self._prepare(payload, payload.environment, reporter, held)
            except EnvironmentBuildFailed as exc:
                reporter.agent_line(str(exc))
                return False, str(exc), "user"
            except (BuildStopped, Conflict) as exc:  # cancelled or restarted meanwhile
                reporter.agent_line(f"not starting the ranks: {exc}")
                return False, f"stopped: {exc}", "stopped"

        def start(rank: int, addr: str, port: int) -> None:
            # A sharded worker's allocator must be there when its interpreter starts: a
            # fresh one, not a warm one (worker.engine.ranks.allocator_env).
            preload = allocator_env(
                rank in payload.ranks and _sharded(payload),
                {"POLYTRAIN_JEMALLOC": self.settings.jemalloc},
            )
            if preload:
                slot = start_slot(self.sandbox, env=preload)
            else:
                slot = self.pool.acquire() if self.pool else start_slot(self.sandbox)
            if site is not None:
                link_environment(slot.rank_dir, site)
            peers.leases.append(slot.lease)
            procs.add(rank, slot.popen)
            reporter.rank_dirs[node_name(rank)] = slot.rank_dir
            link = task_dir / f"rank-{rank}"
            link.unlink(missing_ok=True)  # a redelivered attempt on this host
            link.symlink_to(slot.rank_dir)
            self._begin(payload, slot, rank, code, addr, port, peers.hosts)

        if payload.hosts_parameter_server:
            # Rank 0 binds a port the kernel picks and reports it (engine.distributed.
            # rendezvous_store): no other process on this host can take it first.
            addr = self.settings.advertise_addr
            start(0, addr, 0)
            port = self._await_rendezvous(payload, procs, reporter)
            if port is None:  # rank 0 ended first: _watch reports why
                return self._watch(payload, procs, reporter, peers)
            self.api.set_rendezvous(payload.task_id, addr, port, attempt=payload.attempt)
        else:
            addr, port = self._rendezvous(payload)
            peers.hosts = sorted({*peers.hosts, addr})
        # The parameter server's other shards (ps_shards) run beside it.
        servers = [0, *payload.shard_ranks] if payload.hosts_parameter_server else []
        for rank in servers[1:] + payload.ranks:
            start(rank, addr, port)
        ranks = servers + payload.ranks
        reporter.agent_line(
            f"attempt {payload.attempt}: started ranks {ranks} on "
            f"{self.settings.advertise_addr}, rendezvous {addr}:{port}"
        )
        return self._watch(payload, procs, reporter, peers)

    def _prepare(
        self, payload: SubTaskPayload, env: Environment, reporter: Reporter, held: ExitStack
    ) -> Path:
        """The code version's environment on this host (built if it has none, the installer's
        lines flushed to the task's log as they come), reported ready; then wait until every
        part of the task has it (the task is RUNNING), so no rank waits at the rendezvous on
        a host still building. The environment's folder, held until the ranks are gone.

        Raises:
            EnvironmentBuildFailed: it cannot be built.
            BuildStopped, Conflict: the task is no longer this attempt's active task.
        """
        flushed = [time.monotonic()]

        def say(line: str) -> None:
            reporter.agent_line(line)
            if time.monotonic() - flushed[0] >= 1.0:  # live, at most a request a second
                flushed[0] = time.monotonic()
                reporter.flush(tolerate=True)

        def stop() -> str | None:
            return stop_reason(self.states.get(payload.task_id), payload.attempt)

        lease = self.environments.prepare(env, say, stop)
        held.callback(lease.release)
        how = f"built in {lease.seconds:.1f} s" if lease.built else "cached"
        detail = f"environment {env.lock_hash[:12]} {how}"
        reporter.agent_line(detail)
        self.states.set(payload.task_id, *self.api.ready(payload.sub_task_id, detail=detail))
        running = ("RUNNING", payload.attempt)
        while True:  # until every part is ready: the long-poll brings RUNNING
            state = self.states.wait_for(
                payload.task_id,
                lambda known: known == running or stop_reason(known, payload.attempt) is not None,
                timeout_s=1.0,
            )
            reason = stop_reason(state, payload.attempt)
            if reason is not None:
                raise BuildStopped(reason)
            if state == running:
                return lease.site

    def _await_rendezvous(
        self, payload: SubTaskPayload, procs: ProcessSet, reporter: Reporter
    ) -> int | None:
        """The port rank 0's rendezvous store listens on, from its `rendezvous` event;
        None if rank 0 ended first. Every other line is reported as it comes.

        Raises TimeoutError after `rendezvous_timeout_s` seconds without it.
        """
        deadline = time.monotonic() + self.settings.rendezvous_timeout_s
        seen: queue.Queue[tuple[str, str]] = queue.Queue()
        try:
            while time.monotonic() < deadline:
                try:
                    node, text = procs.lines.get(timeout=0.1)
                except queue.Empty:
                    if not procs.alive_ranks():
                        return None
                    continue
                port = rendezvous_port(text) if node == node_name(0) else None
                if port is not None:
                    return port
                seen.put((node, text))
            raise TimeoutError(
                f"rank 0 reported no rendezvous port within "
                f"{self.settings.rendezvous_timeout_s:.0f} s"
            )
        finally:
            try:
                reporter.pump(seen)
            except Exception:  # never hide why the wait ended
                log.exception("task %s: rank output not sent", payload.task_id)

    def _begin(
        self,
        payload: SubTaskPayload,
        slot: Slot,
        rank: int,
        code: bytes,
        addr: str,
        port: int,
        peers: list[str],
    ) -> None:
        """Write the rank's code and spec into its directory and start it."""
        spec = self._spec(payload, slot, rank, code)
        spec_path = write_rank_file(
            slot.rank_dir, "spec.json", spec.model_dump_json(indent=2).encode()
        )
        env = rank_env(spec, rank, addr, port)
        if rank in payload.ranks:  # its index among this host's ranks of the group
            env["LOCAL_RANK"] = str(payload.ranks.index(rank))
        env["POLYTRAIN_DIST_TIMEOUT_S"] = str(self.settings.dist_timeout_s)
        if self.settings.datasets_dir:
            env["POLYTRAIN_DATASETS"] = str(Path(self.settings.datasets_dir).resolve())
        slot.begin(
            spec_path,
            env,
            task_id=payload.task_id,
            peers=peers,
            memory_limit_mb=payload.limits.memory_limit_mb,
        )

    def _watch(
        self, payload: SubTaskPayload, procs: ProcessSet, reporter: Reporter, peers: Peers
    ) -> Outcome:
        deadline = time.monotonic() + payload.limits.max_runtime_s
        while True:
            reporter.pump(procs.lines)
            peers.refresh()
            failed = procs.failed()
            if failed is not None:
                return self._failure(payload, procs, failed)
            if procs.all_succeeded():
                return True, "all processes exited cleanly", "user"
            if time.monotonic() > deadline:
                limit = f"max_runtime_s={payload.limits.max_runtime_s} exceeded"
                reporter.agent_line(f"{limit}: stopping attempt {payload.attempt}")
                return False, f"{limit}: the task ran longer than its wall-clock limit", "user"
            # Learned through the part's long-poll or a heartbeat's answer (`TaskStates`).
            reason = stop_reason(self.states.get(payload.task_id), payload.attempt)
            if reason is not None:
                reporter.agent_line(
                    f"{reason}: stopping attempt {payload.attempt} of this group's processes"
                )
                return False, f"stopped: {reason}", "stopped"
            time.sleep(0.1)

    @staticmethod
    def _failure(payload: SubTaskPayload, procs: ProcessSet, failed: RankProcess) -> Outcome:
        """The outcome of a failed rank; one that ran out of its memory limit is named so."""
        summary = error_summary(failed.tail)
        detail = f"{failed.node} exited with code {failed.returncode}: {summary}\n" + "\n".join(
            failed.tail[-20:]
        )
        if any(marker in line for line in failed.tail for marker in MEMORY_ERRORS):
            limit = f"memory_limit_mb={payload.limits.memory_limit_mb} exceeded"
            return False, f"{limit} on {failed.node}: {detail}", "user"
        return False, detail, procs.cause(failed)

    def _task_dir(self, payload: SubTaskPayload) -> Path:
        """`agent/task-<id>[/attempt-<n>]/`: links `rank-<r>` to each rank's directory."""
        task_dir = Path(self.settings.data_dir).resolve() / "agent" / f"task-{payload.task_id}"
        if payload.attempt > 1:
            task_dir = task_dir / f"attempt-{payload.attempt}"
        task_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return task_dir

    def _spec(self, payload: SubTaskPayload, slot: Slot, rank: int, code: bytes) -> RunSpec:
        code_path = write_rank_file(slot.rank_dir, "code.py", code)
        resume, state_dir = None, None
        checkpoint_id = payload.resume_checkpoint_id
        if rank == 0 and checkpoint_id is not None:
            resume = str(
                write_rank_file(
                    slot.rank_dir,
                    f"resume-{checkpoint_id}.pt",
                    self.api.fetch_checkpoint(payload.task_id, checkpoint_id),
                )
            )
            # The model's slices, where the parameter server's owners wrote it so.
            state_dir = self._state_folder(payload.task_id, checkpoint_id, slot.rank_dir, None)
        elif checkpoint_id is not None and rank in payload.ranks:  # a compute worker's state
            state_dir = self._state_folder(
                payload.task_id, checkpoint_id, slot.rank_dir, payload.group_index
            )
        return RunSpec(
            task_id=payload.task_id,
            code=str(code_path),
            epochs=payload.epochs,
            global_batch_size=payload.global_batch_size,
            seed=payload.seed,
            groups=payload.groups,
            split_policy=payload.split_policy,
            **payload.engine,
            checkpoint_dir=str(slot.rank_dir / "checkpoints"),
            resume_from=resume,
            resume_state_dir=state_dir,
        )

    def _state_folder(
        self, task_id: int, checkpoint_id: int, rank_dir: Path, group: int | None
    ) -> str | None:
        """Download the resume checkpoint's states kept out of its file (its state folders,
        contracts/sharded_state.py) that a worker of group ``group`` reads into
        ``rank_dir/resume-<id>.state/<folder>/``: the task's replica (``sync``) or its
        group's own (``periodic``, ``diloco``: ``<checkpoint>.g<group>.dcp``), not the other
        groups' (at 25M parameters with Adam, 200 MB each) unless the group has none of its
        own (parked at the checkpoint: its entry names the source group's); with ``group``
        None, the parameter server's: the model's slices its owners wrote
        (``<checkpoint>.s<shard>.dcp``), which no worker takes. None where there is nothing
        to take. Raises RuntimeError for a checkpoint whose state is not all stored."""
        listed = self.api.checkpoint_parts(task_id, checkpoint_id)
        if listed.get("missing"):
            raise RuntimeError(
                f"checkpoint {checkpoint_id} lacks {len(listed['missing'])} files of its "
                f"sharded state: {listed['missing'][:3]}"
            )
        parts = listed.get("parts") or []
        checked = [sharded_state.check_part(part) for part in parts]
        # The server takes the model's slices, a worker everything else.
        taken = [
            (part, (folder, name))
            for part, (folder, name) in zip(parts, checked, strict=True)
            if (sharded_state.shard_of_folder(folder) is not None) == (group is None)
        ]
        if not taken:
            return None
        root = rank_dir / f"resume-{checkpoint_id}.state"
        root.mkdir(mode=0o755)
        owners = [sharded_state.group_of_folder(folder) for _, (folder, _) in taken]
        # A group parked at the checkpoint wrote no folder: its entry names the source group's.
        own = group in owners
        for (part, (folder, name)), owner in zip(taken, owners, strict=True):
            if group is not None and own and owner not in (None, group):
                continue  # another group's optimizer: its own workers read it
            (root / folder).mkdir(mode=0o755, exist_ok=True)
            body = self.api.fetch_checkpoint_part(task_id, checkpoint_id, part)
            write_rank_file(root / folder, name, body)
        return str(root)

    def _rendezvous(self, payload: SubTaskPayload) -> tuple[str, int]:
        """The parameter server's rendezvous address, as its agent published it."""
        deadline = time.monotonic() + self.settings.rendezvous_timeout_s
        while time.monotonic() < deadline:
            found = self.api.rendezvous(payload.task_id)
            if (
                found["status"] not in ACTIVE_STATUSES
                or found.get("attempt", payload.attempt) != payload.attempt
            ):
                raise RuntimeError(f"task is {found['status']} before rendezvous")
            if found["master_port"]:
                return str(found["master_addr"]), int(found["master_port"])
            time.sleep(0.1)
        raise TimeoutError(
            f"no parameter server rendezvous within {self.settings.rendezvous_timeout_s:.0f} s"
        )


def ride_out(call: Callable[[], None], what: str, limit_s: float) -> None:
    """Make `call`, trying it again every `OUTAGE_RETRY_S` while the API cannot answer it (a
    transport error or a 5xx, after the client's own retries) for up to `limit_s` seconds
    from the first try. Raises the last error after that, at once for a 4xx, and Conflict
    as the call does."""
    started = time.monotonic()
    while True:
        try:
            call()
            return
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            if not unanswered(exc) or time.monotonic() - started > limit_s:
                raise
            log.warning("%s not answered (%s); trying again in %.0f s", what, exc, OUTAGE_RETRY_S)
            time.sleep(OUTAGE_RETRY_S)


def _sharded(payload: SubTaskPayload) -> bool:
    """True when this part's group holds its model sharded (:meth:`GroupPlan.sharded`, the
    rule :meth:`worker.engine.spec.RunSpec.sharded` follows)."""
    return payload.groups[payload.group_index].sharded(payload.engine.get("sharding", "none"))
