"""First-level dispatch through a real broker: the message, its queue and its Celery id."""

import pytest
from kombu import Connection

from backend.core.config import get_settings
from backend.scheduler.dispatch import CeleryDispatcher
from contracts.messaging import broker_options
from contracts.payload import SubTaskPayload
from contracts.plan import GroupPlan

pytestmark = pytest.mark.stack


@pytest.fixture
def broker_url(db_backend: str, service_env: object, monkeypatch: pytest.MonkeyPatch) -> str:
    from tests import production
    from tests.conftest import _clear_caches

    if db_backend == "postgresql":
        monkeypatch.setenv("BROKER_URL", production.fresh_broker())
        _clear_caches()
    return get_settings().resolved_broker_url()


def test_message_on_the_group_queue_with_the_sub_task_id(broker_url: str) -> None:
    payload = SubTaskPayload(task_id=4, sub_task_id=17, group_index=1, hosts_parameter_server=False,
                             epochs=1, global_batch_size=8, attempt=2, resume_checkpoint_id=3,
                             groups=[GroupPlan(name="cpu-a", device_type="cpu", workers=1),
                                     GroupPlan(name="cpu-b", device_type="cpu", workers=1)])
    CeleryDispatcher().send(payload)
    with Connection(broker_url, transport_options=broker_options(broker_url)) as conn:
        message = conn.SimpleQueue("rg.cpu-b").get(timeout=10)
        headers, body = message.headers, message.decode()
        message.ack()
    assert headers["id"] == "17" and headers["task"] == "polytrain.run_sub_task"
    assert SubTaskPayload.model_validate(body[0][0]) == payload


def test_redis_visibility_timeout_outlasts_any_run() -> None:
    assert broker_options("redis://h:6379/0")["visibility_timeout"] >= 7 * 24 * 3600
    assert broker_options("sqla+sqlite:///x.db") == {}
