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
        # Given: the form's select has no blank "default" choice (Chromium sends its first).
        "data": {"pin_memory": False},
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
