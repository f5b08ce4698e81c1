"""Run the Alembic migrations programmatically (used by the CLI and the tests)."""

from pathlib import Path

from alembic import command
from alembic.config import Config

ROOT = Path(__file__).resolve().parents[2]


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic config pointing at `migrations/`, optionally for a given URL."""
    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(ROOT / "migrations"))
    if database_url:
        config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str | None = None, revision: str = "head") -> None:
    """Upgrade the database to `revision` (default: the newest)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str | None = None, revision: str = "base") -> None:
    """Downgrade the database to `revision` (default: empty)."""
    command.downgrade(alembic_config(database_url), revision)
