"""A task page's "Run again": the project's submit form filled from the task's spec, to
change and submit as a new task; a task the user may not see, or of another project, is 404;
a plan's trial is not run again."""

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from backend.tasks.models import Task
from tests.backend.web.dom import Node, parse
from tests.conftest import add_account, login_as, make_group, make_project, task_request, with_csrf

# Settings the form has, each away from its default (pin_memory left unset: its select's
# blank "default" choice keeps it unset, rather than a browser sending its first option).
SETTINGS = {
    "name": "baseline",
    "resource_groups": [
        {"name": "cpu-a", "workers": 2, "max_local_batch": 32},
        {"name": "cpu-b", "workers": 1},
    ],
    "epochs": 7,
    "global_batch_size": 48,
    "split_policy": "weighted",
    "sync_strategy": "periodic",
    "sync_period": 4,
    "guard": False,
    "exchange_fraction": 0.25,
    "on_nonfinite": "skip_step",
    "data": {"path": "memory", "prefetch_factor": 3},
    "seed": 3,
    "priority": 5,
    "max_restarts": 1,
    "max_runtime_s": 600,
    "hyperparameters": {"lr": 0.003},
}


def _posted(form: Node) -> dict[str, list[str]]:
    """What a browser sends for `form` as it stands: each named input's value, each
    select's selected options (a single select without one: its first)."""
    sent: dict[str, list[str]] = {}
    for node in form.iter():
        name = node.attrs.get("name")
        if not name or node.tag not in ("input", "select"):
            continue
        if node.tag == "input":
            sent.setdefault(name, []).append(node.attrs.get("value", ""))
            continue
        options = node.find_all("option")
        chosen = [o for o in options if "selected" in o.attrs]
        if not chosen and "multiple" not in node.attrs and options:
            chosen = options[:1]
        sent.setdefault(name, []).extend(o.attrs["value"] for o in chosen)
    return sent


def _value(page: Node, input_id: str) -> str:
    node = page.by_id(input_id)
    if node.tag == "select":
        return node.find("option", selected="").attrs["value"]
    return node.attrs.get("value", "")


def _original(client: TestClient) -> tuple[dict, dict]:
    make_group(client, "cpu-a", capacity=2)
    make_group(client, "cpu-b", capacity=1)
    project, version = make_project(client)
    created = client.post("/api/v1/tasks", json=task_request(version, **SETTINGS))
    assert created.status_code == 201, created.text
    return project, created.json()


def test_run_again_fills_the_form_from_the_task_and_submits_a_new_one(
    client: TestClient,
) -> None:
    project, task = _original(client)
    link = parse(client.get(f"/tasks/{task['id']}").text).by_id("run-again")
    href = link.attrs["href"]
    assert href == f"/projects/{project['id']}?from_task={task['id']}#submit-task"
    page = parse(client.get(href.partition("#")[0]).text)
    assert f"Filled from task #{task['id']} baseline" in page.by_id("run-again-note").text()
    filled = {
        "task-name": "baseline (again)",
        "task-code-version": str(task["code_version_id"]),
        "workers-cpu-a": "2",
        "workers-cpu-b": "1",
        "cap-cpu-a": "32",
        "cap-cpu-b": "",
        "task-epochs": "7",
        "task-global_batch_size": "48",
        "task-split_policy": "weighted",
        "task-sync_strategy": "periodic",
        "task-sync_period": "4",
        "task-rebalance_every": "",  # its strategy's default: left blank, as on a new form
        "task-guard": "false",
        "task-exchange_fraction": "0.25",
        "task-on_nonfinite": "skip_step",
        "task-on_group_loss": "shrink",
        "task-data.path": "memory",
        "task-data.prefetch_factor": "3",
        "task-data.pin_memory": "",  # unset: the blank "default" choice
        "task-seed": "3",
        "task-priority": "5",
        "task-max_restarts": "1",
        "task-max_runtime_s": "600",
        "task-hyperparameters": '{"lr": 0.003}',  # a sweep trial's too: run again as it ran
    }
    assert {key: _value(page, key) for key in filled} == filled

    form = _posted(page.by_id("task-form"))
    form["epochs"] = ["9"]  # the one change
    url = f"/projects/{project['id']}/tasks"
    response = client.post(url, data=with_csrf(client, form), follow_redirects=False)
    assert response.status_code == 303, response.text
    again = client.get(response.headers["location"].replace("/tasks/", "/api/v1/tasks/")).json()
    assert again["id"] != task["id"] and again["name"] == "baseline (again)"
    assert (again["priority"], again["max_restarts"]) == (5, 1)
    assert again["spec"] == {**task["spec"], "epochs": 9}


