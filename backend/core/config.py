"""Settings of the API service, read from the environment (and `.env`) by pydantic-settings."""

from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.messaging import resolve_broker_url
from contracts.packages import PackageIndexSettings


class Settings(PackageIndexSettings, BaseSettings):
    """Configuration of the polytrain API service.

    The embedded default needs nothing installed: SQLite for the database and
    Celery's SQLAlchemy transport over SQLite for the broker, both under
    `data_dir`. Production sets `DATABASE_URL=postgresql+psycopg://...` and
    `BROKER_URL=redis://...`. The agent token has no default: it is a secret.
    When `admin_email` and `admin_password` are set, the service creates that
    admin at start unless the account exists (the first admin; `polytrain users
    create-admin` does the same from a shell).

    Code versions' own packages are resolved at upload against the package index of
    `index_url`, `extra_index_urls`, `find_links` and `wheels_only` (`POLYTRAIN_INDEX_URL`,
    ...; `package_index()`), with uv's cache in `uv_cache_dir` (docs/security.md,
    "Training code's own packages").
    """

    model_config = SettingsConfigDict(env_prefix="POLYTRAIN_", env_file=".env", extra="ignore")

    data_dir: Path = Path("var")
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("DATABASE_URL", "POLYTRAIN_DATABASE_URL")
    )
    broker_url: str | None = Field(
        default=None, validation_alias=AliasChoices("BROKER_URL", "POLYTRAIN_BROKER_URL")
    )
    agent_token: SecretStr
    heartbeat_timeout_s: float = 15.0
    scheduler_interval_s: float = 1.0
    scheduler_lease_s: float = Field(
        default=5.0,
        ge=0.2,
        description="PostgreSQL, several API processes: the scheduler leader's lease period. "
        "The database ends the leader's session when it is silent this long, and "
        "another process takes over within two periods of the leader's death "
        "(docs/architecture.md, 'Several API processes, one scheduler')",
    )
    max_upload_bytes: int = 1_000_000
    admin_email: str | None = None
    admin_password: SecretStr | None = None
    metrics_token: SecretStr | None = Field(
        default=None, description="if set, /metrics asks for 'Authorization: Bearer <it>'"
    )
    # Running behind a TLS-terminating proxy (docs/security.md).
    cookie_secure: bool = Field(
        default=False,
        description="mark session cookies Secure even when the API itself "
        "is reached over plain HTTP (set it behind a TLS proxy)",
    )
    forwarded_allow_ips: str | None = Field(
        default=None,
        description="comma-separated proxy addresses (or '*') whose "
        "X-Forwarded-For/-Proto headers are trusted; unset: none are",
    )
    docs_enabled: bool = Field(default=True, description="serve /docs, /redoc and /openapi.json")
    # Request bodies: refused with 413 before they are read (bytes).
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024)
    max_internal_body_bytes: int = Field(
        default=512 * 1024 * 1024, ge=1024, description="bodies on /internal/v1 (checkpoints)"
    )
    # Sign-in abuse (limits' rate strings, e.g. "10/minute").
    login_rate_per_account: str = "10/minute"
    login_rate_per_address: str = "30/minute"
    rate_limit_storage_url: str | None = Field(
        default=None,
        description="where login counters live: unset, this process's memory; "
        "'redis://host:6379/1' to share them among several API processes",
    )
    hash_concurrency: int = Field(
        default=1,
        ge=1,
        description="argon2 hashes run at once (one already runs its 4 lanes on parallel threads)",
    )
    hash_queue: int = Field(
        default=8,
        ge=0,
        description="logins that may wait for a hash slot (more are answered 503 at once)",
    )
    hash_wait_s: float = Field(default=5.0, gt=0, description="longest wait for a hash slot")
    password_hash_time_cost: int = Field(
        default=3,
        ge=1,
        description="argon2id passes over memory (RFC 9106's low-memory profile: 3); a login "
        "with a hash of other parameters is hashed again with these",
    )
    password_hash_memory_kib: int = Field(
        default=64 * 1024,
        ge=32,  # argon2's least: 8 KiB per lane, 4 lanes
        description="argon2id memory per hash in KiB (RFC 9106's low-memory profile: 65536)",
    )
    token_default_expiry_days: int = Field(default=90, ge=1, le=3650)
    token_cap_per_user: int = Field(default=20, ge=1, description="live API tokens per user")

    @field_validator("login_rate_per_account", "login_rate_per_address")
    @classmethod
    def _rate(cls, value: str) -> str:
        from limits import parse

        try:
            parse(value)
        except ValueError as exc:
            raise ValueError(f"not a rate like '10/minute': {value!r}") from exc
        return value

    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite under `data_dir`."""
        return self.database_url or f"sqlite:///{self.data_dir.resolve() / 'polytrain.db'}"

    def resolved_broker_url(self) -> str:
        """The Celery broker URL, defaulting to the SQLAlchemy transport over SQLite."""
        return resolve_broker_url(self.broker_url, self.data_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def code_dir(self) -> Path:
        return self.data_dir / "code"

    @property
    def uv_cache_dir(self) -> Path:
        """uv's cache of package metadata and wheels, for resolving code versions' requirements."""
        return self.data_dir / "uv-cache"


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings (cached; tests clear the cache)."""
    settings = Settings()  # type: ignore[call-arg]
    private_dir(settings.data_dir)
    return settings


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) if needed and make it mode 0700: the data dir holds the
    database, checkpoints and the first admin's password, readable by the service alone."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


def private_file(path: Path) -> Path:
    """Make an existing file mode 0600 (owner read/write only); a missing one is ignored."""
    if path.exists():
        path.chmod(0o600)
    return path
