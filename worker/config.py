"""Settings of an agent, read from the environment (and `.env`) by pydantic-settings.

Agents hold no database credentials: they talk to the backend's internal API
with the agent token, and to the broker for their group's queue.
"""

import logging
import socket

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.messaging import resolve_broker_url
from contracts.packages import PackageIndexSettings
from worker.engine.ranks import JEMALLOC_ON, JEMALLOC_PATHS, jemalloc_path


def default_address() -> str:
    """The address other hosts reach this one at (the outgoing interface), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for UDP connect
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class AgentSettings(PackageIndexSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="POLYTRAIN_", env_file=".env", extra="ignore")

    api_url: str = "http://127.0.0.1:8000"
    broker_url: str | None = Field(
        default=None, validation_alias=AliasChoices("BROKER_URL", "POLYTRAIN_BROKER_URL")
    )
    data_dir: str = "var"
    agent_token: SecretStr
    advertise_addr: str = Field(default_factory=default_address)
    heartbeat_interval_s: float = 3.0
    broker_poll_s: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description="seconds between looks for a message on the embedded broker (Celery's "
        "SQLAlchemy transport, polled; kombu's own 1 s adds half a second on average to a "
        "task's start); an empty look is one small SELECT. Redis and RabbitMQ push instead",
    )
    warm_pool: bool = Field(
        default=True,
        description="keep warm interpreters (torch imported) ready for the next task's ranks; "
        "off: every rank starts a fresh interpreter (a cold start, as benchmarks measure it)",
    )
    jemalloc: str = Field(
        default="",
        description="the allocator of a sharded group's workers (sharding: fsdp): empty or "
        "'off', glibc's malloc with a fixed mmap threshold (the least memory); 'on', jemalloc "
        "from the distribution's libjemalloc2 (about twice as fast a step at 10M parameters, "
        "10-15 % more memory per worker); or the path of a libjemalloc.so.2 under /usr. "
        "Such a worker then starts in a fresh interpreter, not a warm one",
    )

    @field_validator("jemalloc")
    @classmethod
    def _jemalloc_is_usable(cls, value: str) -> str:
        """Refuse at start what would fail every sharded task later (ValueError: a path that
        is no root-owned library under /usr); warn once where ``on`` finds no library."""
        on = value.strip().lower() in JEMALLOC_ON
        if jemalloc_path({"POLYTRAIN_JEMALLOC": value}) is None and on:
            logging.getLogger(__name__).warning(
                "POLYTRAIN_JEMALLOC=%s but no libjemalloc.so.2 in %s: sharded groups' workers "
                "run on glibc's malloc (Debian: apt-get install libjemalloc2)",
                value,
                ", ".join(JEMALLOC_PATHS),
            )
        return value

    rendezvous_timeout_s: float = 120.0
    dist_timeout_s: float = 120.0
    sandbox_user: str = Field(
        default="polytrain-run",
        min_length=1,
        description="the unprivileged user whose group ranks run in",
    )
    sandbox_uid_first: int = Field(
        default=2_100_000_000,
        ge=1000,
        le=2**31 - 2**16,
        description="first uid of the pool ranks run as, one each",
    )
    datasets_dir: str | None = Field(
        default=None,
        description="a folder of datasets on this host (e.g. an image folder on NFS) that "
        "ranks may read, mounted read-only in their sandbox at the same path and named to "
        "them in POLYTRAIN_DATASETS; nothing else of the host is visible to them",
    )
    sandbox_uid_count: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="sandbox uids on this host: at least every "
        "rank and warm interpreter of its agents",
    )

    env_cache_max_mb: int = Field(
        default=20_000,
        ge=1,
        description="disk for code versions' environments on this host (MiB): beyond it the "
        "least recently used environments no task runs with are removed",
    )

    def resolved_broker_url(self) -> str:
        """The broker, defaulting (like the API) to the SQLAlchemy transport over SQLite."""
        return resolve_broker_url(self.broker_url, self.data_dir)
