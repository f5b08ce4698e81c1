"""Alembic migrations upgrade and downgrade on SQLite and PostgreSQL, and match the models."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from backend.core.db import Base, make_engine
from backend.core.migrate import downgrade, upgrade
from tests import production

pytestmark = pytest.mark.stack


@pytest.fixture
def empty_url(db_backend: str, tmp_path: Path) -> Iterator[str]:
    if db_backend == "postgresql":
        url = production.fresh_database(migrated=False)
        yield url
        production.drop_database(url)
    else:
        yield f"sqlite:///{tmp_path / 'migrate.db'}"


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    upgrade(empty_url)
    assert {"task", "resource_group", "task_dependency", "allocation"} <= _tables(empty_url)
    downgrade(empty_url)
    assert _tables(empty_url) == set()
    upgrade(empty_url)
    assert "task_dependency" in _tables(empty_url)


def test_models_match_the_migrations(empty_url: str) -> None:
    upgrade(empty_url)
    engine = make_engine(empty_url)
    import backend.core.models  # noqa: F401  (registers every table)

    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diff = [d for d in compare_metadata(context, Base.metadata)
                if not (d[0] in ("add_index", "remove_index") and d[1].name == "ix_task_queue")]
    engine.dispose()
    assert diff == []
