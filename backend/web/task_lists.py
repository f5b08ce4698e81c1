"""The portal's task lists (all tasks, a project's tasks): filters by project, status, tag
and name, paging, and the selection that opens a comparison (`/compare`).

The filters arrive as query parameters typed by hand as often as by the form; a value
that cannot be a filter is named next to its input and left out of the filtering, the
rest of the list still shown.
"""

import math
import re
from typing import Any
from urllib.parse import urlencode

from pydantic import BaseModel
from sqlalchemy.orm import Session

from backend.auth.models import User
from backend.projects import access as project_access
from backend.projects.models import Project
from backend.tasks import service as tasks
from backend.tasks.compare import MAX_COMPARED
from backend.tasks.models import TaskStatus
from backend.tasks.schemas import MAX_TAGS, TAG_PATTERN
from backend.web.forms import FieldErrors

PAGE_SIZE = 25


class ListQuery(BaseModel):
    """A task list's filters as typed (query parameters): `project` id, `status`, `tag`
    (several separated by spaces or commas: tasks carrying all of them), `name` (text the
    name contains) and the 1-based `page`."""

    project: str = ""
    status: str = ""
    tag: str = ""
    name: str = ""
    page: str = "1"

    def params(self, **change: str) -> dict[str, str]:
        """The non-empty filters (and page), with `change` applied, for a link."""
        values = {**self.model_dump(), **change}
        return {key: value for key, value in values.items() if value and value != "1"}


def _status(raw: str, errors: FieldErrors) -> TaskStatus | None:
    if not raw:
        return None
    try:
        return TaskStatus(raw.strip().upper())
    except ValueError:
        names = ", ".join(s.value for s in TaskStatus)
        errors["status"] = f"{raw!r} is not a status (one of {names}); not applied"
        return None


def parse_tags(raw: str) -> tuple[tuple[str, ...], str | None]:
    """Tags typed in one input, separated by spaces or commas (each once, in order), and
    what is wrong with them (None: nothing)."""
    tags = tuple(dict.fromkeys(raw.replace(",", " ").split()))
    bad = [t for t in tags if len(t) > 64 or not re.fullmatch(TAG_PATTERN, t)]
    if bad:
        return (), (
            f"{bad[0]!r} is not a tag (a letter or digit, then letters, digits and "
            "_ . : = + / -, at most 64 characters)"
        )
    if len(tags) > MAX_TAGS:
        return (), f"at most {MAX_TAGS} tags ({len(tags)} given)"
    return tags, None


def _tags(raw: str, errors: FieldErrors) -> tuple[str, ...]:
    tags, error = parse_tags(raw)
    if error:
        errors["tag"] = f"{error}; not applied"
    return tags


def _whole(raw: str) -> int | None:
    """`raw` as a positive whole number that fits a database id (ASCII digits), else None."""
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        return None
    return int(raw) or None


def _project(raw: str, visible: list[int] | None, errors: FieldErrors) -> int | None:
    if not raw:
        return None
    project_id = _whole(raw)
    if project_id is None or (visible is not None and project_id not in visible):
        errors["project"] = f"there is no project {raw!r} that you can see; not applied"
        return None
    return project_id


def listing(
    session: Session, user: User, query: ListQuery, *, action: str, project: Project | None
) -> dict[str, Any]:
    """One page of the tasks `user` may see (of `project` if given) that match `query`,
    newest first, with what the page needs: the filters as typed and their errors, the
    total, links to the previous and next pages, and the REST URL its rows refresh from."""
    errors: FieldErrors = {}
    visible = project_access.visible_project_ids(session, user=user)
    where = tasks.TaskFilter(
        project_id=project.id if project else _project(query.project, visible, errors),
        status=_status(query.status, errors),
        tags=_tags(query.tag, errors),
        name=query.name.strip()[:200],
        project_ids=visible,
    )
    total = tasks.count_tasks(session, where=where)
    pages = max(1, math.ceil(total / PAGE_SIZE))
    page = min(pages, _whole(query.page) or 1)
    offset = (page - 1) * PAGE_SIZE
    found = tasks.list_tasks(session, where=where, offset=offset, limit=PAGE_SIZE)
    api: list[tuple[str, Any]] = [
        (key, value)
        for key, value in (
            ("project_id", where.project_id),
            ("status", where.status.value if where.status else None),
            ("name", where.name),
        )
        if value
    ]
    api += [("tag", tag) for tag in where.tags]
    api += [("offset", offset), ("limit", PAGE_SIZE)]

    def link(at: int) -> str | None:
        if not 1 <= at <= pages or at == page:
            return None
        return f"{action}?{urlencode(query.params(page=str(at)))}#task-list"

    return {
        "tasks": found,
        "total": total,
        "first": offset + 1 if found else 0,
        "last": offset + len(found),
        "page": page,
        "pages": pages,
        "prev_url": link(page - 1),
        "next_url": link(page + 1),
        "query": query,
        "errors": errors,
        "filtered": any(query.params(page="").values()),
        "statuses": [s.value for s in TaskStatus],
        "action": action,
        "clear_url": f"{action}#task-list",
        "refresh_url": f"/api/v1/tasks?{urlencode(api)}",
        "max_compared": MAX_COMPARED,
    }
