"""The wheel ships a working portal: `pip install` outside the repository, migrate, serve pages.

The wheel is built from a copy of the sources and installed (without
dependencies) into a fresh virtual environment. Its dependencies (torch,
FastAPI ...) come from this project's environment through a path entry, but
polytrain itself only from the wheel: the checkout is not importable (temp
working directory, no PYTHONPATH, and the editable install's finder is never
loaded), which the test asserts through `backend.__file__` and `polytrain.__file__`.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from worker.engine.ranks import free_port

REPO = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(
    ".git",
    ".venv",
    "var",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "node_modules",
)


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv holding polytrain from its wheel; the environment to run it with."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO, source, ignore=SKIP)
    # This environment's setuptools builds it (no index needed for an isolated build env).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
        ],
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("polytrain-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp
        ).stdout.strip()
    )
    # Dependencies from this project's environment: a plain path entry, whose own .pth files
    # (the editable install of the checkout) are not processed.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        cwd=tmp,
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("POLYTRAIN_")
        and k not in ("DATABASE_URL", "BROKER_URL", "PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(
        {
            "DATABASE_URL": f"sqlite:///{tmp / 'portal.db'}",
            "POLYTRAIN_DATA_DIR": str(tmp / "data"),
            "POLYTRAIN_AGENT_TOKEN": "t" * 32,
            "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}",
        }
    )
    return venv, env


def test_wheel_carries_templates_static_files_and_migrations(
    installed: tuple[Path, dict[str, str]],
) -> None:
    venv, _env = installed
    (wheel,) = (venv.parent / "dist").glob("polytrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "polytrain/cli.py",
        "polytrain/client/api.py",
        "polytrain/stack.py",
        "contracts/messaging.py",
        "worker/engine/ranks.py",
        "backend/_assets/alembic.ini",
        "backend/_assets/migrations/env.py",
        "backend/_assets/frontend/templates/login.html",
        "backend/_assets/frontend/static/portal.css",
    ):
        assert needed in names
    shipped = {
        n.rsplit("/", 1)[1]
        for n in names
        if n.startswith("backend/_assets/migrations/versions/") and n.endswith(".py")
    }
    assert shipped == {p.name for p in (REPO / "migrations" / "versions").glob("*.py")}


def test_installed_wheel_migrates_and_serves_the_login_page(
    installed: tuple[Path, dict[str, str]],
) -> None:
    venv, env = installed
    cwd = venv.parent  # outside the repository
    for package in ("backend", "polytrain"):
        where = _run(
            [str(venv / "bin" / "python"), "-c", f"import {package}; print({package}.__file__)"],
            cwd=cwd,
            env=env,
        ).stdout.strip()
        assert Path(where).is_relative_to(venv), where

    _run([str(venv / "bin" / "polytrain"), "db", "upgrade"], cwd=cwd, env=env)
    tables = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import sqlite3, sys; print(sorted(r[0] for r in sqlite3.connect(sys.argv[1])"
            ".execute(\"select name from sqlite_master where type='table'\")))",
            str(cwd / "portal.db"),
        ],
        cwd=cwd,
        env=env,
    ).stdout
    assert "'alembic_version'" in tables and "'task'" in tables and "'agent'" in tables

    port = free_port()
    api = subprocess.Popen(
        [str(venv / "bin" / "polytrain"), "api", "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert api.poll() is None, api.stdout.read().decode() if api.stdout else ""
            try:
                login = httpx.get(f"{url}/login", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the installed API never answered"
                time.sleep(0.3)
        assert login.status_code == 200
        assert '<form method="post" action="/login"' in login.text
        assert 'name="password"' in login.text
        css = httpx.get(f"{url}/static/portal.css", timeout=5)
        assert css.status_code == 200 and "text/css" in css.headers["content-type"]
    finally:
        api.terminate()
        api.wait(timeout=30)
