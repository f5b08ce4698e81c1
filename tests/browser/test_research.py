"""The portal in Chromium, for a researcher between tasks: "Run again" from a task's page,
a code version's source, a task's per-step curves, the comparison of tasks and a
hyperparameter sweep (a file of its own, so that `--dist loadfile` runs it beside
test_portal.py rather than after it; one stack for them all, since starting one is most of
a browser file's cost)."""

import io
import re
import zipfile
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
from playwright.sync_api import Page, Route, expect

from polytrain.stack import LocalStack
from tests.browser.conftest import log_in
from tests.browser.test_portal import EXAMPLE
from tests.e2e.conftest import TERMINAL, new_version, submit, wait_for


def test_run_again_from_a_cancelled_tasks_page(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """An ended task's page has "Run again": it opens the project's submit form filled from the
    task; one field changed and submitted gives a new task with that change and the rest of
    the original's spec."""
    version = new_version(api, example="tiny_regression", project_name="run-again")
    body = {
        "project_id": version["project_id"],
        "code_version_id": version["id"],
        "name": "first run",
        "resource_groups": [
            {"name": "cpu-a", "workers": 2, "max_local_batch": 16},
            {"name": "cpu-b", "workers": 1},
        ],
        "epochs": 2,
        "global_batch_size": 24,
        "split_policy": "weighted",
        "sync_strategy": "periodic",
        "sync_period": 2,
        "seed": 7,
        "priority": 3,
        # pin_memory unset: its select's blank "default" keeps it so (checked below)
    }
    original = api.post("/api/v1/tasks", json=body)
    assert original.status_code == 201, original.text
    first = original.json()
    api.post(f"/api/v1/tasks/{first['id']}/cancel").raise_for_status()
    log_in(page, stack)
    page.goto(f"{stack.url}/tasks/{first['id']}")
    expect(page.locator("#task-status")).to_have_text("CANCELLED")
    page.click("#run-again")
    expect(page.locator("#run-again-note")).to_contain_text(f"Filled from task #{first['id']}")
    expect(page.locator("#task-name")).to_have_value("first run (again)")
    expect(page.locator("#workers-cpu-a")).to_have_value("2")
    expect(page.locator("#cap-cpu-a")).to_have_value("16")
    expect(page.locator("#task-sync_strategy")).to_have_value("periodic")
    page.fill("#task-epochs", "3")
    page.click("#task-form button[type=submit]")
    expect(page.locator("#task-page")).to_be_visible()
    task_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    again = api.get(f"/api/v1/tasks/{task_id}").json()
    api.post(f"/api/v1/tasks/{task_id}/cancel")  # 409 if it already ended: fine
    assert task_id != first["id"] and again["name"] == "first run (again)"
    assert again["spec"]["epochs"] == 3 and again["priority"] == 3

    # The rest as the original's (the placed groups: once booked, as the scheduler chose).
    def rest(spec: dict) -> dict:
        return {k: v for k, v in spec.items() if k not in ("epochs", "groups")}

    assert rest(again["spec"]) == rest(first["spec"])


def test_a_code_versions_source_is_shown_escaped_and_highlighted(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """The project page links a version to its page: who uploaded it, the archive's files,
    and the chosen file's source highlighted by code.css; markup in the source stays text."""
    project = api.post("/api/v1/projects", json={"name": "source-view"}).json()
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as packed:
        packed.writestr(
            "job/train.py", EXAMPLE.read_bytes() + b'BANNER = "<script>alert(1)</script>"\n'
        )
        packed.writestr("job/notes.md", "# <img src=x onerror=alert(2)>\n")
    version = api.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("job.zip", archive.getvalue())},
    ).json()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    log_in(page, stack)
    page.goto(f"{stack.url}/projects/{project['id']}")
    page.click(f"#version-link-{version['version']}")
    expect(page.locator("#code-uploader")).to_have_text(stack.admin_email)
    expect(page.locator("#code-files li")).to_have_count(2)
    expect(page.locator("#code-path")).to_have_text("train.py")
    expect(page.locator("#code-source .line").last).to_have_text(
        'BANNER = "<script>alert(1)</script>"'
    )
    keyword = page.locator("#code-source .k").first
    assert keyword.evaluate("k => getComputedStyle(k).color") == "rgb(0, 128, 0)"  # code.css
    page.click("#code-files >> text=notes.md")
    expect(page.locator("#code-source")).to_contain_text("# <img src=x onerror=alert(2)>")
    expect(page.locator("#code-source img, #code-source script")).to_have_count(0)
    assert dialogs == []


