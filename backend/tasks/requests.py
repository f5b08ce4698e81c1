"""Checks of a task's resource request at submission; placement itself waits for allocation."""

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.agents.models import SERVING, Agent
from backend.core.errors import Invalid
from backend.resource_groups.models import LIVE, GroupState, ResourceGroup
from backend.tasks.schemas import GroupRequest


def _named(session: Session, item: GroupRequest, field: str) -> dict[str, Any]:
    group = session.scalar(select(ResourceGroup).where(ResourceGroup.name == item.name, LIVE))
    if group is None:
        raise Invalid(f"resource group '{item.name}' does not exist", field=f"{field}.name")
    if group.state is not GroupState.ACTIVE:
        raise Invalid(
            f"resource group '{group.name}' is {group.state.value}; it accepts no new tasks",
            field=f"{field}.name",
        )
    if item.workers > group.capacity:
        raise Invalid(
            f"resource group '{group.name}' has {group.capacity} worker(s); "
            f"{item.workers} requested",
            field=f"{field}.workers",
        )
    return {"name": group.name, "device_type": group.device_type, "workers": item.workers}


def _by_device(session: Session, item: GroupRequest, field: str) -> dict[str, Any]:
    groups = session.scalars(
        select(ResourceGroup).where(
            LIVE,
            ResourceGroup.device_type == item.device_type,
            ResourceGroup.state == GroupState.ACTIVE,
        )
    ).all()
    matching = [
        g for g in groups if all((g.labels or {}).get(k) == v for k, v in item.labels.items())
    ]
    if not matching:
        labels = f" with labels {item.labels}" if item.labels else ""
        raise Invalid(
            f"no active resource group has device type '{item.device_type}'{labels}",
            field=f"{field}.device_type",
        )
    capacity = sum(g.capacity for g in matching)
    if item.workers > capacity:
        raise Invalid(
            f"resource groups of device type '{item.device_type}' have {capacity} "
            f"worker(s) in all; {item.workers} requested",
            field=f"{field}.workers",
        )
    return {
        "device_type": item.device_type,
        "workers": item.workers,
        "placement": item.placement or "resource_state",
        "labels": dict(item.labels),
    }


def resolve(session: Session, items: list[GroupRequest]) -> tuple[list[dict], list[dict]]:
    """`(request, groups)` for the task's spec; `groups` is final when every item names a group
    and empty otherwise (the scheduler places device requests when it allocates).

    Raises:
        Invalid: a group does not exist, is draining or disabled, or is too small;
            no active group has the device type (and labels), or they are too small.
    """
    request = [
        _named(session, item, f"resource_groups.{i}")
        if item.name
        else _by_device(session, item, f"resource_groups.{i}")
        for i, item in enumerate(items)
    ]
    named_only = all("name" in r for r in request)
    return request, ([dict(r) for r in request] if named_only else [])


def check_loader_workers(session: Session, request: list[dict], num_workers: int | None) -> None:
    """Refuse `data.num_workers` above the cores of a host in a named group of the request.

    Hosts are the group's serving agents that reported their hardware; a group without
    one is checked on the agent when the task starts (the engine refuses it there too).

    Raises:
        Invalid: naming `data.num_workers`, the group, the agent and its cores.
    """
    names = [item["name"] for item in request if "name" in item]
    if num_workers is None or not names:
        return
    rows = session.execute(
        select(ResourceGroup.name, Agent.name, Agent.hardware)
        .join(Agent, Agent.resource_group_id == ResourceGroup.id)
        .where(ResourceGroup.name.in_(names), LIVE, SERVING)
    ).all()
    for group, agent, hardware in rows:
        cores = (hardware or {}).get("cpu_cores")
        if isinstance(cores, int) and num_workers > cores:
            raise Invalid(
                f"data.num_workers is {num_workers} but agent '{agent}' of resource group "
                f"'{group}' has {cores} cores: ask for at most {cores}",
                field="data.num_workers",
            )
