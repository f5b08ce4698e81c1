"""`polytrain agent`: serve one resource group's queue on this host."""

import logging
import os
import platform
import socket
import threading
from typing import Any

from celery import Celery

from backend.scheduler.payload import RUN_SUBTASK, queue_name
from worker.agent.client import InternalApi
from worker.agent.processes import RunningRegistry
from worker.agent.runner import SubTaskRunner
from worker.config import AgentSettings

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)


def detect_hardware() -> dict[str, Any]:
    """CPU cores, memory (bytes) and CUDA devices of this host."""
    import torch

    memory = 0
    try:
        with open("/proc/meminfo") as fh:
            memory = int(fh.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu_cores": os.cpu_count(), "memory_bytes": memory, "cuda_devices": cuda,
            "platform": platform.platform(), "torch": torch.__version__}


def make_celery(settings: AgentSettings, runner: SubTaskRunner) -> Celery:
    """The consumer app: late acks and prefetch 1, so a message is only taken when it can run."""
    broker = settings.resolved_broker_url()
    app = Celery("polytrain-agent", broker=broker)
    if broker.startswith(("redis", "rediss")):
        # A message is redelivered only if unacked for longer than the longest run (7 days).
        app.conf.broker_transport_options = {"visibility_timeout": 7 * 24 * 3600}
    app.conf.update(
        task_serializer="json", accept_content=["json"], task_acks_late=True,
        worker_prefetch_multiplier=1, task_reject_on_worker_lost=True,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
    )

    @app.task(name=RUN_SUBTASK, ignore_result=True)
    def run_sub_task(payload: dict[str, Any]) -> str:
        return runner.run(payload)

    return app


def _heartbeats(api: InternalApi, agent_id: int, interval_s: float, stop: threading.Event,
                registry: RunningRegistry) -> None:
    while not stop.wait(interval_s):
        try:
            api.heartbeat(agent_id, registry.snapshot())
        except Exception:  # keep beating through a backend restart
            log.warning("heartbeat failed", exc_info=True)


def run_agent(settings: AgentSettings, *, resource_group: str, workers: int,
              name: str | None = None) -> None:
    """Register with the backend, heartbeat, and consume `rg.<group>` until stopped."""
    api = InternalApi(settings.api_url, settings.agent_token.get_secret_value(), retries=30)
    name = name or f"{socket.gethostname()}-{resource_group}-{os.getpid()}"
    agent_id = api.register(name=name, host=settings.advertise_addr,
                            resource_group=resource_group, workers=workers,
                            hardware=detect_hardware())
    stop, registry = threading.Event(), RunningRegistry()
    threading.Thread(target=_heartbeats, daemon=True,
                     args=(api, agent_id, settings.heartbeat_interval_s, stop, registry)).start()
    app = make_celery(settings, SubTaskRunner(settings, api, agent_id, registry))
    try:
        app.worker_main([
            "worker", "-Q", queue_name(resource_group), "-n", f"{name}@%h",
            "--pool", "threads", "--concurrency", str(workers), "--prefetch-multiplier", "1",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO",
        ])
    finally:
        stop.set()
        api.deregister(agent_id)
