"""Settings of the API service, read from the environment (and `.env`) by pydantic-settings."""

from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration of the polytrain API service.

    The embedded default needs nothing installed: SQLite for the database and
    Celery's SQLAlchemy transport over SQLite for the broker, both under
    `data_dir`. Production sets `DATABASE_URL=postgresql+psycopg://...` and
    `BROKER_URL=redis://...`. The agent token has no default: it is a secret.
    When `admin_email` and `admin_password` are set, the service creates that
    admin at start unless the account exists (the first admin; `polytrain users
    create-admin` does the same from a shell).
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
    max_upload_bytes: int = 1_000_000
    admin_email: str | None = None
    admin_password: SecretStr | None = None
    metrics_token: SecretStr | None = Field(
        default=None, description="if set, /metrics asks for 'Authorization: Bearer <it>'"
    )

    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite under `data_dir`."""
        return self.database_url or f"sqlite:///{self.data_dir.resolve() / 'polytrain.db'}"

    def resolved_broker_url(self) -> str:
        """The Celery broker URL, defaulting to the SQLAlchemy transport over SQLite."""
        return self.broker_url or f"sqla+sqlite:///{self.data_dir.resolve() / 'broker.db'}"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def code_dir(self) -> Path:
        return self.data_dir / "code"


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings (cached; tests clear the cache)."""
    settings = Settings()  # type: ignore[call-arg]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings
