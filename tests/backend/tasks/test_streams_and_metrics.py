"""The live log stream (server-sent events, resumable with Last-Event-ID) and /metrics."""

from fastapi.testclient import TestClient

from tests.backend.conftest import World
from tests.conftest import agent_headers


def _events(text: str) -> list[tuple[str, str, str]]:
    """(id, event, data) of each server-sent event in `text`."""
    found = []
    for block in text.strip().split("\n\n"):
        fields = dict(
            line.split(": ", 1)
            for line in block.splitlines()
            if ": " in line and not line.startswith(":")
        )
        if "event" in fields:
            found.append((fields.get("id", ""), fields["event"], fields["data"]))
    return found


def _add_lines(client: TestClient, task_id: int, count: int) -> None:
    lines = [
        {
            "node": f"rank-{1 + i % 2}",
            "seq": 1 + i,
            "time": "2026-01-01T00:00:00",
            "text": f"line {i}",
        }
        for i in range(count)
    ]
    client.post(
        f"/internal/v1/tasks/{task_id}/logs", headers=agent_headers(), json={"lines": lines}
    ).raise_for_status()


def test_stream_resumes_after_last_event_id_and_ends_with_the_task(world: World) -> None:
    client, task_id = world.client, world.task["id"]
    _add_lines(client, task_id, 4)
    client.post(f"/api/v1/tasks/{task_id}/cancel").raise_for_status()
    url = f"/api/v1/tasks/{task_id}/logs/stream"
    full = _events(client.get(url).text)
    assert [e[1] for e in full] == ["log"] * 5 + ["end"]
    assert '"CANCELLED"' in full[-1][2]
    resumed = _events(client.get(url, headers={"Last-Event-ID": full[2][0]}).text)
    assert [e[0] for e in resumed if e[1] == "log"] == [e[0] for e in full[3:5]]
    only = _events(client.get(url, params={"node": "rank-2"}).text)
    assert all('"node":"rank-2"' in data for _, kind, data in only if kind == "log")
    response = client.get(url)
    assert response.headers["content-type"].startswith("text/event-stream")


def test_metrics_report_states_queue_agents_and_group_throughput(world: World) -> None:
    client = world.client
    agent = client.post(
        "/internal/v1/agents/register",
        headers=agent_headers(),
        json={
            "name": "a1",
            "host": "h1",
            "resource_group": "cpu-a",
            "workers": 2,
            "hardware": {"cpu_cores": 2, "memory_bytes": 2**30},
        },
    ).json()
    assert agent["online"]
    text = TestClient(client.app).get("/metrics").text  # Prometheus scrapes without a login
    assert 'polytrain_tasks{state="QUEUED"} 1.0' in text
    assert 'polytrain_tasks{state="RUNNING"} 0.0' in text
    assert "polytrain_queue_depth 1.0" in text
    assert 'polytrain_agents_online{resource_group="cpu-a"} 1.0' in text
    assert "# TYPE polytrain_group_throughput_samples_per_second gauge" in text


def test_metrics_ask_for_the_token_when_one_is_set(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from backend.core import config
    from backend.main import create_app

    monkeypatch.setenv("POLYTRAIN_METRICS_TOKEN", "scrape-me")
    config.get_settings.cache_clear()
    with TestClient(create_app(run_scheduler=False)) as scraper:
        assert scraper.get("/metrics").status_code == 401
        ok = scraper.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert ok.status_code == 200 and "polytrain_queue_depth" in ok.text
