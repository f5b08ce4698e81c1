"""Small factories for scheduler tests: groups with online agents, projects, tasks."""

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.projects.models import CodeVersion, Project
from backend.resource_groups.models import ResourceGroup
from backend.tasks import fate, lifecycle
from backend.tasks import service as tasks
from backend.tasks.models import Allocation, NodeRole, SubTask, Task, TaskStatus
from backend.tasks.schemas import TaskCreate
from contracts.agent_api import Claim


def group(
    session: Session,
    name: str,
    capacity: int,
    *,
    device_type: str = "cpu",
    online: int | None = None,
    labels: dict[str, str] | None = None,
) -> ResourceGroup:
    """A group and one online agent with `online` workers (default: the capacity)."""
    row = ResourceGroup(name=name, device_type=device_type, capacity=capacity, labels=labels or {})
    session.add(row)
    session.flush()
    workers = capacity if online is None else online
    if workers:
        session.add(
            Agent(
                name=f"agent-{name}",
                host="10.77.0.9",
                resource_group_id=row.id,
                workers=workers,
                hardware={"cpu_cores": 2},
            )
        )
    session.commit()
    return row


def add_agent(session: Session, group: ResourceGroup, name: str, *, workers: int) -> Agent:
    """Another online agent of `group` (a group spans hosts), with `workers` workers."""
    agent = Agent(
        name=name,
        host=f"10.77.1.{group.id}",
        resource_group_id=group.id,
        workers=workers,
        hardware={"cpu_cores": 2},
    )
    session.add(agent)
    session.commit()
    return agent


def agent_named(session: Session, name: str) -> Agent:
    return session.scalars(select(Agent).where(Agent.name == name)).one()


def version(session: Session, owner_id: int | None = None, name: str = "p") -> CodeVersion:
    project = Project(name=name, owner_id=owner_id)
    session.add(project)
    session.flush()
    row = CodeVersion(
        project_id=project.id,
        version=1,
        source="example:tiny_regression",
        filename="tiny_regression.py",
        sha256="0" * 64,
    )
    session.add(row)
    session.commit()
    return row


def submit(
    session: Session, code: CodeVersion, request: list[dict[str, Any]], **extra: Any
) -> Task:
    data = {
        "project_id": code.project_id,
        "code_version_id": code.id,
        "resource_groups": request,
        "epochs": 1,
        "global_batch_size": 64,
        **extra,
    }
    return tasks.submit(session, data=TaskCreate.model_validate(data))


def finish(session: Session, task: Task, status: TaskStatus = TaskStatus.SUCCEEDED) -> None:
    """End a task as its agents would (through RUNNING)."""
    session.refresh(task)
    if task.status is TaskStatus.SCHEDULED:
        lifecycle.transition(session, task, TaskStatus.RUNNING, "test")
    lifecycle.transition(session, task, status, "test")
    session.commit()


def held(session: Session, group_name: str) -> int:
    """Compute workers held on the group now."""
    return (
        session.scalar(
            select(func.count(Allocation.id))
            .join(ResourceGroup, ResourceGroup.id == Allocation.resource_group_id)
            .where(
                ResourceGroup.name == group_name,
                Allocation.released_at.is_(None),
                Allocation.role == NodeRole.COMPUTE,
            )
        )
        or 0
    )


class RecordingDispatcher:
    """Keeps the payloads it is given (a real broker is used in the end-to-end tests)."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[Any] = []
        self.fail = fail

    def send(self, payload: Any) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append(payload)


def running_task(session: Session, **extra: Any) -> Task:
    """A task across cpu-a ×2 and cpu-b ×1 (groups made by the caller) whose sub-tasks both
    groups' agents claimed: RUNNING."""
    from backend.scheduler.service import schedule_next

    task = submit(
        session,
        version(session),
        [{"name": "cpu-a", "workers": 2}, {"name": "cpu-b", "workers": 1}],
        **extra,
    )
    assert schedule_next(session) is not None
    for sub in session.scalars(
        select(SubTask).where(SubTask.task_id == task.id, SubTask.attempt == task.attempt)
    ):
        agent = session.get_one(Agent, sub.agent_id)
        fate.claim(session, sub=sub, data=Claim(agent_id=agent.id, host=agent.host))
    session.refresh(task)
    assert task.status is TaskStatus.RUNNING
    return task
