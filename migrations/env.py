"""Alembic environment: the URL comes from the service's settings, never from alembic.ini."""

from alembic import context

from backend.core.config import get_settings
from backend.core.db import Base, make_engine
from backend.models import __all__ as _tables  # noqa: F401  (registers every table)

target_metadata = Base.metadata


def run_migrations_online() -> None:
    url = context.config.attributes.get("database_url") or get_settings().resolved_database_url()
    connectable = make_engine(url)
    with connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    connectable.dispose()


run_migrations_online()
