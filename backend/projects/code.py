"""Static check of a training module against the training-code contract (docs/architecture.md)."""

import ast
import base64
import hashlib
import io
import tarfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from backend.core.errors import Invalid

REQUIRED = ("build_model", "build_datasets", "build_optimizer", "loss_fn")
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


def check_contract(source: bytes, *, filename: str) -> None:
    """Refuse a module that is not Python or lacks a required top-level function.

    A required function may also be imported (`from .model import build_model`)
    or assigned at the top level (`loss_fn = nn.functional.cross_entropy`).

    The module is parsed, never executed, here: it runs only on the agents.

    A class deriving from `IterableDataset` is refused too: the engine shards datasets by
    index (docs/architecture.md, "Data path").

    Raises:
        Invalid: not UTF-8, a syntax error, a missing function (named), or an
            IterableDataset class (named).
    """
    try:
        tree = ast.parse(source.decode("utf-8"), filename=filename)
    except (UnicodeDecodeError, SyntaxError) as exc:
        raise Invalid(f"{filename} is not valid Python: {exc}", field="file") from exc
    defined = _top_level_names(tree)
    missing = [name for name in REQUIRED if name not in defined]
    if missing:
        raise Invalid(
            f"{filename} does not meet the training-code contract: missing "
            + ", ".join(f"def {m}(...)" for m in missing),
            field="file",
        )
    iterable = _iterable_datasets(tree)
    if iterable:
        raise Invalid(
            f"{filename} defines {', '.join(iterable)} as an IterableDataset: polytrain gives "
            "each worker the indices of its shard, so datasets must be map-style "
            "(subclass torch.utils.data.Dataset with __len__ and __getitem__)",
            field="file",
        )


HYPERPARAMETERS = "HYPERPARAMETERS"


class Declared(NamedTuple):
    """What a module's source tells of its `HYPERPARAMETERS`, read without running it.

    `bound`: some statement may bind the name at module level (an assignment, an import, a
    `global` statement, the name as a string, as in `globals()["HYPERPARAMETERS"]`; a module
    that does not parse counts as bound, since nothing is known of it). `defaults`: the dict
    when it is a literal the parser reads, else None (not known here: the engine checks a
    task's names when it loads the module)."""

    bound: bool
    defaults: dict[str, object] | None


UNKNOWN = Declared(bound=True, defaults=None)


def _binds(tree: ast.Module) -> bool:
    """Whether anything in the module may bind `HYPERPARAMETERS` (over-approximated: a
    name stored or deleted anywhere, imported, declared global, caught, or a string equal
    to it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == HYPERPARAMETERS:
            if not isinstance(node.ctx, ast.Load):
                return True
        elif isinstance(node, ast.alias):
            if node.name == "*" or (node.asname or node.name.split(".")[0]) == HYPERPARAMETERS:
                return True
        elif isinstance(node, ast.Global | ast.Nonlocal):
            if HYPERPARAMETERS in node.names:
                return True
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar):
            if node.name == HYPERPARAMETERS:
                return True
        elif isinstance(node, ast.Constant) and node.value == HYPERPARAMETERS:
            return True
    return False


def read_hyperparameters(source: bytes) -> Declared:
    """The module's `HYPERPARAMETERS` as far as its source tells (`Declared`)."""
    try:
        tree = ast.parse(source.decode("utf-8"))
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return UNKNOWN
    if not _binds(tree):
        return Declared(bound=False, defaults=None)
    found: dict[str, object] | None = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, expression = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, expression = node.target, node.value
        else:
            continue
        if not (isinstance(target, ast.Name) and target.id == HYPERPARAMETERS):
            continue
        try:
            value = ast.literal_eval(expression)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return UNKNOWN
        found = value if isinstance(value, dict) else None
    if found is None or not all(isinstance(k, str) for k in found):
        return UNKNOWN
    return Declared(bound=True, defaults=found)


def declared_hyperparameters(source: bytes) -> dict[str, object] | None:
    """The defaults a module declares as a top-level `HYPERPARAMETERS = {...}` literal
    (docs/architecture.md, "Hyperparameters"), read without running it; None when it
    declares none, or not as a literal the parser can read."""
    return read_hyperparameters(source).defaults


