"""First-level dispatch: one Celery message per resource group, on that group's queue."""

from functools import lru_cache
from typing import Protocol

from celery import Celery

from backend.core.config import get_settings
from contracts.messaging import RUN_SUBTASK, broker_options, queue_name
from contracts.payload import SubTaskPayload


class Dispatcher(Protocol):
    def send(self, payload: SubTaskPayload) -> None: ...


@lru_cache
def producer_app() -> Celery:
    """A Celery app used only to publish (the agents define the consumer side)."""
    broker = get_settings().resolved_broker_url()
    app = Celery("polytrain-api", broker=broker)
    app.conf.update(task_serializer="json", accept_content=["json"],
                    broker_connection_retry_on_startup=True,
                    broker_transport_options=broker_options(broker))
    return app


class CeleryDispatcher:
    """Publishes sub-task messages; the Celery task id is the sub-task's database id.

    Raises whatever kombu raises when the broker stays unreachable (after a few
    quick retries): the sub-task then stays undispatched and is sent again.
    """

    def send(self, payload: SubTaskPayload) -> None:
        producer_app().send_task(
            RUN_SUBTASK, args=[payload.model_dump(mode="json")],
            queue=queue_name(payload.group.name), task_id=str(payload.sub_task_id),
            retry=True, retry_policy={"max_retries": 2, "interval_start": 0.2,
                                      "interval_step": 0.5, "interval_max": 1.0},
        )
