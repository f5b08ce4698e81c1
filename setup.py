"""Build hook only (everything else is in pyproject.toml): ship the portal's templates and
static files, the Alembic migrations and alembic.ini inside the `backend` package, as
`backend/_assets/{frontend,migrations,alembic.ini}`, so an installed wheel serves pages and
migrates without the checkout (`backend/core/paths.py` finds them there, else in the checkout).
MANIFEST.in puts the same files in source distributions."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
ASSETS = ("frontend", "migrations", "alembic.ini")


class BuildWithAssets(build_py):
    """`build_py`, then a copy of ASSETS under `backend/_assets/` of the build."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "backend" / "_assets"
        shutil.rmtree(target, ignore_errors=True)  # nothing stale from an earlier build
        for name in ASSETS:
            source, dest = ROOT / name, target / name
            if source.is_dir():
                shutil.copytree(
                    source,
                    dest,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                )
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest)


setup(cmdclass={"build_py": BuildWithAssets})
