"""Fixtures of the agent's tests: a fake internal API, agent settings and sub-task payloads."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from contracts.payload import SubTaskPayload
from tests.worker.agent.fakes import FakeApi, FakePool
from worker.agent.runner import SubTaskRunner
from worker.config import AgentSettings

HOST = "10.0.0.5"


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def settings(tmp_path: Path) -> AgentSettings:
    return AgentSettings(
        _env_file=None,
        agent_token="agent-token",  # type: ignore[call-arg]
        data_dir=str(tmp_path / "data"),
        advertise_addr=HOST,
        heartbeat_interval_s=0.01,
        rendezvous_timeout_s=5.0,
    )


def make_payload(**overrides: Any) -> SubTaskPayload:
    """Group `a` (2 workers, ranks 1-2) hosting the parameter server, and group `b` (rank 3)."""
    fields: dict[str, Any] = {
        "task_id": 4,
        "sub_task_id": 17,
        "group_index": 0,
        "hosts_parameter_server": True,
        "epochs": 1,
        "global_batch_size": 8,
        "groups": [
            {"name": "a", "device_type": "cpu", "workers": 2},
            {"name": "b", "device_type": "cpu", "workers": 1},
        ],
    }
    return SubTaskPayload.model_validate({**fields, **overrides})


@pytest.fixture
def run_with(
    api: FakeApi, settings: AgentSettings, tmp_path: Path
) -> Iterator[Callable[..., tuple[str, FakePool]]]:
    """Run a payload's sub-task on a runner whose rank r runs the shell script `scripts[r]`."""
    pools: list[FakePool] = []

    def run(scripts: Mapping[int, str], **payload: Any) -> tuple[str, FakePool]:
        pool = FakePool(tmp_path / "ranks", scripts)
        pools.append(pool)
        runner = SubTaskRunner(
            settings,
            api.client(),
            agent_id=7,
            sandbox=None,  # type: ignore[arg-type]
            pool=pool,
        )  # type: ignore[arg-type]
        return runner.run(make_payload(**payload)), pool

    yield run
    for pool in pools:
        pool.close()
