"""The agents' transport: the internal HTTP API agents call, authenticated with the agent token.

Transport only: each route validates its body (``contracts.agent_api``) and calls the
task's fate (:mod:`backend.tasks.fate`), the reports' storage
(:mod:`backend.tasks.reports`) or the agents' registry (:mod:`backend.agents.service`).
"""

import json
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from sqlalchemy.orm import lazyload

from backend.agent_api.waits import StateWaits, task_states
from backend.agents import service as agents
from backend.agents.models import Agent
from backend.agents.schemas import AgentRead, AgentRegister
from backend.agents.stamps import HeldStamps
from backend.auth.dependencies import AgentAuth
from backend.core.db import release
from backend.core.dependencies import ArrivalDep, SessionDep, SettingsDep
from backend.core.errors import Invalid, NotFound
from backend.plans import service as plans
from backend.projects import service as projects
from backend.resource_groups import service as groups
from backend.tasks import fate, provenance, reports
from backend.tasks import service as tasks
from backend.tasks.models import Checkpoint, Task
from backend.tasks.schemas import CheckpointRead
from contracts.agent_api import (
    CHECKPOINT_NAME_PATTERN,
    STATE_WAIT_MAX_S,
    Alarm,
    Claim,
    Finished,
    GroupDevice,
    Heartbeat,
    HeartbeatReply,
    LogBatch,
    MetricBatch,
    Progress,
    Provenance,
    Ready,
    Rendezvous,
    RendezvousRead,
    Report,
    TaskState,
    TaskStateOf,
)
from contracts.sharded_state import MAX_PARTS as MAX_STATE_PARTS
from contracts.trial import TrialResult

router = APIRouter(prefix="/internal/v1", tags=["internal (agents)"], dependencies=[AgentAuth])


@router.get("/resource-groups/{name}", response_model=GroupDevice)
def group_device(name: str, session: SessionDep) -> GroupDevice:
    """The device type an agent serves group `name` with, and the models it accepts."""
    device = GroupDevice.model_validate(
        groups.get_by_name(session, name=name), from_attributes=True
    )
    release(session)
    return device


@router.post("/agents/register", response_model=AgentRead)
def register_agent(data: AgentRegister, session: SessionDep, settings: SettingsDep) -> Agent:
    """Register an agent; 409 (field `name`) while a live agent of another instance holds it,
    409 (field `hardware.device_type` / `hardware.device_model`) if its hardware differs
    from its group's."""
    return agents.register(session, data=data, live_within_s=settings.heartbeat_timeout_s)


@router.post("/agents/{agent_id}/heartbeat", response_model=HeartbeatReply)
def heartbeat(
    agent_id: int,
    request: Request,
    arrived: ArrivalDep,
    session: SessionDep,
    settings: SettingsDep,
    data: Heartbeat | None = None,
) -> HeartbeatReply:
    """The agent is alive, and so are the listed ranks' processes; the answer gives the
    state of each task named (`running`, `tasks`). The stamps are held and written within a
    second (`backend.agents.stamps`): an online agent's beat without resource samples
    writes nothing itself, and reads nothing when this process saw the agent online within
    the liveness timeout (`agents.beat`). The stamp is the beat's arrival (`ArrivalDep`),
    not the moment a worker thread took it up: on a busy process the wait for one is the
    agent's delay, not its silence."""
    stamps: HeldStamps = request.app.state.stamps
    data = data or Heartbeat()
    reports.node_heartbeats(session, running=data.running, stamps=stamps, at=arrived)
    agents.beat(
        session,
        agent_id=agent_id,
        stamps=stamps,
        trust_s=settings.heartbeat_timeout_s,
        at=arrived,
    )
    named = sorted({entry.task_id for entry in data.running} | set(data.tasks))
    reply = HeartbeatReply(
        tasks=[
            TaskStateOf(task_id=task_id, status=status, attempt=attempt)
            for task_id, (status, attempt) in task_states(session, named).items()
        ]
    )
    release(session)  # commits the samples, if any
    if not stamps.flushing:  # no flusher in this app (a test client without its lifespan)
        stamps.flush(session)
    return reply


