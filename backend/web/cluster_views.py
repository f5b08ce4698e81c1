"""What the cluster page shows: resource groups with their use, agents with their health."""

from collections import Counter
from typing import Any

from sqlalchemy.orm import Session

from backend.agents import service as agents
from backend.agents.models import Agent
from backend.core.db import utcnow
from backend.resource_groups import service as groups
from backend.resource_groups.models import GroupState
from backend.tasks import service as tasks
from backend.web.forms import FieldErrors


def hardware_summary(hardware: dict[str, Any]) -> str:
    """An agent's reported hardware in a few words, e.g. `8 cores · 15.5 GiB · 2× A100`
    (the device model it serves its group with too, unless it is a CUDA device listed)."""
    parts = []
    if hardware.get("cpu_cores"):
        parts.append(f"{hardware['cpu_cores']} cores")
    if hardware.get("memory_bytes"):
        parts.append(f"{hardware['memory_bytes'] / 2**30:.1f} GiB")
    model = hardware.get("device_model")
    if model and model != "unknown" and hardware.get("device_type") != "cuda":
        parts.append(str(model))
    devices = Counter(hardware.get("cuda_devices") or [])
    parts.extend(f"{count}× {name}" for name, count in devices.items())
    if hardware.get("torch"):
        parts.append(f"torch {hardware['torch']}")
    return " · ".join(parts) or "—"


def _agent_row(agent: Agent, group_names: dict[int, str], busy: dict[int, int]) -> dict[str, Any]:
    return {
        "id": agent.id,
        "name": agent.name,
        "host": agent.host,
        "workers": agent.workers,
        "busy": busy.get(agent.id, 0),
        "group": group_names.get(agent.resource_group_id, "?"),
        "online": agent.online,
        "state": agent.state.value,
        "description": agent.description,
        "hardware": hardware_summary(agent.hardware or {}),
        "hardware_raw": agent.hardware,
        "heartbeat_age_s": max(0.0, (utcnow() - agent.last_heartbeat_at).total_seconds()),
    }


def cluster_page(
    session: Session,
    *,
    form: dict | None = None,
    errors: FieldErrors | None = None,
    row_errors: dict | None = None,
    agent_errors: dict | None = None,
) -> dict[str, Any]:
    """Every resource group with its live use, every agent, and the admin forms' state."""
    group_list = groups.list_all(session)
    names = {g.id: g.name for g in group_list}
    busy = tasks.busy_workers_by_agent(session)
    return {
        "groups": group_list,
        "agents": [_agent_row(a, names, busy) for a in agents.list_all(session)],
        "states": [s.value for s in GroupState],
        "form": form
        or {"name": "", "device_type": "cpu", "capacity": "1", "description": "", "labels": ""},
        "errors": errors or {},
        "row_errors": row_errors or {},
        "agent_errors": agent_errors or {},
    }
