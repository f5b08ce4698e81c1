"""Screenshots of the portal's main pages for the README, from a real run.

Starts a LocalStack (API and two CPU agents on loopback), logs in with Debian's
Chromium through Playwright and creates a project. From the project page's submit form
it plans the bundled MNIST example on both groups (a real trial task) and photographs
the plan, then submits the task from that plan across both groups and photographs it
while it trains and when it has finished (it trains for over a minute, so that the
agents' resource samples, taken every 15 s, draw the CPU and memory charts), then the
code version's source and the other pages, into docs/screenshots/. "Run again" from the
finished task's page trains a second task with twice the global batch; the task list with
both ticked opens their comparison; a grid sweep of the example's learning rate and width
runs its 4 trials on both groups. About five minutes on a 2-core host.

Needs the dev extras (Playwright) and Debian's chromium package (/usr/bin/chromium):

    .venv/bin/python scripts/screenshots.py
"""

import io
import sys
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image
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
EPOCHS = 12
BATCH = 8
"""A small global batch: its many short steps make an epoch take about five seconds here,
so that the task trains for over a minute (several resource samples per worker, taken every
15 s) in few epochs (the task page lists each epoch's checkpoint and provenance)."""
WORKERS = {"cpu-a": 2, "cpu-b": 1}
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def shoot(page: Page, name: str, *, full: bool = False, selector: str | None = None) -> None:
    """The viewport, the whole page (`full`) or one element (`selector`) as `name`.png, in
    256 colours without dithering: the pages' flat colours, charts and anti-aliased text
    look the same at about a third of the size."""
    shot = page.locator(selector).screenshot() if selector else page.screenshot(full_page=full)
    image = Image.open(io.BytesIO(shot)).convert("RGB")
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        OUT / f"{name}.png", optimize=True
    )
    print(f"wrote docs/screenshots/{name}.png", flush=True)


def log_in(page: Page, stack: LocalStack) -> None:
    page.goto(f"{stack.url}/login")
    page.fill("#login-email", stack.admin_email)
    page.fill("#login-password", stack.admin_password)
    shoot(page, "login")
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"{stack.url}/")


def fill_workers(page: Page) -> None:
    for group, workers in WORKERS.items():
        page.fill(f"#workers-{group}", str(workers))


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
    fill_workers(page)
    page.fill("#task-epochs", str(EPOCHS))
    page.fill("#task-global_batch_size", str(BATCH))
    page.locator("#task-global_batch_size").blur()
    shoot(page, "project", full=True)


def plan_then_submit(page: Page) -> None:
    """Plan from the form (the example becomes code version v1 and its trial runs on both
    groups), photograph the ready plan, use it, and submit it on every worker with an even
    split whichever option the plan recommends: with so small a batch the cross-group
    exchange may cost a group more than its compute saves, so the plan may leave it out
    (and a weighted split would let the guard park it). The task still names the plan,
    which predicts its time to finish, and its charts show both groups at work."""
    page.click("#plan-button")
    page.wait_for_function(
        "() => /Ready|failed|cancelled|refused/.test("
        "document.getElementById('plan-panel').innerText)",
        timeout=240_000,
        polling=500,
    )
    if "Ready:" not in page.inner_text("#plan-status"):
        raise SystemExit(f"the plan did not become ready: {page.inner_text('#plan-panel')}")
    page.wait_for_timeout(500)  # the bar chart drawn
    shoot(page, "plan", selector="#plan-panel")
    page.click("#plan-use")
    fill_workers(page)
    page.select_option("#task-split_policy", "even")
    page.click("#task-form button[type=submit]")
    page.wait_for_selector("#task-page")