@router.post("/agents/{agent_id}/deregister", status_code=204)
def deregister(agent_id: int, request: Request, session: SessionDep) -> None:
    agents.deregister(
        session, agent=agents.get(session, agent_id=agent_id), stamps=request.app.state.stamps
    )


@router.post("/sub-tasks/{sub_task_id}/claim", status_code=204)
def claim(sub_task_id: int, data: Claim, session: SessionDep) -> None:
    fate.claim(session, sub=fate.get_sub_task(session, sub_task_id=sub_task_id), data=data)


@router.post("/sub-tasks/{sub_task_id}/ready", response_model=TaskState)
def ready(sub_task_id: int, data: Ready, session: SessionDep) -> TaskState:
    """A part that claimed with `preparing` has its environment; the task's state after it:
    its agent starts the ranks once the task is RUNNING (every part has it)."""
    sub = fate.ready(session, sub=fate.get_sub_task(session, sub_task_id=sub_task_id), data=data)
    task = tasks.get(session, task_id=sub.task_id)
    return TaskState(status=task.status.value, attempt=task.attempt)


@router.post("/sub-tasks/{sub_task_id}/finished", response_model=TaskState)
def finished(sub_task_id: int, data: Finished, session: SessionDep) -> TaskState:
    sub = fate.get_sub_task(session, sub_task_id=sub_task_id)
    return TaskState(status=fate.finish(session, sub=sub, data=data).status.value)


@router.get("/tasks/{task_id}/state", response_model=TaskState)
async def task_state(
    task_id: int,
    request: Request,
    status: Annotated[
        str | None, Query(max_length=20, description="the status the agent knows")
    ] = None,
    attempt: Annotated[int, Query(ge=1, description="the attempt the agent knows")] = 1,
    wait_s: Annotated[
        float,
        Query(ge=0, le=STATE_WAIT_MAX_S, description="long-poll: wait up to this for a change"),
    ] = 0.0,
) -> TaskState:
    """The task's status and attempt: agents stop processes of any other attempt.

    With `wait_s` and the state the agent knows (`status`, `attempt`), a long-poll: answered
    as soon as the task's state differs from it, else after `wait_s` seconds with it
    (`backend.agent_api.waits`; the request holds no thread and no database connection
    while it waits). Without, answered at once (an older agent polls it every second)."""
    waits: StateWaits = request.app.state.state_waits
    known = (status, attempt) if status is not None else ("", attempt)
    found = await waits.wait(task_id, known, wait_s if status is not None else 0.0)
    if found is None:
        raise NotFound(f"task {task_id} does not exist", field="task_id")
    return TaskState(status=found[0], attempt=found[1])


@router.get("/tasks/{task_id}/code")
def task_code(task_id: int, session: SessionDep) -> Response:
    task = tasks.get(session, task_id=task_id)
    version = projects.get_version(session, version_id=task.code_version_id)
    return Response(projects.read_source(version), media_type="text/x-python")


@router.put("/tasks/{task_id}/rendezvous", status_code=204)
def set_rendezvous(task_id: int, data: Rendezvous, session: SessionDep) -> None:
    """Publish the parameter server's address for the task's current attempt (409 if stale)."""
    fate.set_rendezvous(session, task=tasks.get(session, task_id=task_id), data=data)


@router.get("/tasks/{task_id}/rendezvous", response_model=RendezvousRead)
def get_rendezvous(task_id: int, session: SessionDep) -> RendezvousRead:
    task = tasks.get(session, task_id=task_id)
    hosts, complete = fate.peer_hosts(session, task)
    found = RendezvousRead(
        master_addr=task.master_addr,
        master_port=task.master_port,
        status=task.status.value,
        attempt=task.attempt,
        peer_hosts=hosts,
        peers_complete=complete,
    )
    release(session)
    return found


@router.post("/tasks/{task_id}/report")
def add_report(task_id: int, report: Report, session: SessionDep) -> dict:
    """A sub-task's log lines, metrics and progress in one request, stored in one
    transaction (the agent's `Reporter` sends this; the three routes below are kept for an
    older agent)."""
    task = session.get(Task, task_id, options=[lazyload(Task.tag_rows)])  # not its tags
    if task is None:
        raise NotFound(f"task {task_id} does not exist", field="task_id")
    return {"stored": reports.add_report(session, task=task, report=report)}


