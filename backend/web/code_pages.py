"""Portal page of one code version: who added it and when, its files, and one file's source,
read-only and syntax-highlighted.

The source is split into Pygments tokens here and each token's text is put in the page by
the template, so Jinja's autoescaping escapes every character of it: no markup made from
the uploaded text is marked safe. The token classes are Pygments' short names (`k`, `s2`,
...), styled by frontend/static/code.css.
"""

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_for_filename
from pygments.token import STANDARD_TYPES
from pygments.util import ClassNotFound

from backend.auth.dependencies import WebUser
from backend.core.dependencies import SessionDep
from backend.core.errors import TooLarge, UnsupportedType
from backend.projects import access as project_access
from backend.projects import files
from backend.projects import service as projects
from backend.web.templating import render

router = APIRouter(include_in_schema=False)

HIGHLIGHT_MAX_CHARS = 256 * 1024
"""A longer file is shown as plain text: lexing it would keep the page waiting."""

Line = list[tuple[str, str]]
"""One source line as `(css class, text)` tokens; the class is empty for plain text."""


def _css_class(ttype: Any) -> str:
    """Pygments' short class of a token type (`Keyword.Namespace` -> `kn`), or that of its
    nearest standard parent."""
    while ttype not in STANDARD_TYPES:
        ttype = ttype.parent
    return STANDARD_TYPES[ttype]


def _lexer(path: str, text: str) -> Lexer:
    options = {"stripnl": False, "ensurenl": True}
    if len(text) > HIGHLIGHT_MAX_CHARS:
        return TextLexer(**options)
    try:
        return get_lexer_for_filename(path, text, **options)
    except ClassNotFound:
        return TextLexer(**options)


def highlighted_lines(path: str, text: str) -> list[Line]:
    """`text` as lines of tokens, highlighted by the lexer for `path`'s kind of file (plain
    text when there is none). The texts are raw: the template escapes them."""
    if not text:
        return []
    lines: list[Line] = [[]]
    for ttype, value in _lexer(path, text).get_tokens(text):
        css = _css_class(ttype)
        for index, part in enumerate(value.split("\n")):
            if index:
                lines.append([])
            line = lines[-1]
            if part and line and line[-1][0] == css:  # one span for a run of one class
                line[-1] = (css, line[-1][1] + part)
            elif part:
                line.append((css, part))
    if not lines[-1]:
        lines.pop()  # the text's final newline ends the last line, it starts none
    return lines


def code_page(
    session: SessionDep, project_id: int, version_id: int, user: WebUser, path: str | None
) -> dict[str, Any]:
    """What the code version page shows; `path` (default: the entrypoint or the module) is
    the file whose source is shown, or a notice if it is binary or too large."""
    project = project_access.readable_project(session, user=user, project_id=project_id)
    version = projects.project_version(session, project=project, version_id=version_id)
    listing = files.list_files(version)
    selected = path or version.entrypoint or (listing[0].path if listing else "")
    lines: list[Line] = []
    notice = ""
    try:
        lines = highlighted_lines(selected, files.read_text(version, selected))
    except (TooLarge, UnsupportedType) as exc:
        notice = exc.message
    return {
        "project": project,
        "version": version,
        "uploader": projects.uploader_email(session, version),
        "files": listing,
        "selected": selected,
        "size": next((f.size_bytes for f in listing if f.path == selected), 0),
        "lines": lines,
        "notice": notice,
    }


@router.get("/projects/{project_id}/code/{version_id}")
def code_version(
    request: Request,
    project_id: int,
    version_id: int,
    session: SessionDep,
    user: WebUser,
    file: Annotated[str | None, Query(description="the file's path in the list")] = None,
) -> Response:
    """A code version: who added it and when, its files, and the source of `file`."""
    page = code_page(session, project_id, version_id, user, file or None)
    return render(request, "code.html", page)
