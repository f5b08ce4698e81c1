"""`polytrain agent`: serve one resource group on this host (the parts of its tasks booked
for this agent)."""

import logging
import os
import socket
import threading
import time
from typing import Any

import httpx
import psutil
from celery import Celery, Task
from pydantic import ValidationError

from contracts.messaging import RUN_SUBTASK, broker_options, queue_name
from contracts.payload import SubTaskPayload
from worker.agent import netpolicy
from worker.agent.client import InternalApi
from worker.agent.hardware import detect_hardware
from worker.agent.identity import claim_instance_id
from worker.agent.monitoring import ResourceSampler
from worker.agent.processes import RunningRegistry, WarmPool
from worker.agent.runner import SubTaskRunner
from worker.agent.sandbox import Sandbox
from worker.agent.states import TaskStates
from worker.agent.uids import UidPool
from worker.config import AgentSettings

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)


def poll_embedded_broker_every(seconds: float) -> None:
    """Poll the SQLAlchemy transport every ``seconds`` in this process (the agent's
    ``broker_poll_s``).

    Set on kombu's transport class: the transport hands every transport option to
    SQLAlchemy's ``create_engine``, which refuses ``polling_interval``, so the option
    cannot travel with the others (`contracts.messaging.broker_options`).
    """
    from kombu.transport import sqlalchemy as sqla_transport

    sqla_transport.Transport.polling_interval = seconds


def make_celery(settings: AgentSettings, runner: SubTaskRunner) -> Celery:
    """The consumer app: late acks and prefetch 1, so a message is only taken when it can run.

    On Redis a message is redelivered only if unacknowledged for longer than
    the longest run (the visibility timeout, 31 days); a redelivered message
    for a sub-task already taken is ignored (the claim refuses it).
    """
    broker = settings.resolved_broker_url()
    if broker.startswith("sqla+"):
        poll_embedded_broker_every(settings.broker_poll_s)
    app = Celery("polytrain-agent", broker=broker)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_reject_on_worker_lost=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        broker_transport_options=broker_options(broker),
        broker_connection_max_retries=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )

    @app.task(name=RUN_SUBTASK, ignore_result=True, bind=True, shared=False)
    def run_sub_task(self: Task, payload: dict[str, Any]) -> str:
        return run_validated(runner, self.request.id, payload)

    return app


def run_validated(runner: SubTaskRunner, message_id: str | None, raw: Any) -> str:
    """Validate a message (JSON payload, Celery id = sub-task id) and run it; "invalid" if not.

    An invalid message is logged and dropped (acknowledged): retrying cannot fix it.
    """
    try:
        payload = SubTaskPayload.model_validate(raw)
    except ValidationError as exc:
        log.error("dropping invalid sub-task message %s: %s", message_id, exc)
        return "invalid"
    if message_id is not None and message_id != str(payload.sub_task_id):
        log.error("dropping message %s: it carries sub-task %s", message_id, payload.sub_task_id)
        return "invalid"
    return runner.run(payload)


def _heartbeats(
    api: InternalApi,
    agent_id: int,
    interval_s: float,
    stop: threading.Event,
    registry: RunningRegistry,
    sampler: ResourceSampler | None = None,
    states: TaskStates | None = None,
) -> None:
    """Every `interval_s`: the ranks alive, with their resource use when `sampler` has a
    sample due, and the tasks `states` watches, whose states the answer brings into it."""
    failing = BeatFailures()
    while not stop.wait(interval_s):
        try:
            answer = api.heartbeat(
                agent_id, registry.snapshot(sampler), states.watched() if states else None
            )
            if states is not None:
                states.update(answer)
        except Exception as exc:  # keep beating through a backend restart: once an interval
            failing.failed(exc, interval_s)
            continue
        failing.answered()


class BeatFailures:
    """The heartbeat loop's log of failed beats: the first of a run, then again when the
    error changes (a refused connection becoming a 503, or a 4xx the API will keep
    answering) and every `REPEAT_S` while they go on, and the beat that gets through: a
    line per outage, not a traceback per beat, yet a lasting refusal stays visible."""

    REPEAT_S = 60.0

    def __init__(self) -> None:
        self.since: float | None = None  # time.monotonic() of the first failure in a row
        self._logged: tuple[str, float] | None = None  # the error logged last, and when

    def failed(self, exc: Exception, interval_s: float) -> None:
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        kind = _error_kind(exc)
        if self._logged is not None and self._logged[0] == kind:
            if now - self._logged[1] < self.REPEAT_S:
                return
        self._logged = (kind, now)
        log.warning(
            "heartbeat failed (%s), failing for %.0f s; beating every %.1f s",
            exc,
            now - self.since,
            interval_s,
            exc_info=not isinstance(exc, httpx.HTTPError),
        )

    def answered(self) -> None:
        if self.since is not None:
            log.warning(
                "heartbeats reach the API again after %.1f s", time.monotonic() - self.since
            )
        self.since, self._logged = None, None


