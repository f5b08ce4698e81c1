"""Run the Alembic migrations programmatically (used by the CLI and the tests)."""

from alembic import command
from alembic.config import Config

from backend.core.paths import asset


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic config pointing at `migrations/` (in the installed package or the
    checkout, `backend.core.paths`), optionally for a given URL."""
    config = Config(str(asset("alembic.ini")))
    config.set_main_option("script_location", str(asset("migrations")))
    if database_url:
        config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str | None = None, revision: str = "head") -> None:
    """Upgrade the database to `revision` (default: the newest)."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str | None = None, revision: str = "base") -> None:
    """Downgrade the database to `revision` (default: empty)."""
    command.downgrade(alembic_config(database_url), revision)
