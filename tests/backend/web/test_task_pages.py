"""Task submission from the project page, the task page and cancelling from it."""

from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.core.db import utcnow
from backend.tasks.models import Task, TaskStatus
from tests.backend.web.dom import Node, parse
from tests.conftest import make_group, make_project, task_request, with_csrf


def _form(version: dict, workers: dict[str, str], **fields: str) -> dict:
    data = {
        "code_version_id": str(version["id"]),
        "epochs": "3",
        "global_batch_size": "64",
        "seed": "0",
        "priority": "0",
        "split_policy": "even",
        "name": "",
        "group": list(workers),
        "workers": list(workers.values()),
    }
    data.update(fields)
    return data


def _row_of(page: Node, group: str) -> Node:
    return page.find("tr", data_group=group)


def _submit(client: TestClient, workers: dict[str, str], **fields: str):
    project, version = make_project(client)
    url = f"/projects/{project['id']}/tasks"
    return client.post(
        url, data=with_csrf(client, _form(version, workers, **fields)), follow_redirects=False
    )


def test_too_many_workers_is_shown_next_to_that_groups_field(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    response = _submit(client, {"cpu-a": "1", "cpu-b": "3"}, epochs="7")
    assert response.status_code == 422
    page = parse(response.text)
    row = _row_of(page, "cpu-b")
    assert "has 1 worker(s); 3 requested" in row.find(data_field="group.cpu-b").text()
    assert row.find("input", id="workers-cpu-b").attrs["value"] == "3"
    assert not _row_of(page, "cpu-a").find_all(class_="field-error")
    assert page.by_id("task-epochs").attrs["value"] == "7"
    assert client.get("/api/v1/tasks").json() == []


def test_invalid_numbers_and_no_group_are_refused_field_by_field(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    response = _submit(client, {"cpu-a": "0"}, epochs="0", global_batch_size="many")
    assert response.status_code == 422
    page = parse(response.text)
    assert "at least one resource group" in page.find(data_field="resource_groups").text()
    epochs = page.by_id("task-epochs").parent
    assert "greater than or equal to 1" in epochs.find(data_field="epochs").text()
    assert page.by_id("task-global_batch_size").attrs["value"] == "many"
    assert page.find(data_field="global_batch_size")


def test_valid_submission_opens_the_queued_task(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    response = _submit(client, {"cpu-a": "2", "cpu-b": "1"}, name="two groups")
    assert response.status_code == 303
    task = client.get("/api/v1/tasks").json()[0]
    assert response.headers["location"] == f"/tasks/{task['id']}"
    assert [g["workers"] for g in task["spec"]["groups"]] == [2, 1]
    page = parse(client.get(response.headers["location"]).text)
    assert page.by_id("task-status").text() == "QUEUED"
    timeline = page.by_id("timeline").text()
    assert "QUEUED" in timeline and "submitted" in timeline
    assert "cpu-a × 2" in page.find("dl", class_="summary").text()


def test_strategy_dependent_fields_start_blank_and_take_the_strategys_default(
    client: TestClient,
) -> None:
    """The round length and the rebalancing interval depend on the strategy chosen beside
    them: the form shows them blank, so a diloco task submitted as the form stands gets its
    round of 16 and, with the async exchange, rebalancing at epoch ends only."""
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    project, version = make_project(client)
    page = parse(client.get(f"/projects/{project['id']}").text)
    assert page.by_id("task-sync_period").attrs.get("value", "") == ""
    assert page.by_id("task-rebalance_every").attrs.get("value", "") == ""
    form = _form(
        version,
        {"cpu-a": "1", "cpu-b": "1"},
        sync_strategy="diloco",
        diloco_exchange="async",
        sync_period="",
        rebalance_every="",
    )
    url = f"/projects/{project['id']}/tasks"
    response = client.post(url, data=with_csrf(client, form), follow_redirects=False)
    assert response.status_code == 303, response.text
    spec = client.get("/api/v1/tasks").json()[0]["spec"]
    assert (spec["sync_period"], spec["rebalance_every"], spec["diloco_exchange"]) == (
        16,
        0,
        "async",
    )


def test_sharding_from_the_form_is_kept_after_an_error_and_shown_on_the_task(
    client: TestClient,
) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    project, version = make_project(client)
    url = f"/projects/{project['id']}/tasks"
    page = parse(client.get(f"/projects/{project['id']}").text)
    options = [o.attrs["value"] for o in page.by_id("task-sharding").find_all("option")]
    assert options == ["none", "fsdp"]
    assert "fit one worker's memory" in page.by_id("task-sharding").parent.text()
    assert page.by_id("task-fsdp_units").attrs.get("value", "") == ""

    def post(workers: dict[str, str], **fields: str):  # type: ignore[no-untyped-def]
        form = _form(version, workers, sharding="fsdp", **fields)
        return client.post(url, data=with_csrf(client, form), follow_redirects=False)

    refused = post({"cpu-a": "2", "cpu-b": "1"}, fsdp_units="TransformerBlock, Linear")
    assert refused.status_code == 422
    page = parse(refused.text)
    error = page.find(data_field="sharding").text()
    assert "resource_groups.1 (cpu-b) has 1: there is nothing to shard" in error
    assert page.by_id("task-sharding").find("option", selected="").attrs["value"] == "fsdp"
    assert page.by_id("task-fsdp_units").attrs["value"] == "TransformerBlock, Linear"
    assert "open" in page.by_id("more-settings").attrs
    bad_name = parse(post({"cpu-a": "2"}, fsdp_units="Block, nn.Linear").text)
    assert "'nn.Linear' is not a class name" in bad_name.find(data_field="fsdp_units").text()
    assert bad_name.by_id("task-fsdp_units").attrs["value"] == "Block, nn.Linear"
    assert client.get("/api/v1/tasks").json() == []

    accepted = post({"cpu-a": "2"}, fsdp_units=" TransformerBlock,Linear, ")
    assert accepted.status_code == 303, accepted.text
    spec = client.get("/api/v1/tasks").json()[0]["spec"]
    assert (spec["sharding"], spec["fsdp_units"]) == ("fsdp", ["TransformerBlock", "Linear"])
    summary = parse(client.get(accepted.headers["location"]).text).find("dl", class_="summary")
    shown = {dt.text(): dt.parent.find("dd").text() for dt in summary.find_all("dt")}
    assert (shown["Sharding"], shown["FSDP units"]) == ("fsdp", "TransformerBlock, Linear")


def test_task_page_names_its_settings_in_words_and_units(
    client: TestClient, session: Session
) -> None:
    """The settings grid: labels and units, not field names and raw floats; a plan's
    predicted time with what the task took beside it. The resource charts have a place for
    the note that replaces them while there are too few samples, and the sampling period."""
    make_group(client, "cpu-a", capacity=2)
    location = _submit(client, {"cpu-a": "1"}).headers["location"]
    task = session.get(Task, int(location.rsplit("/", 1)[1]))
    assert task is not None
    now = utcnow()
    task.spec = {**task.spec, "plan_id": 7, "predicted_s": 24.94944633685312}
    task.status, task.started_at, task.finished_at = (
        TaskStatus.SUCCEEDED,
        now - timedelta(seconds=27),
        now,
    )
    session.commit()
    page = parse(client.get(location).text)
    summary = page.find("dl", class_="summary")
    shown = {dt.text(): dt.parent.find("dd").text() for dt in summary.find_all("dt")}
    assert shown["Predicted time"] == "25 s (took 27 s)"
    assert page.by_id("task-measured").text() == "(took 27 s)"  # task.js keeps it current
    assert shown["Submitted from"] == "plan 7"
    assert (shown["Rebalance every"], shown["Guard"]) == ("10 steps", "yes")
    assert "predicted s" not in summary.text().lower() and "24.949" not in summary.text()
    assert "predicted_s" not in summary.text()
    assert page.by_id("task-page").attrs["data-sample-every-s"] == "15"
    for chart in ("cpu-chart", "memory-chart"):
        assert "hidden" in page.by_id(f"{chart}-empty").attrs  # task_charts.js fills it
    assert page.by_id("sub-tasks").parent.attrs["class"] == "table-scroll"


def test_task_page_shows_a_groups_own_sharding(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    _, version = make_project(client)
    groups = [
        {"name": "cpu-a", "workers": 2, "sharding": "fsdp"},
        {"name": "cpu-b", "workers": 1},
    ]
    task = client.post("/api/v1/tasks", json=task_request(version, resource_groups=groups))
    assert task.status_code == 201, task.text
    page = parse(client.get(f"/tasks/{task.json()['id']}").text)
    groups_shown = page.find("dl", class_="summary").find("dd").text()
    assert "cpu-a × 2 (fsdp), cpu-b × 1 " in groups_shown


def test_task_page_shows_a_groups_max_local_batch(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    _, version = make_project(client)
    groups = [
        {"name": "cpu-a", "workers": 2, "sharding": "fsdp", "max_local_batch": 16},
        {"name": "cpu-b", "workers": 1},
    ]
    body = task_request(version, resource_groups=groups, split_policy="weighted")
    task = client.post("/api/v1/tasks", json=body)
    assert task.status_code == 201, task.text
    page = parse(client.get(f"/tasks/{task.json()['id']}").text)
    groups_shown = page.find("dl", class_="summary").find("dd").text()
    assert "cpu-a × 2 (fsdp) (max local batch 16), cpu-b × 1 " in groups_shown


def test_unused_group_is_left_out_of_the_task(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    assert _submit(client, {"cpu-a": "2", "cpu-b": "0"}).status_code == 303
    assert [g["name"] for g in client.get("/api/v1/tasks").json()[0]["spec"]["groups"]] == ["cpu-a"]


def test_task_page_has_log_view_charts_and_node_filter(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    location = _submit(client, {"cpu-a": "2"}).headers["location"]
    page = parse(client.get(location).text)
    assert page.find("canvas", id="loss-chart") and page.find("canvas", id="accuracy-chart")
    task_id = location.rsplit("/", 1)[1]
    log_view = page.by_id("log-view")
    assert log_view.attrs["data-stream-url"] == f"/api/v1/tasks/{task_id}/logs/stream"
    nodes = [o.attrs["value"] for o in page.by_id("log-node").find_all("option")]
    assert nodes == ["", "ps", "rank-1", "rank-2"]
    assert page.by_id("log-follow").attrs["aria-pressed"] == "true"
    download = page.by_id("log-download")  # task_logs.js adds ?node= for the filtered node
    assert download.attrs["href"] == f"/api/v1/tasks/{task_id}/logs.txt"
    assert "download" in download.attrs
    assert page.by_id("log-search").attrs["type"] == "search"
    scripts = [s.attrs.get("src", "") for s in page.find_all("script")]
    assert any(src.endswith("/static/vendor/chart.umd.js") for src in scripts)
    assert client.get("/static/vendor/chart.umd.js").status_code == 200


def test_cancel_then_cancel_again_shows_the_conflict(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    location = _submit(client, {"cpu-a": "1"}).headers["location"]
    assert parse(client.get(location).text).find_all("form", id="cancel-form")
    cancelled = client.post(f"{location}/cancel", data=with_csrf(client, {}))
    page = parse(cancelled.text)
    assert page.by_id("task-status").text() == "CANCELLED"
    assert "cancelled" in page.find(class_="flash flash-info").text()
    assert not page.find_all("form", id="cancel-form")
    again = parse(client.post(f"{location}/cancel", data=with_csrf(client, {})).text)
    assert "it cannot become CANCELLED" in again.find(class_="flash flash-error").text()


def test_task_list_shows_status_and_progress(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    location = _submit(client, {"cpu-a": "1"}).headers["location"]
    task_id = location.rsplit("/", 1)[1]
    page = parse(client.get("/").text)
    row = page.find("tr", data_task_id=task_id)
    assert row.find(class_="badge status-queued").text() == "QUEUED"
    assert row.find(class_="progress-label").text() == "0%"
    assert row.find("a", href=location)
    nav = [a.attrs["href"] for a in page.find("nav").find_all("a")]
    assert nav == ["/", "/projects", "/resource-groups", "/admin/users", "/admin/audit", "/docs"]


def test_unknown_task_is_an_html_404(client: TestClient) -> None:
    response = client.get("/tasks/999")
    assert response.status_code == 404
    assert "task 999 does not exist" in response.text


def test_task_page_shows_shares_timing_and_the_settings_form(client: TestClient) -> None:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    location = _submit(client, {"cpu-a": "2", "cpu-b": "1"}).headers["location"]
    page = parse(client.get(location).text)
    assert page.find("canvas", id="throughput-chart")
    assert page.find("canvas", id="cpu-chart") and page.find("canvas", id="memory-chart")
    shares = {
        r.attrs["data-group"]: [td.text() for td in r.find_all("td")]
        for r in page.by_id("group-throughput").find_all("tr")
        if "data-group" in r.attrs
    }
    assert shares == {"cpu-a": ["cpu-a", "2", "—", "67%"], "cpu-b": ["cpu-b", "1", "—", "33%"]}
    assert "hidden" in page.by_id("retry-form").attrs  # a queued task is not retried
    assert page.by_id("task-timing").text() == ""  # not started: no time left to estimate
    project_page = parse(client.get("/projects/1").text)
    for name in ("epochs", "global_batch_size", "split_policy", "priority"):
        assert project_page.by_id(f"task-{name}")
    options = [o.attrs["value"] for o in project_page.by_id("task-code-version").find_all("option")]
    assert "example:mnist_cnn" in options


def test_eta_comes_from_the_pace_of_measured_steps() -> None:
    from datetime import timedelta

    from backend.core.db import utcnow
    from backend.tasks.models import TaskStatus
    from backend.web.views import timing

    now = utcnow()
    task = Task(
        spec={},
        progress=0.4,
        status=TaskStatus.RUNNING,
        started_at=now - timedelta(seconds=90),  # 30 s of it before the first step
        pace_start_at=now - timedelta(seconds=60),
        pace_start_progress=0.1,
        progress_at=now - timedelta(seconds=10),
    )
    estimate = timing(task)
    # 0.3 in 50 s: the remaining 0.6 take 100 s from the last report, 90 s from now.
    assert 89 < estimate["elapsed_s"] < 92 and 88 < estimate["eta_s"] < 91
