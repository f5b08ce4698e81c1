"""Where the portal's templates and static files and the migrations are.

An installed wheel carries them inside the package (`backend/_assets/`, put
there by setup.py); a checkout (or an editable install) has them at the
repository root. Both layouts hold the same relative paths.
"""

from pathlib import Path

PACKAGE_ASSETS = Path(__file__).resolve().parents[1] / "_assets"
CHECKOUT = Path(__file__).resolve().parents[2]


def asset(relative: str) -> Path:
    """The path of `relative` (e.g. `frontend/templates`, `migrations`, `alembic.ini`).

    Raises:
        FileNotFoundError: neither the installed package nor the checkout has it.
    """
    for base in (PACKAGE_ASSETS, CHECKOUT):
        if (base / relative).exists():
            return base / relative
    raise FileNotFoundError(
        f"{relative} is neither in {PACKAGE_ASSETS} (an installed "
        f"polytrain) nor in {CHECKOUT} (a checkout)"
    )