def test_filter_tick_two_finished_tasks_and_compare_their_curves(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """Two tasks trained to the end (tiny_regression, one on each group at once, 2 and 3
    epochs): the task list filters by tag, the two ticked open the comparison: the setting
    that differs, the final metrics with the best marked, and the chart drawing both tasks'
    validation loss by step, by epoch and by wall time."""
    version = new_version(api, example="tiny_regression", project_name="compare-runs")
    ids = []
    for group, lr_tag, epochs in (("cpu-a", "lr=0.1", 2), ("cpu-b", "lr=0.01", 3)):
        body = {
            "project_id": version["project_id"],
            "code_version_id": version["id"],
            "name": f"compare {lr_tag}",
            "resource_groups": [{"name": group, "workers": 1}],
            "epochs": epochs,
            "global_batch_size": 16,
            "tags": ["cmp", lr_tag],
        }
        task = api.post("/api/v1/tasks", json=body)
        assert task.status_code == 201, task.text
        ids.append(task.json()["id"])
    for task_id in ids:
        ended = wait_for(api, task_id, TERMINAL, timeout_s=300)
        assert ended["status"] == "SUCCEEDED", ended["status_reason"]
    compared = api.get("/api/v1/tasks/compare", params={"ids": ids})
    assert compared.status_code == 200, compared.text
    finals = [t["final_metrics"]["val_loss"] for t in compared.json()["tasks"]]

    log_in(page, stack)
    page.goto(f"{stack.url}/")
    page.fill("#filter-tag", "cmp")
    page.click("#task-filters button[type=submit]")
    expect(page.locator("#task-count")).to_have_text("1–2 of 2 tasks")
    expect(page.locator("#compare-button")).to_be_disabled()
    for task_id in ids:
        page.check(f"#task-table input[value='{task_id}']")
    expect(page.locator("#compare-button")).to_be_enabled()
    page.click("#compare-button")
    expect(page.locator("h1")).to_have_text("Compare 2 tasks")
    epochs = page.locator("#differences tr[data-field='epochs'] td")
    expect(epochs).to_have_text(["3", "2"])  # in the list's order: newest first
    val_loss = page.locator("#final-metrics tr[data-metric='val_loss'] td")
    expect(val_loss).to_have_count(2)
    expect(page.locator("#final-metrics tr[data-metric='val_loss'] td.best")).to_have_text(
        f"{min(finals):.4g}"
    )
    chart = page.locator("#compare-chart")
    expect(page.locator("#compare-metric")).to_have_value("val_loss")
    for x in ("step", "epoch", "seconds"):  # one point an epoch: 3 + 2, each with a wall time
        page.select_option("#compare-x", x)
        expect(chart).to_have_attribute("data-points", "5")
    expect(page.locator("#compare-empty")).to_be_hidden()
    series = page.evaluate(
        "Chart.getChart(document.getElementById('compare-chart')).data.datasets"
        ".map((d) => d.data.length)"
    )
    assert sorted(series) == [2, 3]


LOSS = "Chart.getChart(document.getElementById('step-loss-chart'))"
ROOT = Path(__file__).resolve().parents[2]
STEP_METRICS_PART = b"""

STEP_METRICS = True  # metrics also on training batches, at each per-step point


def metrics(output, target):
    return {"abs_error": float((output - target).abs().mean())}
"""


def test_a_tasks_per_step_curves_zoom_and_smooth(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """tiny_regression, 160 items in batches of 16 on one worker: 10 steps an epoch, a point
    every 2 steps (`step_metrics_every`), 2 epochs: 10 points of each series, and of the
    module's own per-step metric (`STEP_METRICS`: tiny_regression's code with `metrics`)."""
    source = (ROOT / "examples" / "tiny_regression.py").read_bytes() + STEP_METRICS_PART
    version = new_version(api, source=source, project_name="step-curves")
    one = [{"name": "cpu-a", "workers": 1}]
    task_id = submit(api, version, resource_groups=one, step_metrics_every=2)["id"]
    log_in(page, stack)
    page.goto(f"{stack.url}/tasks/{task_id}")
    expect(page.locator("#task-status")).to_have_text("SUCCEEDED", timeout=180_000)
    page.reload()  # every point stored: the page's last poll may have come before the last
    for chart in ("step-loss-chart", "step-rate-chart", "step-lr-chart"):
        expect(page.locator(f"#{chart}")).to_have_attribute("data-points", "10")
    expect(page.locator("#step-charts-empty")).to_be_hidden()
    expect(page.locator("#step-user-figure")).to_be_visible()
    expect(page.locator("#step-user-chart")).to_have_attribute("data-points", "10")
    user = "Chart.getChart(document.getElementById('step-user-chart'))"
    assert page.evaluate(f"{user}.data.datasets[0].label").startswith("train_abs_error")
    steps = page.evaluate(f"{LOSS}.data.datasets[1].data.map((p) => p.x)")
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]

    # Smoothing: 0.6 by default (a smoothed line over the faded raw one), 0 the raw points.
    labels = page.evaluate(f"{LOSS}.data.datasets.map((d) => d.label)")
    assert labels == ["train_loss", "train_loss (raw)"]
    smoothed, raw = page.evaluate(f"{LOSS}.data.datasets.map((d) => d.data.map((p) => p.y))")
    assert smoothed[0] == raw[0] and smoothed[-1] != raw[-1]  # debiased: starts on the point
    page.locator("#step-smoothing").fill("0")
    expect(page.locator("#step-smoothing-value")).to_have_text("0.00")
    assert page.evaluate(f"{LOSS}.data.datasets.length") == 1
    assert page.evaluate(f"{LOSS}.data.datasets[0].data.map((p) => p.y)") == raw

    # Zoom: the wheel over the chart narrows the steps shown; a double-click shows them all.
    canvas = page.locator("#step-loss-chart")
    canvas.hover()
    page.mouse.wheel(0, -600)
    expect(canvas).to_have_attribute("data-points", "10")
    page.wait_for_function(f"{LOSS}.isZoomedOrPanned()")
    shown = page.evaluate(f"{LOSS}.scales.x.max - {LOSS}.scales.x.min")
    assert shown < 18, shown
    canvas.dblclick()
    page.wait_for_function(f"!{LOSS}.isZoomedOrPanned()")


SWEEP_MODULE = b"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

HYPERPARAMETERS = {"lr": 0.02, "hidden": 8}


def build_datasets():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:])


