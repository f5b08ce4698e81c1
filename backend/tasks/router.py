import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query, status
from fastapi.responses import FileResponse, StreamingResponse

from backend.core.db import get_sessionmaker
from backend.core.deps import SessionDep
from backend.tasks import service
from backend.tasks.models import Task, TaskStatus
from backend.tasks.schemas import (
    AllocationRead,
    CheckpointRead,
    LogLineRead,
    MetricRead,
    SubTaskRead,
    TaskCreate,
    TaskEventRead,
    TaskRead,
)

router = APIRouter(prefix="/tasks", tags=["tasks"])


def valid_task(task_id: int, session: SessionDep) -> Task:
    return service.get(session, task_id=task_id)


TaskDep = Annotated[Task, Depends(valid_task)]


@router.post("", response_model=TaskRead, status_code=status.HTTP_201_CREATED)
def submit_task(data: TaskCreate, session: SessionDep) -> Task:
    """Queue a training task across one or more resource groups."""
    return service.submit(session, data=data)


@router.get("", response_model=list[TaskRead])
def list_tasks(
    session: SessionDep, project_id: int | None = None, status: TaskStatus | None = None,
    offset: Annotated[int, Query(ge=0)] = 0, limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> list[Task]:
    return list(service.list_tasks(session, project_id=project_id, status=status,
                                   offset=offset, limit=limit))


@router.get("/{task_id}", response_model=TaskRead)
def get_task(task: TaskDep) -> Task:
    return task


@router.post("/{task_id}/cancel", response_model=TaskRead)
def cancel_task(task: TaskDep, session: SessionDep) -> Task:
    """Cancel a task that has not ended. 409 if it already has."""
    return service.cancel(session, task=task)


@router.get("/{task_id}/events", response_model=list[TaskEventRead])
def task_events(task: TaskDep, session: SessionDep) -> list:
    return list(service.events(session, task_id=task.id))


@router.get("/{task_id}/allocations", response_model=list[AllocationRead])
def task_allocations(task: TaskDep, session: SessionDep) -> list[AllocationRead]:
    return service.allocations(session, task_id=task.id)


@router.get("/{task_id}/sub-tasks", response_model=list[SubTaskRead])
def task_sub_tasks(task: TaskDep, session: SessionDep) -> list[SubTaskRead]:
    return service.sub_tasks(session, task_id=task.id)


@router.get("/{task_id}/metrics", response_model=list[MetricRead])
def task_metrics(task: TaskDep, session: SessionDep, name: str | None = None) -> list:
    return list(service.metrics(session, task_id=task.id, name=name))


@router.get("/{task_id}/logs", response_model=list[LogLineRead])
def task_logs(
    task: TaskDep, session: SessionDep, after_id: Annotated[int, Query(ge=0)] = 0,
    node: str | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list:
    """Log lines after the cursor `after_id`, optionally of one node (e.g. `ps`, `rank-1`)."""
    return list(service.logs(session, task_id=task.id, after_id=after_id, node=node, limit=limit))


def _log_stream(task_id: int, after_id: int, node: str | None) -> Iterator[str]:
    """Server-sent events: one `log` event per line, `end` once the task is over."""
    cursor = after_id
    while True:
        with get_sessionmaker()() as session:
            lines = service.logs(session, task_id=task_id, after_id=cursor, node=node)
            task_status = service.get(session, task_id=task_id).status
        for line in lines:
            cursor = line.id
            data = LogLineRead.model_validate(line).model_dump_json()
            yield f"id: {line.id}\nevent: log\ndata: {data}\n\n"
        if not lines and task_status.terminal:
            yield f"event: end\ndata: {json.dumps({'status': task_status.value})}\n\n"
            return
        if not lines:
            yield ": keep-alive\n\n"
            time.sleep(0.5)


@router.get("/{task_id}/logs/stream")
def stream_logs(
    task: TaskDep, after_id: Annotated[int, Query(ge=0)] = 0, node: str | None = None
) -> StreamingResponse:
    """Follow the task's logs as server-sent events until it ends."""
    return StreamingResponse(_log_stream(task.id, after_id, node), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/{task_id}/checkpoints", response_model=list[CheckpointRead])
def task_checkpoints(task: TaskDep, session: SessionDep) -> list:
    return list(service.checkpoints(session, task_id=task.id))


@router.get("/{task_id}/checkpoints/{checkpoint_id}/download")
def download_checkpoint(task: TaskDep, checkpoint_id: int, session: SessionDep) -> FileResponse:
    """The checkpoint file (`torch.save` of model and optimizer state dicts)."""
    checkpoint = service.get_checkpoint(session, task_id=task.id, checkpoint_id=checkpoint_id)
    return FileResponse(checkpoint.path, media_type="application/octet-stream",
                        filename=f"task{task.id}-{Path(checkpoint.path).name}")
