"""A PostgreSQL restart during a run is survived: the task ends well on its first attempt,
no agent is declared lost, no log line is lost, and new tasks still run.

The stack's database is a PostgreSQL cluster of this test's own (initdb into a temporary
folder, as the machine's PostgreSQL serves every other test), stopped for a few seconds
and started again in the middle of training, as a database failover or an operator's
restart would do: every connection the API held dies, and so does the scheduler's
advisory lock (docs/architecture.md, "Several API processes, one scheduler").
"""

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polytrain.stack import GroupSetup, LocalStack
from tests.e2e.conftest import COLD_RANKS, new_version, submit, wait_for
from tests.e2e.test_broker_restart import RedisServer
from tests.e2e.test_fault_tolerance import (
    ENDED,
    assert_logs_gap_free,
    assert_released,
    wait_checkpoints,
)
from worker.engine.ranks import free_port

OUTAGE_S = 4.0
"""How long the database is down: every request an agent makes meanwhile is answered 5xx and
tried again (a part's requests by the client, up to 30 more times 0.5-5 s apart; a report or
a claim by its caller every 5 s; a heartbeat at the next beat), and it is shorter than the
heartbeat timeout (15 s), so no agent may be declared lost."""


def _bin(name: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if not found:
        pytest.fail(f"PostgreSQL's {name} is needed (Debian package postgresql)")
    return str(found[-1])


class PostgresCluster:
    """A PostgreSQL cluster of its own on a free loopback port, run as the postgres user."""

    def __init__(self) -> None:
        # Not under pytest's temporary folders: the postgres user cannot enter root's.
        self.workdir = Path(tempfile.mkdtemp(prefix="polytrain-pg-"))
        shutil.chown(self.workdir, "postgres")
        self.port, self.data = free_port(), self.workdir / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *command: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *command],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

    def init(self) -> None:
        self._as_postgres(_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.workdir / "log")
        pg_ctl = _bin("pg_ctl")
        self._as_postgres(pg_ctl, "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def stop(self) -> None:
        self._as_postgres(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def database_stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalStack, PostgresCluster]]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed (Debian package redis-server)")
    cluster = PostgresCluster()
    cluster.init()
    cluster.start()
    broker = RedisServer(tmp_path_factory.mktemp("redis"))
    broker.start()
    stack = LocalStack(
        data_dir=tmp_path_factory.mktemp("db"),
        port=free_port(),
        groups=[GroupSetup("cpu-a", 2), GroupSetup("cpu-b", 1)],
        database_url=cluster.url,
        broker_url=broker.url,
        extra_env=COLD_RANKS,
    )
    try:
        with stack:
            yield stack, cluster
    finally:
        broker.stop()
        cluster.stop()
        cluster.remove()


def test_postgresql_restart_during_a_run(
    database_stack: tuple[LocalStack, PostgresCluster],
) -> None:
    stack, cluster = database_stack
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        version = new_version(api, example="mnist_cnn")
        task = submit(api, version, epochs=3, global_batch_size=64)
        wait_checkpoints(api, task["id"], 1)
        before = len(api.get(f"/api/v1/tasks/{task['id']}/checkpoints").json())
        cluster.stop()
        down = time.monotonic()
        refused = api.get(f"/api/v1/tasks/{task['id']}")  # the outage is real to the API
        assert refused.status_code >= 500, refused.text
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
        cluster.start()
        done = wait_for(api, task["id"], ENDED, 150)
        assert done["status"] == "SUCCEEDED", done["status_reason"]
        assert done["attempt"] == 1  # no agent was declared lost, no restart
        events = api.get(f"/api/v1/tasks/{task['id']}/events").json()
        assert not [e for e in events if e["kind"] == "alarm"], events
        assert_logs_gap_free(api, task["id"])
        # It trained across the outage: the later epochs' checkpoints (3 epochs and
        # final.pt in all) arrived after it.
        after_outage = api.get(f"/api/v1/tasks/{task['id']}/checkpoints").json()
        assert before < len(after_outage) == 4, (before, after_outage)
        assert_released(api, stack, done)
        agents = api.get("/api/v1/agents").json()
        assert agents and all(a["online"] for a in agents), agents
        after = submit(api, new_version(api, example="tiny_regression"), epochs=2)
        done = wait_for(api, after["id"], ENDED, 150)
        assert done["status"] == "SUCCEEDED", done["status_reason"]
        assert_released(api, stack, done)
