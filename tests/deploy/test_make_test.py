"""`make test` sets itself up on a fresh machine, or stops at once with the command to run.

Chromium missing (and no permission to install it) stops the set-up before
pytest; browser tests selected without Chromium stop the run before any test
(never a skip, never after starting a stack).
"""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_make_test_runs_the_set_up_before_pytest() -> None:
    plan = subprocess.run(
        ["make", "-n", "-s", "test", "BIN=.venv/bin"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MAKEFLAGS": ""},
    ).stdout.splitlines()
    setup = next(i for i, line in enumerate(plan) if "scripts/test_setup.sh" in line)
    tests = next(i for i, line in enumerate(plan) if "-m pytest" in line)
    assert setup < tests


def test_set_up_without_chromium_stops_with_the_command(tmp_path: Path) -> None:
    result = subprocess.run(
        ["scripts/test_setup.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "POLYTRAIN_CHROMIUM": str(tmp_path / "no-chromium"),
            "POLYTRAIN_NO_INSTALL": "1",
        },
    )
    assert result.returncode == 1
    assert "chromium missing" in result.stderr
    assert "apt-get install -y chromium" in result.stderr


def test_browser_tests_without_chromium_fail_before_any_test(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/browser"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "POLYTRAIN_CHROMIUM": str(tmp_path / "no-chromium")},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 4, output
    assert "apt-get update && apt-get install -y chromium" in output
    assert "skipped" not in output and "passed" not in output


def test_pytest_collects_every_test_folder() -> None:
    """`testpaths` orders the folders for the two test processes; a folder it misses would
    silently never run."""
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
            "testpaths"
        ]
    )
    folders = {
        f"tests/{p.parent.relative_to(REPO / 'tests').parts[0]}"
        for p in (REPO / "tests").rglob("test_*.py")
    }
    assert folders <= listed, sorted(folders - listed)
