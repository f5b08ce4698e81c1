"""The per-step curves in Chromium: a real task's training loss, samples/s and learning rate
per step on its page, smoothed by the slider and zoomed by the wheel (a file of its own, so
that `--dist loadfile` runs it beside the other browser files)."""

import httpx
from playwright.sync_api import Page, expect

from polytrain.stack import LocalStack
from tests.browser.conftest import log_in

LOSS = "Chart.getChart(document.getElementById('step-loss-chart'))"


def test_a_tasks_per_step_curves_zoom_and_smooth(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """tiny_regression, 160 items in batches of 16 on one worker: 10 steps an epoch, a point
    every 2 steps (`step_metrics_every`), 2 epochs: 10 points of each series."""
    project = api.post("/api/v1/projects", json={"name": "step-curves"}).json()
    version = api.post(
        f"/api/v1/projects/{project['id']}/code-versions", json={"example": "tiny_regression"}
    ).json()
    body = {
        "project_id": project["id"],
        "code_version_id": version["id"],
        "resource_groups": [{"name": "cpu-a", "workers": 1}],
        "epochs": 2,
        "global_batch_size": 16,
        "step_metrics_every": 2,
    }
    created = api.post("/api/v1/tasks", json=body)
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    log_in(page, stack)
    page.goto(f"{stack.url}/tasks/{task_id}")
    expect(page.locator("#task-status")).to_have_text("SUCCEEDED", timeout=180_000)
    page.reload()  # every point stored: the page's last poll may have come before the last
    for chart in ("step-loss-chart", "step-rate-chart", "step-lr-chart"):
        expect(page.locator(f"#{chart}")).to_have_attribute("data-points", "10")
    expect(page.locator("#step-charts-empty")).to_be_hidden()
    expect(page.locator("#step-user-figure")).to_be_hidden()  # no STEP_METRICS in the module
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