@router.post("/tasks/{task_id}/logs")
def add_logs(task_id: int, batch: LogBatch, session: SessionDep) -> dict:
    tasks.get(session, task_id=task_id)
    return {"stored": reports.add_logs(session, task_id=task_id, batch=batch)}


@router.post("/tasks/{task_id}/metrics", status_code=204)
def add_metrics(task_id: int, batch: MetricBatch, session: SessionDep) -> None:
    tasks.get(session, task_id=task_id)
    reports.add_metrics(session, task_id=task_id, batch=batch)


@router.post("/tasks/{task_id}/progress", status_code=204)
def progress(task_id: int, data: Progress, session: SessionDep) -> None:
    reports.set_progress(session, task=tasks.get(session, task_id=task_id), data=data)


@router.post("/tasks/{task_id}/alarms")
def add_alarm(task_id: int, data: Alarm, session: SessionDep) -> dict:
    """An alarm the task's parameter server raised about a group: an alarm event of the task
    (ignored from an earlier attempt, stored once when sent again)."""
    return {
        "stored": reports.add_alarm(session, task=tasks.get(session, task_id=task_id), data=data)
    }


@router.post(
    "/tasks/{task_id}/checkpoints",
    response_model=CheckpointRead,
    openapi_extra={
        "requestBody": {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {
                            "checkpoint": {"type": "string", "format": "binary"},
                            "parts": {"type": "string", "description": "a JSON array"},
                        },
                        "required": ["checkpoint"],
                    }
                },
            }
        }
    },
)
async def upload_checkpoint(
    task_id: int,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    name: Annotated[
        str,
        Query(
            pattern=CHECKPOINT_NAME_PATTERN,
            examples=["epoch-3.pt"],
            description="file name; letters, digits, `._-`, no leading dot",
        ),
    ],
    epoch: Annotated[int, Query(ge=0)],
    step: Annotated[int, Query(ge=0)],
    attempt: Annotated[int, Query(ge=1)] = 1,
) -> Checkpoint:
    """Store a checkpoint file (409 if the name is taken by other content in this attempt;
    the same upload again returns the stored one), sent as the raw request body, or where
    its workers wrote optimizer states beside it (which they upload, `POST
    /tasks/{id}/checkpoint-parts`) as `multipart/form-data`: the file as `checkpoint` and
    the states' `folder/file` names as `parts`, a JSON array (in the body, not the query
    string, where a proxy's 8 KiB request line held some 180 names). 422 naming `parts`
    for one that is not such an array of at most 4,097 names."""
    if "parts" in request.query_params:  # an agent older than this portal: nothing is lost
        raise Invalid(
            "`parts` travels in the upload's form, not its query string: upgrade the agent",
            field="parts",
        )
    parts: list[str] | None = None
    if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        body, parts = await _checkpoint_form(request)
    else:
        body = await request.body()

    def store() -> Checkpoint:  # database and disk work stay off the event loop
        task = tasks.get(session, task_id=task_id)
        return reports.save_checkpoint(
            session,
            task=task,
            directory=settings.checkpoint_dir,
            name=name,
            epoch=epoch,
            step=step,
            body=body,
            attempt=attempt,
            parts=parts,
        )

    return await run_in_threadpool(store)


async def _checkpoint_form(request: Request) -> tuple[bytes, list[str] | None]:
    """A checkpoint upload's `checkpoint` file and `parts` list (None where the form has no
    `parts`) from its multipart form. Raises Invalid naming the field that is missing or
    malformed."""
    # A field may hold 2 MiB: 4,097 names of up to 260 characters and their JSON quoting.
    async with request.form(max_files=1, max_fields=1, max_part_size=2 * 2**20) as form:
        upload, listed = form.get("checkpoint"), form.get("parts")
        if upload is None or isinstance(upload, str):
            raise Invalid(
                "the checkpoint file is missing (form field `checkpoint`)", field="checkpoint"
            )
        if listed is None:
            return await upload.read(), None
        try:  # a number of 5,000 digits is a ValueError, 200,000 `[` a RecursionError
            parts = json.loads(listed) if isinstance(listed, str) else None
        except (ValueError, RecursionError):
            parts = None
        if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
            raise Invalid("`parts` must be a JSON array of `folder/file` names", field="parts")
        if len(parts) > MAX_STATE_PARTS:
            raise Invalid(f"at most {MAX_STATE_PARTS} parts, got {len(parts)}", field="parts")
        return await upload.read(), parts