def _error_kind(exc: Exception) -> str:
    """What a failed beat met, to tell one error from the next: the HTTP status, or the
    exception's type."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__


def choose_gloo_interface(advertise_addr: str) -> None:
    """Make the ranks' gloo traffic leave from `advertise_addr`'s interface.

    Peers let a host's ranks in by the address its agent advertises
    (`worker.agent.netpolicy`), while gloo picks its interface from
    ``GLOO_SOCKET_IFNAME`` or else from what the host name resolves to. When the
    operator has not set ``GLOO_SOCKET_IFNAME``, it is set (for this agent's
    ranks) to the interface holding the advertised address (psutil); a warning
    says when no local interface holds it (e.g. an address behind NAT).
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    wanted = set(
        netpolicy.addresses([advertise_addr], ipv6=False)
        + netpolicy.addresses([advertise_addr], ipv6=True)
    )
    for interface, entries in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] in wanted for entry in entries):
            os.environ["GLOO_SOCKET_IFNAME"] = interface
            log.info("ranks' gloo traffic uses %s (holds %s)", interface, advertise_addr)
            return
    log.warning(
        "no interface of this host holds POLYTRAIN_ADVERTISE_ADDR=%s: set "
        "GLOO_SOCKET_IFNAME, or peers may not let this host's ranks in",
        advertise_addr,
    )


def run_agent(
    settings: AgentSettings, *, resource_group: str, workers: int, name: str | None = None
) -> None:
    """Register with the backend, heartbeat, and consume this agent's queue of its group
    (`rg.<group>.agent-<id>`: the parts booked for it) until stopped.

    Raises:
        NameClash: another agent on this host and data dir runs under `name`.
        Conflict: (field `name`) the backend knows a live agent of that name elsewhere.
        SandboxUnavailable: (naming the command that fixes it) before registering, if
            this host cannot sandbox ranks (docs/security.md).
        NoDevice: before registering, if this host cannot serve the group's device type
            (a `cuda` group without a usable GPU; docs/architecture.md, "Homogeneous groups").
        Conflict: (field `hardware.device_type` / `hardware.device_model`) the backend
            refused this host's hardware for the group.
    """
    choose_gloo_interface(settings.advertise_addr)
    sandbox = Sandbox.detect(
        user=settings.sandbox_user,
        data_dir=settings.data_dir,
        uids=UidPool(settings.sandbox_uid_first, settings.sandbox_uid_count),
        datasets_dir=settings.datasets_dir,
    )
    api = InternalApi(settings.api_url, settings.agent_token.get_secret_value(), retries=30)
    hardware = detect_hardware(api.group_device(resource_group).device_type)
    name = name or f"{socket.gethostname()}-{resource_group}-{os.getpid()}"
    instance_id = claim_instance_id(settings.data_dir, name)
    agent_id = api.register(
        name=name,
        instance_id=instance_id,
        host=settings.advertise_addr,
        resource_group=resource_group,
        workers=workers,
        hardware=hardware,
    )
    stop, registry, states = threading.Event(), RunningRegistry(), TaskStates()
    threading.Thread(
        target=_heartbeats,
        daemon=True,
        args=(
            api,
            agent_id,
            settings.heartbeat_interval_s,
            stop,
            registry,
            ResourceSampler(),
            states,
        ),
    ).start()
    # One warm interpreter per worker, and the parameter server; none when turned off.
    pool = WarmPool(workers + 1, sandbox) if settings.warm_pool else None
    runner = SubTaskRunner(settings, api, agent_id, sandbox, registry, pool, states=states)
    argv = [
        "worker",
        "-Q",
        queue_name(resource_group, agent_id),
        "-n",
        f"{name}@%h",
        "--pool",
        "threads",
        "--concurrency",
        str(workers),
        "--prefetch-multiplier",
        "1",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel",
        "INFO",
    ]
    try:
        while not _consume(make_celery(settings, runner), argv):
            # The consumer gave up (e.g. a broker restart hit a kombu error): start it again;
            # running sub-tasks finished first (warm shutdown), heartbeats never stopped.
            log.warning("the broker consumer stopped; starting it again in 2 s")
            time.sleep(2)
    finally:
        stop.set()
        if pool:
            pool.close()
        _deregister(settings, agent_id)


def _deregister(settings: AgentSettings, agent_id: int) -> None:
    """Go offline at once if the API answers; else the heartbeat timeout does it."""
    try:
        InternalApi(
            settings.api_url, settings.agent_token.get_secret_value(), retries=1
        ).deregister(agent_id)
    except Exception:  # the API may be gone already
        log.warning("could not deregister; the API will time the agent out")


def _consume(app: Celery, argv: list[str]) -> bool:
    """Serve the queue until the Celery worker stops; True if a signal asked it to stop."""
    from celery.worker import state

    state.should_stop = state.should_terminate = None
    try:
        app.worker_main(argv)
    except SystemExit:
        pass
    return state.should_stop is not None or state.should_terminate is not None