def watch_task(page: Page, api: httpx.Client) -> dict:
    """Photograph the task page half-way and when it has ended; the task's REST view."""
    task_id = page.get_attribute("#task-page", "data-task-id")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        task = api.get(f"/api/v1/tasks/{task_id}").json()
        if task["progress"] >= 0.5 or task["status"] in TERMINAL:
            break
        time.sleep(1)
    page.reload()  # the provenance section is drawn by the server, not kept up to date
    page.wait_for_timeout(3500)
    shoot(page, "task-running", full=True)
    while task["status"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(1)
        task = api.get(f"/api/v1/tasks/{task_id}").json()
    page.reload()  # the provenance section is drawn by the server, not kept up to date
    page.wait_for_selector("#provenance details")
    page.wait_for_timeout(3500)
    shoot(page, "task", full=True)
    samples = api.get(f"/api/v1/tasks/{task_id}/metrics", params={"resources": "true"}).json()
    print(
        f"task {task_id}: {task['status']}, {task['started_at']} to {task['finished_at']}, "
        f"{len(samples)} resource samples",
        flush=True,
    )
    return task


def run_again(page: Page, api: httpx.Client, first: dict) -> dict:
    """The "Run again" button of the finished task's page with twice its global batch, submitted and
    trained to the end: the second task of the comparison."""
    page.goto(page.url.split("/tasks/")[0] + f"/tasks/{first['id']}")
    page.click("#run-again")
    page.wait_for_selector("#run-again-note")
    page.fill("#task-name", f"MNIST CNN, global batch {2 * BATCH}")
    page.fill("#task-global_batch_size", str(2 * BATCH))
    page.click("#task-form button[type=submit]")
    page.wait_for_selector("#task-page")
    task_id = page.get_attribute("#task-page", "data-task-id")
    deadline = time.monotonic() + 300
    task = api.get(f"/api/v1/tasks/{task_id}").json()
    while task["status"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(1)
        task = api.get(f"/api/v1/tasks/{task_id}").json()
    print(f"task {task_id}: {task['status']}", flush=True)
    return task


def compare(page: Page, base: str, project_id: int, ids: list[int]) -> None:
    """The project's tasks in the task list, both tasks ticked, then their comparison."""
    page.goto(f"{base}/?project={project_id}")
    for task_id in ids:
        page.check(f"#task-table input[value='{task_id}']")
    shoot(page, "tasks")
    page.click("#compare-button")
    page.wait_for_selector("#compare-chart[data-points]")
    page.wait_for_timeout(1000)  # the chart drawn
    shoot(page, "compare", full=True)


def sweep(page: Page, api: httpx.Client, base: str, project_id: int) -> None:
    """A grid sweep of the example's learning rate and width (4 trials of one epoch, two at
    once, on one worker of each group), photographed when it has finished."""
    page.goto(f"{base}/projects/{project_id}/sweeps")
    form = {
        "name": "Adam lr and hidden width",
        "groups": "cpu-a:1, cpu-b:1",
        "epochs": "1",
        "batch": "32",
        "space": '{"lr": [0.003, 0.001], "hidden": [32, 64]}',
        "trials": "4",
        "parallel": "2",
    }
    for field, value in form.items():
        page.fill(f"#sweep-{field}", value)
    page.click("#start-sweep-button")
    page.wait_for_selector("#sweep-status")
    sweep_id = page.url.rstrip("/").rsplit("/", 1)[1]
    deadline = time.monotonic() + 600
    status = "RUNNING"
    while status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(2)
        status = api.get(f"/api/v1/sweeps/{sweep_id}").json()["status"]
    page.reload()
    page.wait_for_timeout(1500)  # the charts drawn
    print(f"sweep {sweep_id}: {status}", flush=True)
    shoot(page, "sweep", full=True)


def main() -> None:
    started = time.monotonic()
    OUT.mkdir(parents=True, exist_ok=True)
    groups = [
        GroupSetup("cpu-a", 2, description="CPU pool A"),
        GroupSetup("cpu-b", 1, description="CPU pool B"),
    ]
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalStack(data_dir=Path(tmp), port=free_port(), groups=groups) as stack,
        httpx.Client(base_url=stack.url, headers=stack.headers, timeout=30) as api,
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1360, "height": 860})
        log_in(page, stack)
        make_project(page, stack)
        plan_then_submit(page)
        task = watch_task(page, api)
        again = run_again(page, api, task)
        compare(page, stack.url, task["project_id"], [task["id"], again["id"]])
        sweep(page, api, stack.url, task["project_id"])
        for path, name in [
            (f"/projects/{task['project_id']}/code/{task['code_version_id']}", "code"),
            ("/projects", "projects"),
            ("/resource-groups", "cluster"),
            ("/admin/users", "users"),
            ("/account", "account"),
        ]:
            page.goto(stack.url + path)
            shoot(page, name)
        browser.close()
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
