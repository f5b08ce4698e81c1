"""A Redis restart during a run is survived: the task ends well, and new tasks still run.

The stack's broker is a Redis server of this test's own (nothing kept on
disk, as in production without persistence), stopped and started again in
the middle of training.
"""

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from bench.services import redis_server
from polytrain.stack import GroupSetup, LocalStack
from tests import production
from tests.e2e.conftest import COLD_RANKS, new_version, submit, wait_for
from tests.e2e.test_fault_tolerance import ENDED, assert_released, wait_checkpoints
from worker.engine.ranks import free_port


class RedisServer:
    """A redis-server on a free loopback port, without persistence."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            redis_server(self.port, "--dir", str(self.workdir)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=1).ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def broker_stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalStack, RedisServer]]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed (Debian package redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    database = production.fresh_database(migrated=False) if production.enabled() else None
    stack = LocalStack(
        data_dir=tmp_path_factory.mktemp("rs"),
        port=free_port(),
        groups=[GroupSetup("cpu-a", 2), GroupSetup("cpu-b", 1)],
        database_url=database,
        broker_url=server.url,
        extra_env=COLD_RANKS,
    )
    try:
        with stack:
            yield stack, server
    finally:
        server.stop()
        if database:
            production.drop_database(database)


def test_redis_restart_during_a_run(broker_stack: tuple[LocalStack, RedisServer]) -> None:
    stack, server = broker_stack
    with httpx.Client(base_url=stack.url, timeout=30, headers=stack.headers) as api:
        version = new_version(api, example="mnist_cnn")
        task = submit(api, version, epochs=3, global_batch_size=64)
        wait_checkpoints(api, task["id"], 1)
        server.stop()
        time.sleep(3)
        server.start()
        done = wait_for(api, task["id"], ENDED, 150)
        assert done["status"] == "SUCCEEDED", done["status_reason"]
        assert done["attempt"] == 1
        assert_released(api, stack, done)
        after = submit(api, new_version(api, example="tiny_regression"), epochs=2)
        done = wait_for(api, after["id"], ENDED, 150)
        assert done["status"] == "SUCCEEDED", done["status_reason"]
        assert_released(api, stack, done)