def _kind(value: object) -> str | None:
    """A scalar's kind as the hyperparameter checks compare them; None for any other."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return None


def name_problem(declared: Declared, name: str) -> str | None:
    """Why a task may not set hyperparameter `name`: the module binds no HYPERPARAMETERS,
    or its literal dict lacks the name; None when it may, or when that is not known here."""
    if not declared.bound:
        return f"hyperparameter {name!r}: the module declares no HYPERPARAMETERS"
    if declared.defaults is not None and name not in declared.defaults:
        known = ", ".join(sorted(declared.defaults)) or "none"
        return (
            f"hyperparameter {name!r} is not declared in the code's HYPERPARAMETERS "
            f"(declared: {known})"
        )
    return None


def value_problem(declared: Declared, name: str, value: object) -> str | None:
    """Why `value` does not suit hyperparameter `name`: its kind (true/false, a number,
    int or float alike, or a string) is not its default's. Not checked: a null value, a
    default that is null or not such a scalar, or defaults not known here."""
    default = (declared.defaults or {}).get(name)
    want, got = _kind(default), _kind(value)
    if want is None or value is None or got == want:
        return None
    return f"hyperparameter {name!r} takes a {want} like its default {default!r}, not {value!r}"


def _iterable_datasets(tree: ast.Module) -> list[str]:
    """Classes of the module that derive from `IterableDataset` (by name)."""

    def named(base: ast.expr) -> bool:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        return name == "IterableDataset"

    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(named(b) for b in node.bases)
    ]


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def example_path(name: str) -> Path:
    """Path of the bundled example `name`, one of `list_examples()` and nothing else.

    The name is looked up in the list, never joined onto a path as given: a name
    like `../backend/main` or `/etc/x` names no example.

    Raises:
        Invalid: `name` is not in the bundled examples list (field `example`).
    """
    available = list_examples()
    if name not in available:
        shown = name.encode("unicode_escape").decode()[:100]
        raise Invalid(
            f"no bundled example '{shown}' (available: {', '.join(available)})", field="example"
        )
    return EXAMPLES_DIR / f"{name}.py"


def list_examples() -> list[str]:
    """The names of the bundled examples: `examples/*.py` not starting with `_`, sorted."""
    return sorted(
        p.stem for p in EXAMPLES_DIR.glob("*.py") if not p.stem.startswith("_") and p.is_file()
    )


ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
DEFAULT_ENTRYPOINTS = ("train.py", "main.py")
MAX_ARCHIVE_MEMBERS = 500


def _safe_name(name: str) -> str:
    """A member path inside the archive, refused if it could land outside the folder."""
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or ".." in parts or not parts or "\x00" in name:
        raise Invalid(f"archive member {name!r} has an unsafe path", field="file")
    return str(PurePosixPath(*parts))


def _zip_files(content: bytes, max_bytes: int) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        _check_sizes(len(members), sum(m.file_size for m in members), max_bytes)
        return {_safe_name(m.filename): archive.read(m) for m in members}


def _tar_files(content: bytes, max_bytes: int) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(content), mode="r:gz") as archive:
        members = [m for m in archive.getmembers() if not m.isdir()]
        if any(not m.isfile() for m in members):
            raise Invalid("archives may hold only files and folders (no links)", field="file")
        _check_sizes(len(members), sum(m.size for m in members), max_bytes)
        return {
            _safe_name(m.name): archive.extractfile(m).read()  # type: ignore[union-attr]
            for m in members
        }


def _check_sizes(members: int, total: int, max_bytes: int) -> None:
    if members > MAX_ARCHIVE_MEMBERS:
        raise Invalid(
            f"archive holds {members} files; the limit is {MAX_ARCHIVE_MEMBERS}", field="file"
        )
    if total > max_bytes:
        raise Invalid(f"archive unpacks to {total} bytes; the limit is {max_bytes}", field="file")


def _strip_common_folder(files: dict[str, bytes]) -> dict[str, bytes]:
    """`proj/train.py, proj/util.py` -> `train.py, util.py`: a zipped folder is its content."""
    tops = {PurePosixPath(name).parts[0] for name in files}
    if len(tops) == 1 and all(len(PurePosixPath(n).parts) > 1 for n in files):
        return {str(PurePosixPath(*PurePosixPath(n).parts[1:])): b for n, b in files.items()}
    return files


def _entrypoint(files: dict[str, bytes], wanted: str | None) -> str:
    if wanted:
        name = _safe_name(wanted.strip())
        if name not in files:
            raise Invalid(f"the archive has no {name!r}", field="entrypoint")
        if not name.endswith(".py"):
            raise Invalid(f"the entrypoint {name!r} is not a .py module", field="entrypoint")
        return name
    for name in DEFAULT_ENTRYPOINTS:
        if name in files:
            return name
    modules = sorted(n for n in files if n.endswith(".py"))
    if len(modules) == 1:
        return modules[0]
    listed = ", ".join(modules[:10]) or "none"
    raise Invalid(
        "name the entrypoint module: the archive has no train.py or main.py and "
        f"its .py files are: {listed}",
        field="entrypoint",
    )


class Archive(NamedTuple):
    """A checked archive: `content` its files repacked as one zip (the stored form),
    `entrypoint` the module's path inside it, `files` its files by path."""

    content: bytes
    entrypoint: str
    files: dict[str, bytes]


