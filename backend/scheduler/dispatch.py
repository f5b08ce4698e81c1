"""First-level dispatch: one Celery message per resource group, on that group's queue."""

from functools import lru_cache
from typing import Protocol

from celery import Celery

from backend.core.config import get_settings
from backend.scheduler.payload import RUN_SUBTASK, SubTaskPayload, queue_name


class Dispatcher(Protocol):
    def send(self, payload: SubTaskPayload) -> None: ...


@lru_cache
def producer_app() -> Celery:
    """A Celery app used only to publish (the agents define the consumer side)."""
    app = Celery("polytrain-api", broker=get_settings().resolved_broker_url())
    app.conf.update(task_serializer="json", accept_content=["json"],
                    broker_connection_retry_on_startup=True)
    return app


class CeleryDispatcher:
    """Publishes sub-task messages; the message id is `task-<id>-group-<index>`."""

    def send(self, payload: SubTaskPayload) -> None:
        producer_app().send_task(
            RUN_SUBTASK, args=[payload.model_dump(mode="json")],
            queue=queue_name(payload.group.name),
            task_id=f"task-{payload.task_id}-group-{payload.group_index}",
        )
