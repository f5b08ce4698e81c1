"""The files of a code version, to read: listed, and each shown as text.

A module version (an upload or a bundled example) is one file; an archive version is the
zip it was stored as (backend.projects.code.read_archive), read here with `zipfile` in
memory and never unpacked to disk. A file is looked up by its path in the listing, never
joined onto a directory, and a path that could leave the archive (`..`, absolute) is
refused outright.
"""

import zipfile
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from backend.core.errors import Invalid, NotFound, TooLarge, UnsupportedType
from backend.projects.code import example_path
from backend.projects.models import CodeVersion

MAX_SHOWN_BYTES = 1024 * 1024
"""The largest file shown (1 MiB): source code, not data."""


class CodeFile(NamedTuple):
    """One file of a code version: its path (inside the archive) and size in bytes."""

    path: str
    size_bytes: int


def _shown(path: str) -> str:
    """`path` for a message: quoted, cut short, control characters escaped."""
    return repr(path[:300])


def check_path(path: str) -> str:
    """A file path inside a code version, as listed: relative, `/`-separated, no `..`.

    Raises:
        Invalid: an empty, absolute or traversing path, or one with a backslash or NUL.
    """
    parts = PurePosixPath(path).parts
    if (
        not parts
        or path.startswith("/")
        or ".." in parts
        or "\\" in path
        or "\x00" in path
        or str(PurePosixPath(*parts)) != path
    ):
        raise Invalid(
            f"{_shown(path)} is not a file path inside the code version "
            "(relative, `/`-separated, no `..`)",
            field="path",
        )
    return path


def _module_name(version: CodeVersion) -> str:
    """The one file of a module version: the uploaded file's name, without any folder."""
    name = PurePosixPath(version.filename.replace("\\", "/")).name
    return name or "module.py"


def _module_file(version: CodeVersion) -> Path:
    if version.source.startswith("example:"):
        return example_path(version.source.split(":", 1)[1])
    assert version.path is not None
    return Path(version.path)


def _archive(version: CodeVersion) -> zipfile.ZipFile:
    assert version.path is not None
    return zipfile.ZipFile(version.path)


def _members(archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """The archive's files by path; a name that is not a safe path is left out."""
    found = {}
    for info in archive.infolist():
        if info.is_dir():
            continue
        try:
            found[check_path(info.filename)] = info
        except Invalid:
            continue
    return found


def list_files(version: CodeVersion) -> list[CodeFile]:
    """The version's files, by path: an archive's every file, a module's one."""
    if version.source == "archive":
        with _archive(version) as archive:
            members = _members(archive)
        return [CodeFile(path, members[path].file_size) for path in sorted(members)]
    return [CodeFile(_module_name(version), _module_file(version).stat().st_size)]


def _too_large(path: str, size: int) -> TooLarge:
    return TooLarge(
        f"{_shown(path)} is {size} bytes; files over {MAX_SHOWN_BYTES} bytes (1 MiB) are not shown",
        field="path",
    )


def read_text(version: CodeVersion, path: str) -> str:
    """The text of the version's file `path` (UTF-8), at most MAX_SHOWN_BYTES.

    Raises:
        Invalid: `path` is not a safe relative path (422).
        NotFound: the version has no file `path` (404; the message names it).
        TooLarge: the file is over MAX_SHOWN_BYTES (413).
        UnsupportedType: the file is binary, not UTF-8 text (415).
    """
    check_path(path)
    missing = NotFound(f"code version v{version.version} has no file {_shown(path)}", field="path")
    if version.source == "archive":
        with _archive(version) as archive:
            info = _members(archive).get(path)
            if info is None:
                raise missing
            if info.file_size > MAX_SHOWN_BYTES:
                raise _too_large(path, info.file_size)
            with archive.open(info) as member:
                content = member.read(MAX_SHOWN_BYTES + 1)
    else:
        if path != _module_name(version):
            raise missing
        with _module_file(version).open("rb") as module:
            content = module.read(MAX_SHOWN_BYTES + 1)
    if len(content) > MAX_SHOWN_BYTES:
        raise _too_large(path, len(content))
    return _decoded(path, content)


def _decoded(path: str, content: bytes) -> str:
    binary = UnsupportedType(
        f"{_shown(path)} is a binary file, not UTF-8 text: it cannot be shown", field="path"
    )
    if b"\x00" in content:
        raise binary
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise binary from exc
