"""The contract package stands between the deployables: it imports neither of them and no
database code; neither deployable imports the other, nor the deployment tools (`polytrain/`,
which may import all three). Inside the backend, `core/` (database, settings, errors, HTTP
plumbing) imports no domain."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imported_tops(path: Path) -> set[str]:
    """The top-level packages that module `path` imports (absolute imports only)."""
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def _crossings(package: str, forbidden: set[str]) -> list[tuple[str, str]]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        where = str(path.relative_to(REPO))
        found += [(where, top) for top in sorted(_imported_tops(path) & forbidden)]
    return found


def test_no_package_imports_the_other_side() -> None:
    assert _crossings("contracts", {"backend", "worker", "polytrain"}) == []
    assert _crossings("worker", {"backend", "polytrain"}) == []
    assert _crossings("backend", {"worker", "polytrain"}) == []


def _imported_modules(path: Path) -> set[str]:
    """The dotted names that module `path` imports, each `from m import n` as `m.n`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_core_imports_no_domain() -> None:
    """`backend/core/` is what every domain builds on, so it reaches none of them."""
    found = [
        (str(path.relative_to(REPO)), name)
        for path in sorted((REPO / "backend" / "core").rglob("*.py"))
        for name in sorted(_imported_modules(path))
        if name.startswith("backend.") and not name.startswith("backend.core.")
    ]
    assert found == []


def test_contracts_load_without_the_deployables_or_a_database() -> None:
    code = (
        "import sys, contracts.agent_api, contracts.messaging, contracts.payload, "
        "contracts.plan, contracts.preprocess, contracts.strict\n"
        "print(sorted(m for m in ('backend', 'worker', 'sqlalchemy', 'fastapi') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "[]"