def read_archive(
    content: bytes, *, filename: str, entrypoint: str | None, max_bytes: int
) -> Archive:
    """Check an uploaded archive (.zip, .tar.gz) and its entrypoint against the contract.

    Returns the files repacked as one zip (the stored form), the entrypoint's path
    inside it and the files themselves. The entrypoint defaults to `train.py`,
    `main.py` or the only module. A single top-level folder is taken as the
    archive's root.

    Raises:
        Invalid: unreadable archive, unsafe paths or links, too many or too large
            files, no entrypoint, or an entrypoint that breaks the contract.
    """
    try:
        read = _zip_files if filename.lower().endswith(".zip") else _tar_files
        files = _strip_common_folder(read(content, max_bytes))
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
        raise Invalid(f"{filename} is not a readable archive: {exc}", field="file") from exc
    entry = _entrypoint(files, entrypoint)
    check_contract(files[entry], filename=f"{filename}:{entry}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as packed:
        for name in sorted(files):
            packed.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), files[name])
    return Archive(buffer.getvalue(), entry, files)


_LOADER = '''"""polytrain: the training code of {filename}, entrypoint {entrypoint}.

Made by the platform from the uploaded archive: on import it unpacks the archive
beside this file (once per host) and exposes the entrypoint's contract functions.
"""

import base64
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

_ARCHIVE = base64.b64decode("{archive}")
_ENTRYPOINT = {entrypoint!r}


def _unpack():
    root = Path(__file__).resolve().parent / "archive-{digest}"
    if not root.is_dir():
        staging = Path(tempfile.mkdtemp(dir=root.parent))
        zipfile.ZipFile(io.BytesIO(_ARCHIVE)).extractall(staging)
        try:
            os.rename(staging, root)
        except OSError:  # another rank on this host unpacked it first
            shutil.rmtree(staging, ignore_errors=True)
    return root


def _load():
    entry = _unpack() / _ENTRYPOINT
    sys.path.insert(0, str(entry.parent))
    spec = importlib.util.spec_from_file_location("polytrain_entry_{digest}", entry)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_module = _load()
for _name in (
    "build_model", "build_datasets", "build_optimizer", "loss_fn", "metrics", "HYPERPARAMETERS"
):
    if hasattr(_module, _name):
        globals()[_name] = getattr(_module, _name)
'''


def loader_module(archive: bytes, *, entrypoint: str, filename: str) -> bytes:
    """The one module agents receive for an archive version: it unpacks and imports it.

    Agents and the training engine take one `.py` module; this keeps that true
    for archives without changing them.
    """
    return _LOADER.format(
        filename=filename.replace('"', "'"),
        entrypoint=entrypoint,
        archive=base64.b64encode(archive).decode(),
        digest=hashlib.sha256(archive).hexdigest()[:16],
    ).encode()
