"""REST for tasks: submission, reads, cancel and retry, logs (also streamed, and as a text
file), checkpoints.

Every route checks that the caller may see the task's project.
"""

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, StreamingResponse

from backend.auth.dependencies import CurrentUser, UserAuth
from backend.core.db import get_sessionmaker, release
from backend.core.dependencies import SessionDep
from backend.core.errors import Invalid
from backend.core.pagination import TOTAL_HEADER, Page, PageParams, paginated
from backend.projects import access as project_access
from backend.tasks import access, compare, consolidate, provenance, service
from backend.tasks.models import Task, TaskStatus
from backend.tasks.schemas import (
    MAX_TAGS,
    AllocationRead,
    CheckpointRead,
    LogLineRead,
    MetricRead,
    ProvenanceRead,
    SubTaskRead,
    Tag,
    TaskComparison,
    TaskCreate,
    TaskEventRead,
    TaskRead,
    TaskUpdate,
    ThroughputRead,
)

router = APIRouter(prefix="/tasks", tags=["tasks"], dependencies=[UserAuth])
LOG_POLL_S = 0.5
LOG_TEXT_PAGE = 1000  # lines per database query of a log download (`logs.txt`)


def valid_task(task_id: int, session: SessionDep, user: CurrentUser) -> Task:
    """A task of a project the caller may see (404 otherwise)."""
    return access.readable_task(session, user=user, task_id=task_id)


TaskDep = Annotated[Task, Depends(valid_task)]


@router.post("", response_model=TaskRead, status_code=status.HTTP_201_CREATED)
def submit_task(data: TaskCreate, session: SessionDep, user: CurrentUser) -> Task:
    """Queue a training task across one or more resource groups."""
    access.check_submission(session, user=user, data=data)
    return service.submit(session, data=data)


