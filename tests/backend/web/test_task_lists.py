"""The portal's task lists (filters, paging, the selection to compare), the comparison page
and a task's tags."""

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.tasks.models import Metric
from backend.web.task_lists import PAGE_SIZE
from tests.backend.web.dom import parse
from tests.conftest import make_group, make_project, task_request, with_csrf


def _tasks(client: TestClient, version: dict, count: int, **fields: object) -> list[int]:
    body = task_request(version, resource_groups=[{"name": "cpu-a", "workers": 1}], **fields)
    ids = []
    for _ in range(count):
        response = client.post("/api/v1/tasks", json=body)
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    return ids


def _row_ids(html: str) -> list[int]:
    return [
        int(row.attrs["data-task-id"])
        for row in parse(html).find_all("tr")
        if "data-task-id" in row.attrs
    ]


def test_the_task_list_filters_keeps_its_values_and_pages(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    project, version = make_project(client)
    older = _tasks(client, version, PAGE_SIZE, name="mnist base")
    tagged = _tasks(client, version, 2, name="mnist lr", tags=["sweep"])
    first = parse(client.get("/").text)
    assert first.by_id("task-count").text() == f"1–{PAGE_SIZE} of {PAGE_SIZE + 2} tasks"
    assert _row_ids(client.get("/").text)[:2] == tagged[::-1]
    next_url = first.by_id("page-next").attrs["href"]
    assert next_url == "/?page=2#task-list"
    assert _row_ids(client.get(next_url).text) == older[:2][::-1]
    # filtered: the rows, the count, the values kept in the form and in the refresh URL
    page = parse(client.get("/", params={"tag": "sweep", "name": "LR", "status": "queued"}).text)
    assert _row_ids(client.get("/", params={"tag": "sweep"}).text) == tagged[::-1]
    assert page.by_id("task-count").text() == "1–2 of 2 tasks"
    assert page.by_id("filter-tag").attrs["value"] == "sweep"
    assert page.by_id("filter-name").attrs["value"] == "LR"
    assert page.find("option", value="QUEUED").attrs.get("selected") is not None
    lists = [n for n in page.iter() if "data-refresh-url" in n.attrs]
    assert lists[0].attrs["data-refresh-url"] == (
        "/api/v1/tasks?status=QUEUED&name=LR&tag=sweep&offset=0&limit=25"
    )
    # the project's own list takes the same filters
    own = client.get(f"/projects/{project['id']}", params={"tag": "sweep"}).text
    assert _row_ids(own) == tagged[::-1]
    # by project: another project's task alone, its option kept selected
    other, other_version = make_project(client, name="cifar")
    theirs = _tasks(client, other_version, 1, name="mnist lr")
    by_project = client.get("/", params={"project": other["id"], "name": "lr"}).text
    assert _row_ids(by_project) == theirs
    chosen = parse(by_project).by_id("filter-project").find("option", value=str(other["id"]))
    assert chosen.attrs.get("selected") is not None and chosen.text() == "cifar"
    assert (
        _row_ids(client.get("/", params={"project": project["id"], "name": "lr"}).text)
        == (tagged[::-1])
    )


def test_a_bad_filter_is_named_and_the_rest_still_applies(client: TestClient) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    _tasks(client, version, 1, name="kept")
    page = parse(client.get("/", params={"status": "done", "tag": "a b!", "project": "x"}).text)
    assert "'done' is not a status" in page.find(class_="field-error", data_field="status").text()
    assert "'b!' is not a tag" in page.find(class_="field-error", data_field="tag").text()
    assert "no project 'x'" in page.find(class_="field-error", data_field="project").text()
    assert page.by_id("filter-tag").attrs["value"] == "a b!"  # kept as typed
    assert page.by_id("task-count").text() == "1–1 of 1 task"
    # typed by hand: digits that are not ASCII, a number beyond any id: named, not a 500
    for raw in ("²", "99999999999999999999999"):
        odd = client.get("/", params={"project": raw, "page": raw})
        assert odd.status_code == 200, raw
        assert "no project" in parse(odd.text).find(class_="field-error").text()
    empty = parse(client.get("/", params={"name": "nothing like it"}).text)
    assert "No task matches these filters" in empty.find(class_="empty").text()


def test_compare_page_shows_differences_final_metrics_and_the_best(
    client: TestClient, session: Session
) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    a = _tasks(client, version, 1, epochs=2)[0]
    b = _tasks(client, version, 1, epochs=4)[0]
    for task_id, loss in ((a, 0.5), (b, 0.25)):
        session.add(Metric(task_id=task_id, step=8, epoch=1, name="val_loss", value=loss))
        session.add(Metric(task_id=task_id, step=4, epoch=1, name="step/train_loss", value=1))
    session.commit()
    listed = parse(client.get("/").text)
    assert listed.by_id("compare-form").attrs["action"] == "/compare"
    response = client.get("/compare", params={"ids": [a, b]})
    assert response.status_code == 200, response.text
    page = parse(response.text)
    epochs = page.find("tr", data_field="epochs")
    assert [td.text() for td in epochs.find_all("td")] == ["2", "4"]
    assert epochs.find("th").text() == "Epochs"  # in words, the spec's path in its title
    loss = page.find("tr", data_metric="val_loss")
    assert [td.text() for td in loss.find_all("td")] == ["0.5", "0.25"]
    assert [td.text() for td in loss.find_all("td", class_="num best")] == ["0.25"]
    assert page.find_all("tr", data_metric="step/train_loss") == []  # a curve, not a final
    assert page.by_id("compare-metric").find("option", value="step/train_loss")
    assert (
        page.by_id("compare-metric").find("option", value="val_loss").attrs.get("selected")
        is not None
    )
    one = client.get("/compare", params={"ids": [a]})
    assert one.status_code == 422
    assert "compare 2 to 10 different tasks (1 given)" in one.text


def test_tags_are_edited_on_the_task_page_and_a_bad_one_changes_nothing(
    client: TestClient,
) -> None:
    make_group(client, "cpu-a", 2)
    _, version = make_project(client)
    task_id = _tasks(client, version, 1, tags=["old"])[0]
    url = f"/tasks/{task_id}/tags"
    saved = client.post(url, data=with_csrf(client, {"tags": "baseline, lr=3e-4"}))
    page = parse(saved.text)
    assert [a.text() for a in page.by_id("task-tags").find_all("a", class_="tag")] == [
        "baseline",
        "lr=3e-4",
    ]
    refused = parse(client.post(url, data=with_csrf(client, {"tags": "ok no*pe"})).text)
    assert "'no*pe' is not a tag" in refused.find(class_="flash flash-error").text()
    assert client.get(f"/api/v1/tasks/{task_id}").json()["tags"] == ["baseline", "lr=3e-4"]
    assert client.post(url, data={"tags": "x"}).status_code == 403  # no CSRF token
