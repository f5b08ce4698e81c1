"""Queue and message names of first-level dispatch, and the broker options that the API
(producer) and the agents (consumers) must agree on."""

import os
from pathlib import Path
from typing import Any

from contracts.payload import MAX_RUNTIME_S

RUN_SUBTASK = "polytrain.run_sub_task"
"""The Celery task name of one sub-task message (its one argument: a `SubTaskPayload` as JSON)."""

# Redis redelivers a message not acknowledged within this time: longer than any run may last
# (the longest wall-clock limit, plus a day), so a running sub-task's message is never sent
# again. A message an agent took and lost (the agent died) needs no redelivery: the scheduler
# restarts the task, and publishes again a sub-task nobody claimed.
VISIBILITY_TIMEOUT_S = MAX_RUNTIME_S + 86_400


def queue_name(group: str, agent_id: int) -> str:
    """The Celery queue served by agent `agent_id` of resource group `group`: the parts of
    the group's sub-tasks booked for that agent (a group spans its agents)."""
    return f"rg.{group}.agent-{agent_id}"


def resolve_broker_url(broker_url: str | None, data_dir: str | os.PathLike[str]) -> str:
    """The broker both sides use: `broker_url` if set, else the embedded default, Celery's
    SQLAlchemy transport over SQLite in `data_dir/broker.db` (an API and the agents that share
    its data directory on one host reach the same file)."""
    return broker_url or f"sqla+sqlite:///{Path(data_dir).resolve() / 'broker.db'}"


def broker_options(broker_url: str) -> dict[str, Any]:
    """Transport options shared by the API (producer) and the agents (consumers)."""
    if broker_url.startswith(("redis", "rediss")):
        return {"visibility_timeout": VISIBILITY_TIMEOUT_S}
    return {}
