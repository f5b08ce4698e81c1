"""A code version's declared Python requirements, resolved at upload into a lock.

A code version may declare the packages it needs beyond the platform's: a `requirements`
text beside a single module, or an archive's own `requirements.txt` (else its
`pyproject.toml`'s `[project] dependencies`). The portal resolves them once, at upload,
into a *lock* (:mod:`contracts.packages`): exact pins with hashes of the packages the
platform's environment lacks. The agents install exactly that lock (one cached
environment per lock hash); torch and everything else the platform ships stay the
platform's, so a requirement that would replace one is refused here, at upload, with
what to do instead.

Both steps call uv (https://docs.astral.sh/uv/) with the index settings of the API
(`Settings.package_index()`; docs/security.md, "Training code's own packages"); with
`wheels_only` (the default) no package code runs while resolving.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from backend.core.errors import Busy, Invalid
from contracts.packages import PackageIndex, normalise, pins, platform_packages, uv_bin

FIELD = "requirements"
# Longest requirements text accepted (characters): a form field, or an archive's file.
MAX_REQUIREMENTS_CHARS = 20_000
RESOLVE_TIMEOUT_S = 120.0
# Resolutions at once in this API process: each waits on the index for up to
# RESOLVE_TIMEOUT_S in a request thread, which the agents' heartbeats share; more uploads
# with requirements at once are answered 503 (Busy) rather than queued.
MAX_CONCURRENT_RESOLUTIONS = 2
_resolving = threading.BoundedSemaphore(MAX_CONCURRENT_RESOLUTIONS)
# A comment: `#` at the start or after whitespace, to the end (linear: no nested repeat).
_COMMENT = re.compile(r"(?:^|(?<=\s))#.*$")
# uv's plan of a dry run: ` + name==version` (would install), ` - name==version` (would
# remove: replace one of the platform's packages).
_PLAN_LINE = re.compile(r"^\s*([+-])\s+([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", re.MULTILINE)
# uv's words for a package with no wheel when wheels are required.
_NO_WHEEL = (
    re.compile(r"Wheels are required for `([^`]+)`"),
    re.compile(r"all versions of ([A-Za-z0-9][A-Za-z0-9._-]*) have no usable wheels"),
    re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)[^\s]* has no usable wheels"),
)
_ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".tgz", ".zip", ".tar.bz2")
# What uv prints besides its answer (dropped from a refusal's message).
_NOISE = ("Using Python", "Resolved ", "Audited ", "Checked ", "Prepared ", "Would download")


def declared_requirements(files: dict[str, bytes]) -> str | None:
    """The requirements an archive declares: its root `requirements.txt`, else the
    `[project] dependencies` of its root `pyproject.toml` (one per line); None when it has
    neither (or the pyproject lists no dependencies).

    `files` are the archive's files by path, its single top folder already stripped.

    Raises:
        Invalid: the file is not UTF-8 text, is too long, or the pyproject is not valid
            TOML or its dependencies are not a list of strings (field `file`).
    """
    if "requirements.txt" in files:
        return _text(files["requirements.txt"], "requirements.txt")
    if "pyproject.toml" not in files:
        return None
    try:
        project = tomllib.loads(_text(files["pyproject.toml"], "pyproject.toml")).get("project")
    except tomllib.TOMLDecodeError as exc:
        raise Invalid(
            f"the archive's pyproject.toml is not valid TOML: {exc}", field="file"
        ) from exc
    dependencies = project.get("dependencies") if isinstance(project, dict) else None
    if dependencies is None:
        return None
    if not isinstance(dependencies, list) or not all(isinstance(d, str) for d in dependencies):
        raise Invalid(
            "the archive's pyproject.toml: [project] dependencies must be a list of strings",
            field="file",
        )
    return "\n".join(dependencies) + "\n" if dependencies else None


def _text(content: bytes, name: str) -> str:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Invalid(f"the archive's {name} is not UTF-8 text", field="file") from exc
    if len(text) > MAX_REQUIREMENTS_CHARS:
        raise Invalid(
            f"the archive's {name} is over {MAX_REQUIREMENTS_CHARS} characters", field="file"
        )
    return text


def requirement_lines(requirements: str) -> list[str]:
    """The requirements of a requirements text, one `Requirement` each, as written.

    Blank lines and comments are dropped; a line continued with `\\` is joined. Each
    requirement names a package on the index: a name, extras, a version spec and markers
    (PEP 508), e.g. `einops>=0.8` or `timm[hub]; python_version >= "3.11"`.

    Raises:
        Invalid: a pip option (`-e`, `-r`, `--index-url`, ...), a URL, a direct reference
            (`name @ url`), a local path or archive, or text that is no requirement; the
            message names the line (field `requirements`).
    """
    lines: list[str] = []
    numbered = _joined_lines(requirements)
    for number, raw in numbered:
        line = _COMMENT.sub("", raw).strip()
        if not line:
            continue
        kind = _refused_kind(line)
        if kind:
            raise Invalid(
                f"requirements name packages on the index; {kind} is refused "
                f"(line {number}: {raw.strip()!r})",
                field=FIELD,
            )
        lines.append(line)
    return lines


def _joined_lines(text: str) -> list[tuple[int, str]]:
    """`(first line number, line)` with backslash continuations joined."""
    joined: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((start, pending + line))
        pending = ""
    if pending:
        joined.append((start, pending))
    return joined


def _refused_kind(line: str) -> str | None:
    """What a requirement line is when it is not a package on the index, else None."""
    option = re.search(r"(?:^|\s)(--?[A-Za-z][\w-]*)", line)
    if option:
        return f"a pip option ({option.group(1)})"
    try:
        requirement = Requirement(line)
    except InvalidRequirement as exc:
        if "://" in line:
            return "a URL"
        if line.startswith((".", "/", "~", "\\")) or "/" in line or "\\" in line:
            return "a local path"
        return f"text that is no requirement ({_first_line(str(exc))})"
    if requirement.url:
        return "a direct reference (name @ url)"
    if line.lower().endswith(_ARCHIVE_SUFFIXES):
        return "a local archive"
    return None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


@dataclass
class _Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return f"{self.stdout}\n{self.stderr}"


def _uv(args: list[str], cache_dir: Path) -> _Run:
    """Run uv with only our settings: no user or project config, no `UV_*`/`PIP_*` of
    the service's environment, the cache in `cache_dir`.

    Raises:
        Busy: uv took over RESOLVE_TIMEOUT_S (the index is slow or unreachable).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    env.update(
        UV_CACHE_DIR=str(cache_dir),
        UV_NO_CONFIG="1",
        UV_NO_PROGRESS="1",
        UV_PYTHON_DOWNLOADS="never",
        NO_COLOR="1",
    )
    try:
        done = subprocess.run(
            [uv_bin(), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=RESOLVE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise Busy(
            f"resolving the requirements took over {RESOLVE_TIMEOUT_S:.0f} s; "
            "the package index is slow or unreachable, try again later",
            retry_after_s=30,
        ) from exc
    return _Run(done.returncode, done.stdout, done.stderr)


def _trimmed(output: str, limit: int = 800) -> str:
    """uv's message on one line, without its progress lines, at most `limit` characters."""
    kept = [
        line.strip()
        for line in output.splitlines()
        if line.strip() and not line.strip().startswith(_NOISE)
    ]
    text = " ".join(kept)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _named(lines: list[str]) -> dict[str, str]:
    """`{normalised name: line}` of the requirements."""
    return {normalise(Requirement(line).name): line for line in lines}


def _failed(lines: list[str], run: _Run, index: PackageIndex) -> Invalid:
    """The refusal of a failed resolution, naming the requirement when uv does."""
    output = run.output
    declared = _named(lines)
    if index.wheels_only:
        for pattern in _NO_WHEEL:
            found = pattern.search(output)
            if found:
                name = found.group(1)
                return Invalid(
                    f"{name} has no wheel (a built package) on {index.describe()} for this "
                    "platform, and only wheels are accepted, so that no package code runs at "
                    "upload or install: choose a version or a package that ships a wheel, or "
                    "ask an admin to add one to the index",
                    field=FIELD,
                )
    mentioned = [line for name, line in declared.items() if re.search(_word(name), output)]
    which = f" ({', '.join(mentioned)})" if mentioned else ""
    return Invalid(
        f"the requirements{which} cannot be resolved on {index.describe()}: {_trimmed(output)}",
        field=FIELD,
    )


def _word(name: str) -> str:
    """A pattern for a normalised name as uv may print it (`-`, `_` or `.`, any case)."""
    parts = [re.escape(part) for part in name.split("-")]
    return r"(?<![\w.-])" + r"[-_.]".join(parts) + r"(?![\w-])"


def _replaced(lines: list[str], plan: dict[str, tuple[str, str]]) -> Invalid:
    """The refusal of requirements that would replace platform packages.

    `plan` is `{name: (platform's version, wanted version)}`.
    """
    declared = _named(lines)
    said = [
        f"{declared[name]} would replace the platform's {name} {platform} with {wanted}: "
        f"{name} is the platform's, the same for every task; drop the pin, or use a spec "
        f"that {platform} meets (e.g. {name}>={_release(platform)})"
        for name, (platform, wanted) in sorted(plan.items())
        if name in declared
    ]
    others = ", ".join(
        f"{name} {platform} (with {wanted})"
        for name, (platform, wanted) in sorted(plan.items())
        if name not in declared
    )
    if said and others:
        said.append(f"it would also replace the platform's {others}")
    elif others:
        said.append(
            f"the requirements would replace the platform's {others}: relax the "
            "requirement that pulls it in, so that the platform's version satisfies it"
        )
    return Invalid("; ".join(said), field=FIELD)


def _release(version: str) -> str:
    """`2.13.0+cpu` -> `2.13`: a lower bound the platform's version meets."""
    numbers = re.match(r"\d+(\.\d+)?", version)
    return numbers.group(0) if numbers else version


def resolve(requirements: str, index: PackageIndex, *, cache_dir: Path) -> str | None:
    """The lock of `requirements`: exact pins with hashes of every package they need that
    the platform's environment lacks (a requirements-file text, :mod:`contracts.packages`).

    None when the text declares no requirement, or when the platform already provides
    everything it asks for (no package to install).

    Method:
        1. The lines are checked (:func:`requirement_lines`).
        2. `uv pip install --dry-run` against this interpreter's environment says what it
           would install (` + name==version`) and what it would replace (` - ...`).
        3. Any replacement is refused: the platform's packages (torch, ...) are everyone's.
        4. `uv pip compile --no-deps --generate-hashes` of the `+` pins gives the lock,
           which is checked once more to name no platform package.

    Both uv calls use `index` and the cache in `cache_dir`.

    Raises:
        Invalid: a refused line (pip option, URL, path); a requirement that would replace
            a platform package (named, with its platform version and what to do); an
            unresolvable requirement (uv's message and the index); with `index.wheels_only`,
            a package with no wheel (named). All with field `requirements`.
        Busy: uv took over RESOLVE_TIMEOUT_S.
    """
    if len(requirements) > MAX_REQUIREMENTS_CHARS:
        raise Invalid(f"requirements are over {MAX_REQUIREMENTS_CHARS} characters", field=FIELD)
    lines = requirement_lines(requirements)
    if not lines:
        return None
    if not _resolving.acquire(blocking=False):
        raise Busy(
            f"{MAX_CONCURRENT_RESOLUTIONS} uploads are resolving their requirements now; "
            "try again in a few seconds",
            retry_after_s=5,
        )
    try:
        return _resolve(lines, index, cache_dir=cache_dir)
    finally:
        _resolving.release()


def _resolve(lines: list[str], index: PackageIndex, *, cache_dir: Path) -> str | None:
    """:func:`resolve`'s steps 2-4 for checked `lines`."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="polytrain-resolve-") as folder:
        wanted = Path(folder) / "requirements.in"
        wanted.write_text("".join(f"{line}\n" for line in lines))
        python = ["--python", sys.executable]
        plan = _uv(
            ["pip", "install", "--dry-run", *python, *index.uv_args(), "-r", str(wanted)],
            cache_dir,
        )
        if plan.returncode != 0:
            raise _failed(lines, plan, index)
        added: dict[str, str] = {}
        removed: dict[str, str] = {}
        for sign, name, version in _PLAN_LINE.findall(plan.output):
            (added if sign == "+" else removed)[normalise(name)] = version
        if removed:
            raise _replaced(
                lines, {name: (version, added.get(name, "?")) for name, version in removed.items()}
            )
        if not added:
            return None
        pinned = Path(folder) / "pins.txt"
        pinned.write_text(
            "".join(f"{name}=={version}\n" for name, version in sorted(added.items()))
        )
        compiled = _uv(
            [
                "pip",
                "compile",
                "--no-deps",
                "--generate-hashes",
                "--no-header",
                "--no-annotate",
                *python,
                *index.uv_args(),
                str(pinned),
            ],
            cache_dir,
        )
    if compiled.returncode != 0:
        raise _failed(lines, compiled, index)
    lock = compiled.stdout
    shipped = sorted(set(pins(lock)) & set(platform_packages()))
    if shipped or not pins(lock):
        raise Invalid(
            f"the lock of these requirements names the platform's {', '.join(shipped)}"
            if shipped
            else f"uv gave no lock for these requirements: {_trimmed(compiled.output)}",
            field=FIELD,
        )
    return lock