def build_model():
    width = int(HYPERPARAMETERS["hidden"])
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


def build_optimizer(params):
    return torch.optim.SGD(params, lr=float(HYPERPARAMETERS["lr"]))


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""


def test_a_sweep_of_four_trials_on_both_groups_runs_to_completion(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """A sweep started from the project's sweeps form (a refusal keeps what was typed): the
    4 trials of a 2 x 2 grid over a tiny module to completion, each on both groups of the
    stack (cpu-a:1 and cpu-b:1, one epoch of 32 samples), and the sweep page with every
    trial, the best highlighted and the metric charted per hyperparameter."""
    project = api.post("/api/v1/projects", json={"name": "sweeps"}).json()
    api.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload",
        files={"file": ("train.py", SWEEP_MODULE)},
    ).raise_for_status()
    log_in(page, stack)
    page.goto(f"{stack.url}/projects/{project['id']}")
    page.click("#sweeps-link")
    expect(page.locator("#no-sweeps")).to_be_visible()
    page.fill("#sweep-name", "lr and width")
    page.fill("#sweep-groups", "cpu-a:1, cpu-b:1")
    page.fill("#sweep-epochs", "1")
    page.fill("#sweep-batch", "16")
    page.fill("#sweep-space", '{"lr": [0.05, 0.01], "depth": [8, 16]}')
    page.fill("#sweep-trials", "4")  # the whole grid
    page.fill("#sweep-parallel", "2")  # at most 2 submitted; cpu-b's one worker runs one
    page.click("#start-sweep-button")
    expect(page.locator("#error-space")).to_contain_text("'depth' is not declared")
    expect(page.locator("#sweep-name")).to_have_value("lr and width")  # kept as typed
    page.fill("#sweep-space", '{"lr": [0.05, 0.01], "hidden": [8, 16]}')
    page.click("#start-sweep-button")
    expect(page.locator("#sweep-status")).to_have_text("RUNNING")
    expect(page.locator("#trials-table tbody tr")).to_have_count(4)  # submitted or waiting
    expect(page.locator("#sweep-status")).to_have_text("FINISHED", timeout=300_000)
    sweep_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    sweep = api.get(f"/api/v1/sweeps/{sweep_id}").json()
    reasons = [
        api.get(f"/api/v1/tasks/{t['task_id']}").json()["status_reason"] for t in sweep["trials"]
    ]
    assert [t["status"] for t in sweep["trials"]] == ["SUCCEEDED"] * 4, reasons
    assert [tuple(t["hyperparameters"].values()) for t in sweep["trials"]] == [
        (0.05, 8),
        (0.05, 16),
        (0.01, 8),
        (0.01, 16),
    ]
    assert all(sorted(t["groups"]) == ["cpu-a", "cpu-b"] for t in sweep["trials"]), sweep["trials"]
    best = page.locator("#trials-table tr.best")
    expect(best).to_have_count(1)
    expect(best).to_have_attribute("data-trial", str(sweep["best"]["index"]))
    expect(page.locator("#sweep-best")).to_contain_text(f"trial {sweep['best']['index']}")
    for index in (0, 1):  # lr and hidden, each with a point per trial
        expect(page.locator(f"#sweep-chart-{index}")).to_have_attribute("data-points", "4")
    page.click("#sweeps-link")
    expect(page.locator("#sweeps-table")).to_contain_text(re.compile(r"FINISHED"))


