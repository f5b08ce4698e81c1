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
    import backend.models  # noqa: F401  (registers every table)

    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diff = [
            d
            for d in compare_metadata(context, Base.metadata)
            if not (d[0] in ("add_index", "remove_index") and d[1].name == "ix_task_queue")
        ]
    engine.dispose()
    assert diff == []


def test_tokens_without_an_expiry_get_the_default_one(empty_url: str) -> None:
    """Tokens made before every token expired are given the default expiry on upgrade."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import text

    upgrade(empty_url, "5b1e0c7d2a41")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    'INSERT INTO "user" (id, email, name, password_hash, role, is_active, '
                    "created_at) VALUES (1, 'a@example.org', '', 'x', 'MEMBER', true, :now)"
                ),
                {"now": datetime(2026, 1, 1)},
            )
            for token_id, revoked in ((1, None), (2, datetime(2026, 1, 2))):
                connection.execute(
                    text(
                        "INSERT INTO api_token (id, user_id, name, token_hash, prefix, created_at, "
                        "revoked_at) VALUES (:id, 1, 'cli', :hash, 'pt_', :now, :revoked)"
                    ),
                    {
                        "id": token_id,
                        "hash": str(token_id) * 64,
                        "now": datetime(2026, 1, 1),
                        "revoked": revoked,
                    },
                )
        upgrade(empty_url)
        with engine.connect() as connection:
            rows = dict(connection.execute(text("SELECT id, expires_at FROM api_token")).all())
    finally:
        engine.dispose()
    expires = rows[1] if isinstance(rows[1], datetime) else datetime.fromisoformat(rows[1])
    now = datetime.now(UTC).replace(tzinfo=None)
    assert abs(expires - (now + timedelta(days=90))) < timedelta(hours=1)
    assert rows[2] is None  # a revoked token stays as it was


def test_existing_groups_accept_the_next_agents_model(empty_url: str) -> None:
    """Groups made before homogeneous groups get no accepted models (the next agent's is
    adopted); the downgrade drops the column and keeps the groups."""
    import json
    from datetime import datetime

    from sqlalchemy import text

    upgrade(empty_url, "9879ba3bbc45")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "INSERT INTO resource_group (id, name, device_type, description, capacity, "
                    "created_at, labels, state) VALUES (1, 'cpu-a', 'cpu', '', 2, :now, '{}', "
                    "'ACTIVE')"
                ),
                {"now": datetime(2026, 1, 1)},
            )
        upgrade(empty_url)
        with engine.connect() as connection:
            models = connection.execute(text("SELECT accepted_models FROM resource_group")).scalar()
        assert (json.loads(models) if isinstance(models, str) else models) == []
        downgrade(empty_url, "9879ba3bbc45")
        with engine.connect() as connection:
            assert connection.execute(text("SELECT name FROM resource_group")).scalar() == "cpu-a"
        assert "accepted_models" not in {
            column["name"] for column in inspect(engine).get_columns("resource_group")
        }
    finally:
        engine.dispose()