def test_run_again_of_a_task_the_user_may_not_see_is_404(client: TestClient) -> None:
    project, task = _original(client)
    stranger = login_as(TestClient(client.app), add_account("bob@example.org"))
    assert stranger.get(f"/tasks/{task['id']}").status_code == 404
    own = stranger.post("/api/v1/projects", json={"name": "bobs"}).json()
    for url in (
        f"/projects/{project['id']}?from_task={task['id']}",
        f"/projects/{own['id']}?from_task={task['id']}",  # his project, not his task
    ):
        response = stranger.get(url)
        assert response.status_code == 404, url
        assert "Filled from task" not in response.text
    other = client.post("/api/v1/projects", json={"name": "other"}).json()
    wrong = client.get(f"/projects/{other['id']}?from_task={task['id']}")  # another project's
    assert wrong.status_code == 404 and f"task {task['id']} does not exist" in wrong.text
    assert client.get(f"/projects/{project['id']}?from_task=999").status_code == 404


def test_a_plans_trial_is_not_run_again(client: TestClient, session: Session) -> None:
    project, created = _original(client)
    task = session.get(Task, created["id"])
    assert task is not None
    task.spec = {**task.spec, "trial": {"batch_sizes": [4, 8]}}
    session.commit()
    shown = parse(client.get(f"/tasks/{task.id}").text)
    assert not shown.find_all(id="run-again")
    # it trains no epoch: not "0 of 2 epochs done" (nor, once it succeeded, "2 of 2")
    assert shown.by_id("task-epoch").text() == "a plan's trial: it times steps, it trains no epoch"
    assert shown.by_id("task-page").attrs["data-trial"] == "true"
    response = client.get(f"/projects/{project['id']}?from_task={task.id}")
    page = parse(response.text)
    assert "is a plan's trial" in page.find(class_="flash flash-error").text()
    assert page.by_id("task-page").attrs["data-task-id"] == str(task.id)


def test_run_again_says_what_the_form_leaves_out_and_keeps_strategy_defaults_blank(
    client: TestClient,
) -> None:
    """A device-type request has no input: the note names it; agreement tolerances fill
    their JSON input; a diloco task's round of 16 (its strategy's default) stays blank, as
    on a new form."""
    make_group(client, "cpu-a", capacity=2)
    project, version = make_project(client)
    body = task_request(
        version,
        resource_groups=[{"device_type": "cpu", "workers": 2}],
        global_batch_size=8,
        sync_strategy="diloco",
        outer_lr=0.5,
        agreement_tolerance={"cpu/cpu": 0.001},
    )
    created = client.post("/api/v1/tasks", json=body)
    assert created.status_code == 201, created.text
    task = created.json()
    assert task["spec"]["sync_period"] == 16
    page = parse(client.get(f"/projects/{project['id']}?from_task={task['id']}").text)
    note = page.by_id("run-again-note").text()
    assert "the request of 2 cpu worker(s) by device type" in note
    assert "agreement tolerances" not in note
    assert _value(page, "task-agreement_tolerance") == '{"cpu/cpu": 0.001}'
    assert _value(page, "workers-cpu-a") == "0"
    assert (_value(page, "task-sync_strategy"), _value(page, "task-outer_lr")) == ("diloco", "0.5")
    assert _value(page, "task-sync_period") == ""


def test_the_form_takes_hyperparameters_as_a_json_object_and_keeps_a_refused_one(
    client: TestClient,
) -> None:
    """Unreadable JSON, or a name the code does not declare, is refused under the input,
    which keeps what was typed; a JSON object is submitted as the task's hyperparameters."""
    project, task = _original(client)
    page = parse(client.get(f"/projects/{project['id']}?from_task={task['id']}").text)
    assert "hyperparameters" not in page.by_id("run-again-note").text()
    url = f"/projects/{project['id']}/tasks"
    for typed, message in (
        ("lr=0.01", 'enter a JSON object of names and values, e.g. {"lr": 0.003, "hidden"'),
        ('{"learning_rate": 0.01}', "learning_rate"),
    ):
        form = {**_posted(page.by_id("task-form")), "hyperparameters": [typed]}
        refused = client.post(url, data=with_csrf(client, form), follow_redirects=False)
        assert refused.status_code == 422, refused.text
        again = parse(refused.text)
        assert _value(again, "task-hyperparameters") == typed
        error = again.by_id("task-hyperparameters").attrs.get("aria-describedby", "")
        assert error and message in again.by_id(error).text(), refused.text
    form = {**_posted(page.by_id("task-form")), "hyperparameters": ['{"lr": 0.01, "hidden": 32}']}
    response = client.post(url, data=with_csrf(client, form), follow_redirects=False)
    assert response.status_code == 303, response.text
    created = client.get(response.headers["location"].replace("/tasks/", "/api/v1/tasks/")).json()
    assert created["spec"]["hyperparameters"] == {"lr": 0.01, "hidden": 32}
