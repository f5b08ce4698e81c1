"""The production stack in tests: PostgreSQL databases and Redis brokers of their own.

`make test` runs the tests marked `stack` twice, on the embedded default
(SQLite) and, when `POLYTRAIN_TEST_DATABASE_URL` and `POLYTRAIN_TEST_BROKER_URL`
are set, on PostgreSQL (through psycopg 3) with a Redis broker. Each test gets
a fresh database copied from a migrated template; each stack a Redis database
emptied first. If the variables are set but a server cannot be reached, the
run stops with an error: it never skips.
"""

import itertools
import os
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from sqlalchemy.engine import make_url

from backend.core.migrate import upgrade

DATABASE_ENV = "POLYTRAIN_TEST_DATABASE_URL"
BROKER_ENV = "POLYTRAIN_TEST_BROKER_URL"
_counter = itertools.count()
_template: str | None = None


def enabled() -> bool:
    """True when the production stack is configured for this run."""
    return bool(os.environ.get(DATABASE_ENV)) or bool(os.environ.get(BROKER_ENV))


def backends() -> list[str]:
    """The database backends a `stack` test runs on."""
    return ["sqlite", "postgresql"] if enabled() else ["sqlite"]


def check_reachable() -> str | None:
    """None if both servers answer, else what is wrong (both variables are required)."""
    url, broker = os.environ.get(DATABASE_ENV), os.environ.get(BROKER_ENV)
    if not url or not broker:
        return f"set both {DATABASE_ENV} and {BROKER_ENV}, or neither"
    try:
        with psycopg.connect(_dsn(url), connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"PostgreSQL at {DATABASE_ENV} cannot be reached: {exc}"
    try:
        redis.Redis.from_url(broker, socket_connect_timeout=5).ping()
    except redis.RedisError as exc:
        return f"Redis at {BROKER_ENV} cannot be reached: {exc}"
    return None


def _dsn(url: str, database: str | None = None) -> str:
    """A libpq connection string for a SQLAlchemy URL (optionally another database)."""
    parsed = make_url(url).set(drivername="postgresql")
    if database:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


def _admin(sql: str) -> None:
    with psycopg.connect(_dsn(os.environ[DATABASE_ENV]), autocommit=True) as conn:
        conn.execute(sql)


def _with_database(name: str) -> str:
    return (
        make_url(os.environ[DATABASE_ENV]).set(database=name).render_as_string(hide_password=False)
    )


def template() -> str:
    """A database migrated to head once per run, copied for each test."""
    global _template
    if _template is None:
        name = f"pt_tpl_{os.getpid()}"
        _admin(f'DROP DATABASE IF EXISTS "{name}"')
        _admin(f'CREATE DATABASE "{name}"')
        upgrade(_with_database(name))
        _template = name
    return _template


def fresh_database(*, migrated: bool = True) -> str:
    """The URL of a new, empty (or migrated) PostgreSQL database."""
    name = f"pt_{os.getpid()}_{next(_counter)}"
    _admin(f'DROP DATABASE IF EXISTS "{name}"')
    _admin(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template()}"' if migrated else ""))
    return _with_database(name)


def drop_database(url: str) -> None:
    """Drop the database of `url`, ending its leftover connections."""
    name = make_url(url).database
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def drop_template() -> None:
    global _template
    if _template:
        _admin(f'DROP DATABASE IF EXISTS "{_template}" WITH (FORCE)')
        _template = None


def fresh_broker() -> str:
    """A Redis database of its own (1-15, by process and count), emptied first.

    Under pytest-xdist each worker draws from its own slice of 1-15, so one worker never
    empties a database another is using."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    per_worker = 15 // workers
    slot = (os.getpid() + next(_counter)) % per_worker
    parts = urlsplit(os.environ[BROKER_ENV])
    url = urlunsplit(parts._replace(path=f"/{1 + index * per_worker + slot}"))
    redis.Redis.from_url(url).flushdb()
    return url


def leader_pid(url: str) -> int | None:
    """The pid of the API process whose session holds the scheduler's lock on the database of
    `url` (from the session's application_name, `backend.scheduler.leader.process_name`),
    or None while no process leads."""
    from backend.scheduler.leader import LEADING_SESSION_PARAMS, LEADING_SESSION_SQL, leader_pid_in

    with psycopg.connect(_dsn(url), autocommit=True) as conn:
        row = conn.execute(LEADING_SESSION_SQL, LEADING_SESSION_PARAMS).fetchone()
    return leader_pid_in(row[0]) if row else None
