"""Static check of a training module against the training-code contract (ARCHITECTURE.md)."""

import ast
from pathlib import Path

from backend.core.errors import Invalid

REQUIRED = ("build_model", "build_datasets", "build_optimizer", "loss_fn")
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


def check_contract(source: bytes, *, filename: str) -> None:
    """Refuse a module that is not Python or lacks a required top-level function.

    The module is parsed, never executed, here: it runs only on the agents.

    Raises:
        Invalid: not UTF-8, a syntax error, or a missing function (named).
    """
    try:
        tree = ast.parse(source.decode("utf-8"), filename=filename)
    except (UnicodeDecodeError, SyntaxError) as exc:
        raise Invalid(f"{filename} is not valid Python: {exc}", field="file") from exc
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = [name for name in REQUIRED if name not in defined]
    if missing:
        raise Invalid(
            f"{filename} does not meet the training-code contract: missing "
            + ", ".join(f"def {m}(...)" for m in missing),
            field="file",
        )


def example_path(name: str) -> Path:
    """Path of the bundled example `name`. Raises Invalid if there is none."""
    path = EXAMPLES_DIR / f"{name}.py"
    if not path.is_file() or name.startswith("_"):
        available = ", ".join(sorted(list_examples()))
        raise Invalid(f"no bundled example '{name}' (available: {available})", field="example")
    return path


def list_examples() -> list[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.py") if not p.stem.startswith("_"))
