"""Real-browser tests: Debian's Chromium, driven headless by Playwright, against a live stack
(API, scheduler, two agents, real training). Chromium missing is a failure, never a skip."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from polytrain.stack import GroupSetup, LocalStack
from tests.e2e.conftest import COLD_RANKS, cancel_unfinished
from worker.engine.ranks import free_port

CHROMIUM = os.environ.get("POLYTRAIN_CHROMIUM", "/usr/bin/chromium")
INSTALL = "apt-get update && apt-get install -y chromium"
BROWSER_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Browser tests selected without Chromium: stop the run before any test starts."""
    if not Path(CHROMIUM).is_file() and any(
        Path(item.path).resolve().is_relative_to(BROWSER_TESTS) for item in items
    ):
        pytest.exit(
            f"{CHROMIUM} is missing and the browser tests need it: run `{INSTALL}` "
            f"(`make test` does it when run as root)",
            returncode=4,
        )


ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    groups = [
        GroupSetup("cpu-a", 2, description="CPU pool A"),
        GroupSetup("cpu-b", 1, description="CPU pool B"),
    ]
    with LocalStack(
        data_dir=tmp_path_factory.mktemp("browser"),
        port=free_port(),
        groups=groups,
        extra_env=COLD_RANKS,  # no idle warm interpreters: their warm-up is CPU the tests lack
    ) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: run `{INSTALL}`", pytrace=False)
    assert shutil.which(CHROMIUM)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(30_000)
    opened = context.new_page()
    blocked: list[str] = []  # what the portal's Content-Security-Policy refused, if anything
    opened.on(
        "console",
        lambda message: (
            blocked.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )
    yield opened
    context.close()
    assert not blocked, f"the page broke its own CSP: {blocked}"


@pytest.fixture
def api(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, headers=stack.headers, timeout=30) as client:
        yield client
        cancel_unfinished(client)  # a failed test's task holds no worker from the next


def log_in(
    page: Page, stack: LocalStack, email: str | None = None, password: str | None = None
) -> None:
    """Log in through the login form and land on the task list."""
    page.goto(f"{stack.url}/")
    page.wait_for_url("**/login?next=*")
    page.fill("#login-email", email or stack.admin_email)
    page.fill("#login-password", password or stack.admin_password)
    page.click("#login-form button[type=submit]")
    page.wait_for_url(f"{stack.url}/")
