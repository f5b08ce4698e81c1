"""NaN and infinite metric values reach REST and the task page instead of being dropped.

The path is the real one: engine event lines (:func:`worker.engine.report.metric`)
read by the agent's Reporter, sent by its InternalApi client to the backend,
stored, then read back through `GET /api/v1/tasks/{id}/metrics` and the portal page.
"""

import math
import queue

from fastapi.testclient import TestClient

from tests.backend.conftest import World
from tests.backend.web.dom import parse
from tests.conftest import TOKEN, agent_headers
from worker.agent.client import InternalApi
from worker.agent.reporter import Reporter
from worker.engine import report


def _agent_api(client: TestClient) -> InternalApi:
    """The agent's client, talking to the app in process."""
    api = InternalApi("http://testserver", TOKEN)
    api._http = TestClient(
        client.app,
        base_url="http://testserver/internal/v1",  # noqa: SLF001
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    return api


def test_nonfinite_values_show_in_rest_and_on_the_task_page(
    world: World,
    capsys,  # type: ignore[no-untyped-def]
) -> None:
    client, task_id = world.client, world.task["id"]
    report.metric("train_loss", math.nan, step=4, epoch=1, rank=0)
    report.metric("val_loss", math.inf, step=4, epoch=1, rank=0)
    report.metric("samples_per_s", 812.5, step=4, epoch=1, rank=2)
    lines: queue.Queue[tuple[str, str]] = queue.Queue()
    for line in capsys.readouterr().out.splitlines():
        lines.put(("rank-0", line))
    reporter = Reporter(_agent_api(client), task_id, group="cpu-a")
    reporter.pump(lines)
    reporter.flush()

    metrics = client.get(f"/api/v1/tasks/{task_id}/metrics", headers=world.owner.headers).json()
    by_name = {m["name"]: m for m in metrics}
    assert by_name["train_loss"].pop("created_at")
    assert by_name["train_loss"].pop("id") < by_name["val_loss"]["id"]  # in the order stored
    assert by_name["train_loss"] == {
        "step": 4,
        "epoch": 1,
        "name": "train_loss",
        "value": None,
        "nonfinite": "nan",
        "rank": None,
    }
    assert by_name["val_loss"]["value"] is None and by_name["val_loss"]["nonfinite"] == "inf"
    assert by_name["samples_per_s"]["value"] == 812.5
    assert by_name["samples_per_s"]["nonfinite"] is None

    page = parse(client.get(f"/tasks/{task_id}").text)
    box = page.by_id("nonfinite-metrics")
    assert "hidden" not in box.attrs
    rows = [row.text() for row in page.by_id("nonfinite-table").find_all("tr")[1:]]
    assert len(rows) == 2
    assert "train_loss" in rows[0] and "NaN" in rows[0]
    assert "val_loss" in rows[1] and "+Infinity" in rows[1]


def test_a_page_without_nonfinite_values_hides_the_list(world: World) -> None:
    page = parse(world.client.get(f"/tasks/{world.task['id']}").text)
    assert "hidden" in page.by_id("nonfinite-metrics").attrs


def test_a_metric_without_value_or_kind_is_refused_naming_the_field(world: World) -> None:
    url = f"/internal/v1/tasks/{world.task['id']}/metrics"
    missing = world.client.post(
        url, headers=agent_headers(), json={"metrics": [{"name": "train_loss", "value": None}]}
    )
    assert missing.status_code == 422
    assert "value" in missing.text
    wrong = world.client.post(
        url,
        headers=agent_headers(),
        json={"metrics": [{"name": "train_loss", "value": None, "nonfinite": "huge"}]},
    )
    assert wrong.status_code == 422 and "nonfinite" in wrong.text
