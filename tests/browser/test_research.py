"""The portal in Chromium, for a researcher between tasks: "Run again" from a task's page,
and a code version's source (a file of its own, so that `--dist loadfile` runs it beside
test_portal.py rather than after it)."""

import io
import zipfile

import httpx
from playwright.sync_api import Page, expect

from polytrain.stack import LocalStack
from tests.browser.conftest import log_in
from tests.browser.test_portal import EXAMPLE


def test_run_again_from_a_cancelled_tasks_page(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """An ended task's page has "Run again": it opens the project's submit form filled from the
    task; one field changed and submitted gives a new task with that change and the rest of
    the original's spec."""
    project = api.post("/api/v1/projects", json={"name": "run-again"}).json()
    version = api.post(
        f"/api/v1/projects/{project['id']}/code-versions", json={"example": "tiny_regression"}
    ).json()
    body = {
        "project_id": project["id"],
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


def test_filter_tick_two_tasks_and_compare_their_curves(
    page: Page, stack: LocalStack, api: httpx.Client
) -> None:
    """The task list filters by tag, two tasks ticked open the comparison: the setting that
    differs, the final metrics, and the chart drawing both tasks' curves by step and by
    epoch."""
    project = api.post("/api/v1/projects", json={"name": "compare-runs"}).json()
    version = api.post(
        f"/api/v1/projects/{project['id']}/code-versions", json={"example": "tiny_regression"}
    ).json()
    ids = []
    for lr_tag, epochs in (("lr=0.1", 2), ("lr=0.01", 3)):
        body = {
            "project_id": project["id"],
            "code_version_id": version["id"],
            "name": f"compare {lr_tag}",
            "resource_groups": [{"name": "cpu-a", "workers": 1}],
            "epochs": epochs,
            "global_batch_size": 8,
            "tags": ["cmp", lr_tag],
        }
        task = api.post("/api/v1/tasks", json=body)
        assert task.status_code == 201, task.text
        ids.append(task.json()["id"])
        api.post(f"/api/v1/tasks/{ids[-1]}/cancel")  # 409 if it already ended: fine
        points = [
            {
                "name": "val_loss",
                "value": 1.0 / (epoch + len(ids)),
                "step": 4 * epoch,
                "epoch": epoch,
            }
            for epoch in range(epochs)
        ]
        httpx.post(
            f"{stack.url}/internal/v1/tasks/{ids[-1]}/metrics",
            headers={"Authorization": f"Bearer {stack.token}"},
            json={"metrics": points},
            timeout=30,
        ).raise_for_status()
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
    expect(page.locator("#final-metrics tr[data-metric='val_loss'] td.best")).to_have_text("0.25")
    chart = page.locator("#compare-chart")
    expect(chart).to_have_attribute("data-points", "5")  # 2 + 3 epochs' points
    page.select_option("#compare-x", "epoch")
    expect(chart).to_have_attribute("data-points", "5")
    # by wall time: neither task started (both cancelled while queued), so no point has one
    page.select_option("#compare-x", "seconds")
    expect(chart).to_have_attribute("data-points", "0")
    expect(page.locator("#compare-empty")).to_be_visible()