@router.post("/tasks/{task_id}/checkpoint-parts")
async def upload_checkpoint_part(
    task_id: int,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    part: Annotated[
        str,
        Query(
            max_length=300,
            examples=["step-8.pt.dcp/__1_0.distcp"],
            description="`<checkpoint>.dcp/<file>`: a file of a checkpoint's state folder",
        ),
    ],
    attempt: Annotated[int, Query(ge=1)] = 1,
) -> dict:
    """Store a file of a checkpoint's state folder (a worker's optimizer state), sent as the
    raw request body by the worker's agent (409 if stored with other content; the same bytes
    again are kept)."""
    body = await request.body()

    def store() -> str:
        task = tasks.get(session, task_id=task_id)
        reports.save_checkpoint_part(
            task=task, directory=settings.checkpoint_dir, part=part, body=body, attempt=attempt
        )
        return part

    return {"stored": await run_in_threadpool(store)}


@router.get("/tasks/{task_id}/checkpoints/{checkpoint_id}/parts")
def checkpoint_parts(task_id: int, checkpoint_id: int, session: SessionDep) -> dict:
    """The files of a checkpoint's sharded optimizer state (``parts``, empty where the file
    holds it all) and those not stored yet (``missing``)."""
    checkpoint = tasks.get_checkpoint(session, task_id=task_id, checkpoint_id=checkpoint_id)
    return {"parts": checkpoint.parts or [], "missing": checkpoint.missing_parts()}


@router.get("/tasks/{task_id}/checkpoints/{checkpoint_id}/parts/{folder}/{name}")
def fetch_checkpoint_part(
    task_id: int, checkpoint_id: int, folder: str, name: str, session: SessionDep
) -> FileResponse:
    """One file of a checkpoint's sharded optimizer state, for a worker of a restarted task
    (404 for a file the checkpoint does not name, or one not stored yet)."""
    checkpoint = tasks.get_checkpoint(session, task_id=task_id, checkpoint_id=checkpoint_id)
    part = f"{folder}/{name}"
    path = Path(checkpoint.path).parent / part
    if part not in (checkpoint.parts or []) or not path.is_file():
        raise NotFound(f"checkpoint {checkpoint_id} has no stored part {part!r}")
    return FileResponse(path, media_type="application/octet-stream")


@router.put("/tasks/{task_id}/checkpoints/{checkpoint_id}/provenance")
def put_provenance(task_id: int, checkpoint_id: int, data: Provenance, session: SessionDep) -> dict:
    """The shard provenance a checkpoint carried (the samples each worker took since the
    previous checkpoint); sent again, it replaces what was stored for that checkpoint."""
    task = tasks.get(session, task_id=task_id)
    checkpoint = tasks.get_checkpoint(session, task_id=task_id, checkpoint_id=checkpoint_id)
    return {"stored": provenance.store(session, task=task, checkpoint=checkpoint, data=data)}


@router.put("/tasks/{task_id}/trial")
def put_trial(task_id: int, data: TrialResult, session: SessionDep) -> dict:
    """A plan's trial timings, from the trial task's parameter server: the plan's performance
    model is fitted from them (sent again, they replace what was stored)."""
    plan = plans.store_trial(session, task=tasks.get(session, task_id=task_id), result=data)
    return {"plan_id": plan.id, "fitted": plan.model is not None}


@router.get("/tasks/{task_id}/checkpoints/{checkpoint_id}")
def fetch_checkpoint(task_id: int, checkpoint_id: int, session: SessionDep) -> FileResponse:
    """A checkpoint's file, for the parameter server of a restarted task to resume from."""
    checkpoint = tasks.get_checkpoint(session, task_id=task_id, checkpoint_id=checkpoint_id)
    return FileResponse(checkpoint.path, media_type="application/octet-stream")