@router.get("", response_model=list[TaskRead])
def list_tasks(
    session: SessionDep,
    user: CurrentUser,
    response: Response,
    project_id: int | None = None,
    status: TaskStatus | None = None,
    tag: Annotated[
        list[Tag], Query(max_length=MAX_TAGS, description="tasks carrying every one of these tags")
    ] = [],  # noqa: B006 (FastAPI copies a default)
    name: Annotated[
        str, Query(max_length=200, description="text the task's name contains (any case)")
    ] = "",
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> list[Task]:
    """Tasks of the projects the caller may see, newest first, filtered; the number that
    match is in X-Total-Count."""
    where = service.TaskFilter(
        project_id=project_id,
        status=status,
        tags=tuple(tag),
        name=name.strip(),
        project_ids=project_access.visible_project_ids(session, user=user),
    )
    response.headers[TOTAL_HEADER] = str(service.count_tasks(session, where=where))
    found = list(service.list_tasks(session, where=where, offset=offset, limit=limit))
    release(session)  # the connection back before the answer waits for a validating thread
    return found


@router.get("/compare", response_model=TaskComparison)
def compare_tasks(
    session: SessionDep,
    user: CurrentUser,
    ids: Annotated[
        list[int],
        Query(max_length=50, description="2 to 10 tasks to compare (repeat: ids=1&ids=2)"),
    ] = [],  # noqa: B006 (FastAPI copies a default)
    metric: Annotated[
        str | None, Query(max_length=100, description="a metric whose curves to include")
    ] = None,
) -> TaskComparison:
    """Tasks side by side: the spec fields that differ, each task's final metrics, and, with
    `metric`, each task's curve of it (by step, epoch and seconds since its start)."""
    found = [
        access.readable_task(session, user=user, task_id=task_id)
        for task_id in compare.compared_ids(ids)
    ]
    return compare.compare(session, tasks=found, metric=metric)


@router.get("/{task_id}", response_model=TaskRead)
def get_task(task: TaskDep, session: SessionDep) -> Task:
    release(session)  # as list_tasks
    return task


@router.patch("/{task_id}", response_model=TaskRead)
def update_task(data: TaskUpdate, task: TaskDep, session: SessionDep, user: CurrentUser) -> Task:
    """Change a queued task's priority or `depends_on` (a cycle is refused; a dependency
    the caller cannot see is answered like one that does not exist, 404)."""
    access.check_dependencies(session, user=user, depends_on=data.depends_on or [])
    return service.update(session, task=task, data=data)


@router.post("/{task_id}/cancel", response_model=TaskRead)
def cancel_task(task: TaskDep, session: SessionDep) -> Task:
    """Cancel a task that has not ended. 409 if it already has."""
    return service.cancel(session, task=task)


@router.post("/{task_id}/retry", response_model=TaskRead, status_code=status.HTTP_201_CREATED)
def retry_task(task: TaskDep, session: SessionDep, user: CurrentUser) -> Task:
    """Submit a copy of an ended task (same code version and spec) as a new task.
    409 if the task has not ended or its project is archived."""
    project_access.writable_project(session, user=user, project_id=task.project_id)
    return service.retry(session, task=task)


@router.get("/{task_id}/events", response_model=list[TaskEventRead])
def task_events(task: TaskDep, session: SessionDep, page: Page, response: Response) -> list:
    """Every lifecycle transition (and alarm) of the task, oldest first, with its reason."""
    return paginated(list(service.events(session, task_id=task.id)), page, response)


@router.get("/{task_id}/allocations", response_model=list[AllocationRead])
def task_allocations(
    task: TaskDep, session: SessionDep, page: Page, response: Response
) -> list[AllocationRead]:
    """The task's nodes: role, resource group, rank and host."""
    return paginated(service.allocations(session, task_id=task.id), page, response)


@router.get("/{task_id}/sub-tasks", response_model=list[SubTaskRead])
def task_sub_tasks(
    task: TaskDep, session: SessionDep, page: Page, response: Response
) -> list[SubTaskRead]:
    return paginated(service.sub_tasks(session, task_id=task.id), page, response)


@router.get("/{task_id}/metrics", response_model=list[MetricRead])
def task_metrics(
    task: TaskDep,
    session: SessionDep,
    response: Response,
    name: str | None = None,
    resources: Annotated[
        bool | None,
        Query(
            description="true: only the ranks' resource use (rank_cpu_percent, rank_rss_mb, "
            "rank_gpu_util, rank_gpu_mem_mb, measured by the agents); false: all but those"
        ),
    ] = None,
    scale: Annotated[
        Literal["step", "epoch"] | None,
        Query(
            description="step: only the per-step series (names starting `step/`: "
            "step/train_loss, step/samples_per_s, step/lr, the training code's "
            "step/train_<name>); epoch: all but those"
        ),
    ] = None,
    max_points: Annotated[
        int | None,
        Query(
            ge=1,
            le=100_000,
            description="at most this many points of each series (name and rank): a longer "
            "one keeps every k-th point, k = ceil(points / max_points), its latest always",
        ),
    ] = None,
    after_id: Annotated[
        int | None,
        Query(
            ge=0,
            description="a cursor: the first `limit` metrics stored after the one of this "
            "`id` (0: from the first), without a total; a chart's next poll fetches what is "
            "new. Ids are taken when a report is stored, so one stored by a report still "
            "being written may have a lower id than one already read: the task page "
            "fetches again from the last id older than 10 s",
        ),
    ] = None,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list:
    """Reported scalars, oldest first (by `id`): per epoch (rank null), per worker
    (samples_per_s), each rank's resource use (with the time it was measured) and the
    per-step series (`scale=step`; `max_points` thins each series for a chart); with
    `after_id`, the next `limit` after a cursor (read in one query, no total).

    Raises 422 when `after_id` comes with `max_points` (a thinned series has no cursor:
    its every k-th point moves as it grows) or with an `offset`."""
    if after_id is not None and (max_points is not None or offset):
        raise Invalid(
            "after_id is a cursor: it takes neither max_points (a thinned series has no "
            "cursor) nor offset",
            field="after_id",
        )
    found = service.metrics(
        session,
        task_id=task.id,
        name=name,
        resources=resources,
        scale=scale,
        max_points=max_points,
        after_id=after_id,
        limit=limit if after_id is not None else None,
    )
    if after_id is not None:
        return list(found)  # the next `limit` after the cursor, read in one query
    return paginated(list(found), PageParams(offset=offset, limit=limit), response)


@router.get("/{task_id}/throughput", response_model=ThroughputRead)
def task_throughput(task: TaskDep, session: SessionDep) -> ThroughputRead:
    """Measured samples/s and batch share per worker (latest), summed per resource group."""
    return service.throughput(session, task=task)


@router.get("/{task_id}/logs", response_model=list[LogLineRead])
def task_logs(
    task: TaskDep,
    session: SessionDep,
    after_id: Annotated[int, Query(ge=0)] = 0,
    node: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list:
    """Log lines after the cursor `after_id`, optionally of one node (e.g. `ps`, `rank-1`)."""
    return list(service.logs(session, task_id=task.id, after_id=after_id, node=node, limit=limit))


def _log_text(task_id: int, node: str | None) -> Iterator[bytes]:
    """The task's log as UTF-8 text, one chunk per `LOG_TEXT_PAGE` lines, each page read
    with a session of its own (the log is never held whole); ends at the first page that is
    not full, so lines that arrive meanwhile are included up to then."""
    cursor = 0
    while True:
        with get_sessionmaker()() as session:
            lines = service.logs(
                session, task_id=task_id, after_id=cursor, node=node, limit=LOG_TEXT_PAGE
            )
            chunk = "".join(service.log_text(line) for line in lines).encode()
            cursor = lines[-1].id if lines else cursor
        if chunk:  # yielded with the connection back in the pool, however slow the reader
            yield chunk
        if len(lines) < LOG_TEXT_PAGE:
            return


@router.get(
    "/{task_id}/logs.txt",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {
                "text/plain": {"example": "2026-11-22T06:00:00.500Z rank-1   epoch 1 ...\n"}
            },
            "description": "the log as text, one line per log line, oldest first (an "
            "attachment named `task-<id>[-<node>]-logs.txt`)",
        }
    },
)
def download_logs(
    task: TaskDep,
    session: SessionDep,
    node: Annotated[
        str | None, Query(description="only this node's lines, e.g. `ps`, `rank-1`")
    ] = None,
) -> StreamingResponse:
    """The task's whole log (or one node's) as a text file, streamed as it is read: per line
    its UTC time (ms), node and text. 404 for a node that is neither in the task's spec nor
    in its log (the message lists the spec's nodes)."""
    if node:
        service.check_log_node(session, task=task, node=node)
    session.close()  # the download reads with sessions of its own
    label = f"-{re.sub(r'[^A-Za-z0-9._-]', '_', node)}" if node else ""
    return StreamingResponse(
        _log_text(task.id, node or None),
        media_type="text/plain; charset=utf-8",
        headers={
            "Content-Disposition": f'attachment; filename="task-{task.id}{label}-logs.txt"',
            "X-Accel-Buffering": "no",
        },
    )


def _poll_logs(task_id: int, cursor: int, node: str | None) -> tuple[list[str], TaskStatus]:
    """One database poll of the stream: the new lines as JSON, and the task's status."""
    with get_sessionmaker()() as session:
        lines = service.logs(session, task_id=task_id, after_id=cursor, node=node)
        task_status = service.get(session, task_id=task_id).status
        return [LogLineRead.model_validate(line).model_dump_json() for line in lines], task_status


async def _log_stream(task_id: int, after_id: int, node: str | None) -> AsyncIterator[str]:
    """Server-sent events: one `log` event per line (its id the cursor), `end` once the task
    is over. Each poll runs in the threadpool; the wait between polls holds no thread."""
    cursor = after_id
    while True:
        lines, task_status = await run_in_threadpool(_poll_logs, task_id, cursor, node)
        for data in lines:
            cursor = json.loads(data)["id"]
            yield f"id: {cursor}\nevent: log\ndata: {data}\n\n"
        if not lines and task_status.terminal:
            yield f"event: end\ndata: {json.dumps({'status': task_status.value})}\n\n"
            return
        if not lines:
            yield ": keep-alive\n\n"
            await asyncio.sleep(LOG_POLL_S)


@router.get(
    "/{task_id}/logs/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {
                "text/event-stream": {
                    "example": 'id: 42\nevent: log\ndata: {"id": 42, '
                    '"node": "rank-1", "seq": 7, "time": "...", '
                    '"text": "epoch 1 ..."}\n\n'
                }
            },
            "description": "server-sent events: `log` (one per line) and `end` (task over)",
        }
    },
)
def stream_logs(
    task: TaskDep,
    session: SessionDep,
    after_id: Annotated[int, Query(ge=0)] = 0,
    node: str | None = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    """Follow the task's logs as server-sent events until it ends. A reconnecting client
    resumes after its `Last-Event-ID` header (or the `after_id` cursor)."""
    resume = last_event_id or ""
    cursor = max(after_id, int(resume) if resume.isdigit() else 0)
    session.close()  # the stream polls with sessions of its own
    return StreamingResponse(
        _log_stream(task.id, cursor, node),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/{task_id}/checkpoints", response_model=list[CheckpointRead])
def task_checkpoints(task: TaskDep, session: SessionDep, page: Page, response: Response) -> list:
    return paginated(list(service.checkpoints(session, task_id=task.id)), page, response)


@router.get("/{task_id}/provenance", response_model=ProvenanceRead)
def task_provenance(task: TaskDep, session: SessionDep) -> ProvenanceRead:
    """Shard provenance: for every epoch and attempt, which worker (group, host, rank) trained
    how many samples (with a hash of its index set), how many a rebalance or the neighbour
    exchange moved, and whether the epoch covers the training set exactly once."""
    return provenance.read(session, task=task)


@router.get("/{task_id}/checkpoints/{checkpoint_id}/download")
def download_checkpoint(task: TaskDep, checkpoint_id: int, session: SessionDep) -> FileResponse:
    """The checkpoint file (`torch.save` of model and optimizer state dicts), streamed. Where
    a sharded group's workers keep its optimizer state, the one file is built from their
    files on the first download (409 while one of them is still arriving)."""
    checkpoint = service.get_checkpoint(session, task_id=task.id, checkpoint_id=checkpoint_id)
    path = consolidate.whole_file(checkpoint)  # a worker thread: FastAPI runs a def there
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"task{task.id}-{Path(checkpoint.path).name}",
    )
