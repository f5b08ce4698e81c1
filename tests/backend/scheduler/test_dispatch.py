"""First-level dispatch through a real broker: the message, its queue and its Celery id."""

from pathlib import Path

import pytest
from kombu import Connection

from backend.core.config import get_settings
from backend.scheduler.dispatch import CeleryDispatcher, producer_app
from contracts.messaging import broker_options
from contracts.payload import MAX_RUNTIME_S, SubTaskPayload
from contracts.plan import GroupPlan
from worker.agent.main import make_celery
from worker.config import AgentSettings

pytestmark = pytest.mark.stack


@pytest.fixture
def broker_url(db_backend: str, service_env: object, monkeypatch: pytest.MonkeyPatch) -> str:
    from tests import production
    from tests.conftest import _clear_caches

    if db_backend == "postgresql":
        monkeypatch.setenv("BROKER_URL", production.fresh_broker())
        _clear_caches()
    return get_settings().resolved_broker_url()


def test_message_on_its_agents_queue_with_the_sub_task_id(broker_url: str) -> None:
    payload = SubTaskPayload(
        task_id=4,
        sub_task_id=17,
        group_index=1,
        agent_id=5,
        hosts_parameter_server=False,
        epochs=1,
        global_batch_size=8,
        attempt=2,
        resume_checkpoint_id=3,
        groups=[
            GroupPlan(name="cpu-a", device_type="cpu", workers=1),
            GroupPlan(name="cpu-b", device_type="cpu", workers=1),
        ],
    )
    CeleryDispatcher().send(payload)
    with Connection(broker_url, transport_options=broker_options(broker_url)) as conn:
        message = conn.SimpleQueue("rg.cpu-b.agent-5").get(timeout=10)
        headers, body = message.headers, message.decode()
        message.ack()
    assert headers["id"] == "17" and headers["task"] == "polytrain.run_sub_task"
    assert SubTaskPayload.model_validate(body[0][0]) == payload


@pytest.mark.parametrize("broker", ["redis://broker.invalid:6379/0", None])
def test_producer_and_consumers_share_the_broker_options(
    broker: str | None, service_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API's producer and the agents' consumer app use one set of transport options; on
    Redis its visibility timeout (after which an unacknowledged message, i.e. a sub-task still
    running, is delivered again) outlasts the longest wall-clock limit a task may ask for."""
    from tests.conftest import _clear_caches

    if broker:
        monkeypatch.setenv("BROKER_URL", broker)
    _clear_caches()
    agent = AgentSettings(
        _env_file=None,
        agent_token="t",
        broker_url=broker,  # type: ignore[call-arg]
        data_dir=str(service_env),
    )
    produced = producer_app().conf.broker_transport_options
    consumed = make_celery(agent, runner=None).conf.broker_transport_options  # type: ignore[arg-type]
    assert produced == consumed
    if broker:
        assert consumed["visibility_timeout"] > MAX_RUNTIME_S
