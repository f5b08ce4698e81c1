"""Prometheus metrics at `/metrics`, read from the database at each scrape.

Gauges, not counters kept in memory: several API processes then report the
same numbers, and a restart loses nothing (but `polytrain_scheduler_leader`, each
process's own). It reads several domains (tasks, agents,
resource groups), so it sits beside them at the package top, not in `core/`.
"""

import os
import socket
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.agents.models import Agent
from backend.core.db import get_sessionmaker
from backend.resource_groups.models import ResourceGroup
from backend.scheduler.loop import leading
from backend.tasks.models import (
    ACTIVE,
    RESOURCE_METRICS,
    Allocation,
    Metric,
    NodeRole,
    Task,
    TaskStatus,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def tasks_by_state(session: Session) -> dict[str, int]:
    """Number of tasks in each lifecycle state (every state present, 0 if none)."""
    query = select(Task.status, func.count(Task.id)).group_by(Task.status)
    counts: dict[TaskStatus, int] = {status: n for status, n in session.execute(query).all()}
    return {state.value: counts.get(state, 0) for state in TaskStatus}


def agents_online(session: Session) -> dict[str, int]:
    """Online agents per resource group name."""
    rows = session.execute(
        select(ResourceGroup.name, func.count(Agent.id))
        .join(Agent, Agent.resource_group_id == ResourceGroup.id)
        .where(Agent.online.is_(True))
        .group_by(ResourceGroup.name)
    ).all()
    found: dict[str, int] = {name: n for name, n in rows}
    names = session.scalars(
        select(ResourceGroup.name).where(ResourceGroup.deleted_at.is_(None))
    ).all()
    return {name: found.get(name, 0) for name in names}


def throughput_per_group(session: Session) -> dict[str, float]:
    """Samples/s of the running tasks per resource group: the sum of each compute
    rank's latest reported `samples_per_s`, the rank placed by its allocation."""
    placed = session.execute(
        select(Allocation.task_id, Allocation.rank, ResourceGroup.name)
        .join(ResourceGroup, ResourceGroup.id == Allocation.resource_group_id)
        .join(Task, Task.id == Allocation.task_id)
        .where(
            Task.status == TaskStatus.RUNNING,
            Allocation.role == NodeRole.COMPUTE,
            Allocation.released_at.is_(None),
        )
    ).all()
    latest = _latest_rates(session, task_ids={task_id for task_id, _, _ in placed})
    totals: dict[str, float] = defaultdict(float)
    for task_id, rank, group in placed:
        totals[group] += latest.get((task_id, rank), 0.0)
    return dict(totals)


def _latest_rates(session: Session, *, task_ids: set[int]) -> dict[tuple[int, int | None], float]:
    if not task_ids:
        return {}
    newest = (
        select(func.max(Metric.id))
        .where(
            Metric.task_id.in_(task_ids),
            Metric.name == "samples_per_s",
            Metric.rank.is_not(None),
            Metric.value.is_not(None),
        )
        .group_by(Metric.task_id, Metric.rank)
    )
    rows = session.execute(
        select(Metric.task_id, Metric.rank, Metric.value).where(Metric.id.in_(newest))
    )
    return {(task_id, rank): value for task_id, rank, value in rows if value is not None}


def rank_usage(session: Session) -> dict[tuple[int, int, str], float]:
    """The latest resource sample (`RESOURCE_METRICS`) of each rank of the active tasks, by
    (task id, rank, metric name)."""
    active = select(Task.id).where(Task.status.in_(ACTIVE))
    newest = (
        select(func.max(Metric.id))
        .where(
            Metric.task_id.in_(active),
            Metric.name.in_(RESOURCE_METRICS),
            Metric.rank.is_not(None),
            Metric.value.is_not(None),
        )
        .group_by(Metric.task_id, Metric.rank, Metric.name)
    )
    rows = session.execute(
        select(Metric.task_id, Metric.rank, Metric.name, Metric.value).where(Metric.id.in_(newest))
    )
    return {
        (task_id, rank, name): value
        for task_id, rank, name, value in rows
        if rank is not None and value is not None
    }


RANK_GAUGES = {
    "rank_cpu_percent": ("polytrain_rank_cpu_percent", "CPU of a rank's processes (% of one core)"),
    "rank_rss_mb": ("polytrain_rank_memory_rss_mib", "Resident memory of a rank's processes (MiB)"),
    "rank_gpu_util": ("polytrain_rank_gpu_utilization_percent", "GPU utilization of a rank (%)"),
    "rank_gpu_mem_mb": ("polytrain_rank_gpu_memory_mib", "GPU memory of a rank's processes (MiB)"),
}
"""The gauge (name, help) of each resource metric: the latest sample of each active task's
ranks, labelled task and rank."""


class DatabaseCollector(Collector):
    """Collects the platform's gauges with one short database session per scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with get_sessionmaker()() as session:
            states = tasks_by_state(session)
            agents = agents_online(session)
            rates = throughput_per_group(session)
            usage = rank_usage(session)
        tasks = GaugeMetricFamily("polytrain_tasks", "Tasks by lifecycle state", labels=["state"])
        for state, count in states.items():
            tasks.add_metric([state], count)
        yield tasks
        yield GaugeMetricFamily(
            "polytrain_queue_depth",
            "Tasks waiting for resources (QUEUED)",
            value=states[TaskStatus.QUEUED.value],
        )
        online = GaugeMetricFamily(
            "polytrain_agents_online", "Online agents per resource group", labels=["resource_group"]
        )
        for group, count in agents.items():
            online.add_metric([group], count)
        yield online
        throughput = GaugeMetricFamily(
            "polytrain_group_throughput_samples_per_second",
            "Training throughput of running tasks per resource group (samples/s)",
            labels=["resource_group"],
        )
        for group, rate in rates.items():
            throughput.add_metric([group], rate)
        yield throughput
        yield from _rank_gauges(usage)


def _rank_gauges(usage: dict[tuple[int, int, str], float]) -> Iterator[GaugeMetricFamily]:
    for metric, (name, documentation) in RANK_GAUGES.items():
        gauge = GaugeMetricFamily(name, documentation, labels=["task", "rank"])
        for (task_id, rank, found), value in sorted(usage.items()):
            if found == metric:
                gauge.add_metric([str(task_id), str(rank)], value)
        yield gauge


class LeaderCollector(Collector):
    """Whether the answering process runs the scheduler (the elected one among several API
    processes: :mod:`backend.scheduler.leader`), labelled with its host and pid: the one
    gauge that differs between processes."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "polytrain_scheduler_leader",
            "1 if this API process runs the scheduler and the liveness monitor, else 0",
            labels=["process"],
        )
        gauge.add_metric([f"{socket.gethostname()}:{os.getpid()}"], 1.0 if leading() else 0.0)
        yield gauge


def render_metrics() -> bytes:
    """The current metrics in the Prometheus text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    registry.register(LeaderCollector())
    return generate_latest(registry)
