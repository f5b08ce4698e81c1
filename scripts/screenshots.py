"""Screenshots of the portal's main pages for the README, from a real run.

Starts a LocalStack (API and two CPU agents on loopback), logs in with Debian's
Chromium through Playwright, creates a project, trains the bundled MNIST example
across both groups and photographs each page into docs/screenshots/.

    .venv/bin/python scripts/screenshots.py
"""

import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polytrain.stack import GroupSetup, LocalStack  # noqa: E402
from worker.engine.ranks import free_port  # noqa: E402

OUT = ROOT / "docs" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]


def shoot(page: Page, name: str, *, full: bool = False) -> None:
    page.screenshot(path=str(OUT / f"{name}.png"), full_page=full)
    print(f"wrote docs/screenshots/{name}.png", flush=True)


def log_in(page: Page, stack: LocalStack) -> None:
    page.goto(f"{stack.url}/login")
    page.fill("#login-email", stack.admin_email)
    page.fill("#login-password", stack.admin_password)
    shoot(page, "login")
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"{stack.url}/")


def make_project(page: Page, stack: LocalStack) -> None:
    page.goto(f"{stack.url}/projects")
    page.fill("#project-name", "mnist")
    page.fill(
        "#project-description",
        "Handwritten digits: a small CNN trained across cpu-a and cpu-b at once.",
    )
    page.click("#project-form button[type=submit]")
    page.wait_for_selector("#task-form")
    page.select_option("#task-code-version", "example:mnist_cnn")
    page.fill("#task-name", "MNIST CNN across cpu-a and cpu-b")
    page.fill("#workers-cpu-a", "2")
    page.fill("#workers-cpu-b", "1")
    page.fill("#task-epochs", "4")
    shoot(page, "project", full=True)
    page.click("#task-form button[type=submit]")
    page.wait_for_selector("#task-page")


def watch_task(page: Page, stack: LocalStack) -> None:
    task_id = page.get_attribute("#task-page", "data-task-id")
    api = httpx.Client(base_url=stack.url, headers=stack.headers, timeout=30)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        task = api.get(f"/api/v1/tasks/{task_id}").json()
        if task["progress"] >= 0.5 or task["status"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        time.sleep(1)
    page.wait_for_timeout(3500)
    shoot(page, "task-running", full=True)
    while (
        api.get(f"/api/v1/tasks/{task_id}").json()["status"]
        not in ("SUCCEEDED", "FAILED", "CANCELLED")
        and time.monotonic() < deadline
    ):
        time.sleep(1)
    page.wait_for_timeout(3500)
    shoot(page, "task", full=True)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    groups = [
        GroupSetup("cpu-a", 2, description="CPU pool A"),
        GroupSetup("cpu-b", 1, description="CPU pool B"),
    ]
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalStack(data_dir=Path(tmp), port=free_port(), groups=groups) as stack,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1360, "height": 860})
        log_in(page, stack)
        make_project(page, stack)
        watch_task(page, stack)
        for path, name in [
            ("/", "tasks"),
            ("/projects", "projects"),
            ("/resource-groups", "cluster"),
            ("/admin/users", "users"),
            ("/account", "account"),
        ]:
            page.goto(stack.url + path)
            shoot(page, name)
        browser.close()


if __name__ == "__main__":
    main()
