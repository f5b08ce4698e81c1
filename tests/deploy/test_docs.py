"""The documents the code cites are in the repository (docs/), and README facts hold."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md\b")


def test_every_document_the_code_cites_exists() -> None:
    cited: dict[str, list[str]] = {}
    for folder in ("backend", "worker", "contracts", "polytrain", "examples", "bench", "scripts"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and "__pycache__" not in path.parts:
                for name in CITATION.findall(path.read_text()):
                    cited.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert "docs/architecture.md" in cited  # the training-code contract is cited
    missing = {
        name: where
        for name, where in cited.items()
        if not (REPO / name).is_file() and not (REPO / "docs" / name).is_file()
    }
    assert not missing, f"cited but not in the repository: {missing}"


def test_architecture_document_defines_the_training_code_contract() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    for function in ("build_model", "build_datasets", "build_optimizer", "loss_fn", "metrics"):
        assert f"def {function}(" in text
    assert "## Where the code differs today" in text


def test_readme_names_the_admin_password_file_polytrain_up_writes() -> None:
    from polytrain.demo import run_up  # noqa: F401  (`polytrain up` keeps its data in var/up)
    from polytrain.stack import LocalStack

    readme = (REPO / "README.md").read_text()
    stack = LocalStack(data_dir=Path("var/up"))
    password_file = Path("var/up") / "admin-password"
    assert stack.data_dir / "admin-password" == password_file
    assert f"`{password_file}`" in readme
    assert "`var/admin-password`" not in readme


def _list_endpoints() -> dict[str, tuple[str, int, int]]:
    """GET /api/v1 lists: path (ids as {}) -> (paging, default limit, max limit)."""
    from backend.main import create_app

    spec = create_app(run_scheduler=False).openapi()
    found = {}
    for path, operations in spec["paths"].items():
        get = operations.get("get")
        schema = (
            (get or {})
            .get("responses", {})
            .get("200", {})
            .get("content", {})
            .get("application/json", {})
            .get("schema", {})
        )
        if not path.startswith("/api/v1/") or schema.get("type") != "array":
            continue
        query = {p["name"]: p["schema"] for p in get["parameters"] if p["in"] == "query"}
        paging = "offset" if "offset" in query else "after_id" if "after_id" in query else "none"
        limit = query["limit"]
        found[re.sub(r"\{[^}]+\}", "{}", path.removeprefix("/api/v1"))] = (
            paging,
            limit["default"],
            limit["maximum"],
        )
    return found


def test_readme_pagination_table_matches_the_routers(service_env: Path) -> None:
    readme = (REPO / "README.md").read_text()
    rows = {
        re.sub(r"\{[^}]+\}", "{}", path): (how, int(default), int(maximum))
        for path, how, default, maximum in re.findall(
            r"^\| `GET ([^`]+)` \| ([^|]+) \| (\d+) \((\d+)\) \|$", readme, re.MULTILINE
        )
    }
    other = re.search(
        r"^\| every other list: [^|]+ \| `offset`, `limit` \| (\d+) \((\d+)\) \|$",
        readme,
        re.MULTILINE,
    )
    assert rows and other
    endpoints = _list_endpoints()
    assert len(endpoints) >= 10
    for path, (paging, default, maximum) in endpoints.items():
        assert paging != "none", f"{path} is a list without paging"
        if path in rows:
            how, doc_default, doc_max = rows[path]
            assert f"`{paging}`" in how, (path, how)
            assert (doc_default, doc_max) == (default, maximum), path
        else:
            assert paging == "offset", path
            assert (int(other.group(1)), int(other.group(2))) == (default, maximum), path
    assert set(rows) <= set(endpoints)


def _layout_section() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## Layout", 1)[1].split("\n## ", 1)[0]


def test_readme_layout_names_every_top_level_folder_and_backend_domain() -> None:
    """A newcomer finds every folder of the tree, and every backend domain, in the Layout."""
    layout = _layout_section()
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    folders = {path.split("/")[0] for path in tracked if "/" in path and not path.startswith(".")}
    missing = sorted(f for f in folders if f"`{f}/" not in layout)
    assert not missing, f"README's Layout does not name: {missing}"
    domains = sorted(
        p.parent.name for p in (REPO / "backend").glob("*/__init__.py") if p.parent.name != "core"
    )
    assert not [d for d in domains if d not in layout], (domains, layout)