def test_the_task_pages_charts_read_metrics_in_increments(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """The task page reads its epoch metrics after a cursor (`after_id`), page by page past
    10,000 rows, and still draws a row that committed after a later one was read (ids are
    taken at insert): here the API's answers are played by the test, the task shown as
    RUNNING so that the page keeps polling."""
    version = new_version(api, example="tiny_regression", project_name="increments")
    task_id = submit(api, version, resource_groups=[{"name": "cpu-a", "workers": 1}])["id"]
    api.post(f"/api/v1/tasks/{task_id}/cancel")

    def row(metric_id: int) -> dict:
        return {
            "id": metric_id,
            "step": metric_id,
            "epoch": metric_id,  # one val_loss an epoch: the chart's points are the epochs
            "name": "val_loss",
            "value": 1.0 / metric_id,
            "nonfinite": None,
            "rank": None,
            "created_at": "2026-11-29T10:00:00Z",
        }

    stored = {i: row(i) for i in range(1, 10_002)}  # 10,001: two pages of 10,000
    asked: list[int] = []

    def metrics(route: Route) -> None:
        query = parse_qs(urlparse(route.request.url).query)
        if query.get("scale") != ["epoch"]:
            route.fulfill(json=[])
            return
        after, limit = int(query["after_id"][0]), int(query["limit"][0])
        asked.append(after)
        route.fulfill(json=[stored[i] for i in sorted(stored) if i > after][:limit])

    def running(route: Route) -> None:
        response = route.fetch()
        route.fulfill(response=response, json={**response.json(), "status": "RUNNING"})

    page.route(re.compile(rf".*/api/v1/tasks/{task_id}/metrics\?.*"), metrics)
    page.route(re.compile(rf".*/api/v1/tasks/{task_id}$"), running)
    log_in(page, stack)
    page.goto(f"{stack.url}/tasks/{task_id}")
    chart = page.locator("#loss-chart")
    expect(chart).to_have_attribute("data-points", "10001", timeout=30_000)
    assert asked[:2] == [0, 10_000]  # the second page after the first's last id
    stored[10_003] = row(10_003)  # stored while 10,002's report is still being written
    expect(chart).to_have_attribute("data-points", "10002", timeout=30_000)
    stored[10_002] = row(10_002)  # committed after a later id was read
    expect(chart).to_have_attribute("data-points", "10003", timeout=30_000)
