"""What a write request did, in words an admin filters by: `project.archive` on project 7.

Derived from the matched route's path template, so a new route is named without being
listed anywhere: the path's literal segments are collections (`projects` -> `project`) or
verbs (`archive`, `cancel`); a `{param}` (or `me`, `account`: the caller) binds the
collection before it. The action is `<last collection>.<verb>`; without a verb in the path
it comes from the method: POST to a collection creates, PATCH/PUT or POST to one object
updates, DELETE deletes, GET lists a collection or reads one object (refused reads are
recorded too). REST and portal routes of one operation get the same name
(`POST /api/v1/projects/{id}/archive` and the portal's `POST /projects/{id}/archive` are
both `project.archive`). The object is the created one (from the answer's `id`, or the page
a portal form redirects to) or else the innermost object named in the path.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass

API_PREFIX = ("api", "v1")
SKIPPED = frozenset({"admin"})
VERBS = {
    "login": "login",
    "logout": "logout",
    "password": "change_password",
    "archive": "archive",
    "unarchive": "unarchive",
    "cancel": "cancel",
    "retry": "retry",
    "revoke": "delete",
    "remove": "delete",
    "delete": "delete",
    "edit": "update",
    "state": "update",
    "upload": "create",
    "download": "download",
    "stream": "stream",
}
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Object types whose path ids are another type's ids; and types addressed by name.
OBJECT_TYPE = {"member": "user"}
KEY_FIELD = {"resource_group": "name"}
UNKNOWN = "unknown"
MAX_ID_CHARS = 100


@dataclass(frozen=True)
class Described:
    """The semantic action and its object (type and id, both None when there is none)."""

    action: str
    object_type: str | None = None
    object_id: str | None = None


def collection(segment: str) -> str:
    """A path's plural collection as an object type: `resource-groups` -> `resource_group`."""
    return segment.removesuffix("s").replace("-", "_")


def _walk(
    template: str, params: Mapping[str, str], actor: int | None
) -> tuple[list[list[str | None]], str | None]:
    """The path's collections, each with the id bound to it (or None), and its verb."""
    segments = [s for s in template.strip("/").split("/") if s]
    if tuple(segments[:2]) == API_PREFIX:
        segments = segments[2:]
    nouns: list[list[str | None]] = []
    verb = None
    me = None if actor is None else str(actor)
    for segment in segments:
        if segment in SKIPPED:
            continue
        if segment == "account":
            nouns.append(["user", me])
        elif segment.startswith("{") and nouns:
            nouns[-1][1] = params.get(segment.strip("{}"))
        elif segment == "me" and nouns:
            nouns[-1][1] = me
        elif segment in VERBS:
            verb = VERBS[segment]
        else:
            nouns.append([collection(segment), None])
    return nouns, verb


def _default_verb(method: str, nouns: list[list[str | None]]) -> str:
    unbound = bool(nouns) and nouns[-1][1] is None
    if method in READ_METHODS:
        return "list" if unbound else "read"
    if method == "DELETE":
        return "delete"
    return "create" if method == "POST" and unbound else "update"


def answer_field(body: bytes, *keys: str) -> str | None:
    """A scalar inside a JSON answer, as text: `answer_field(b'{"user": {"id": 2}}', "user",
    "id")` is `"2"`; None if the body is not JSON or has no such scalar."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return None if data is None or isinstance(data, dict | list) else str(data)


def created_id(object_type: str, *, body: bytes | None, location: str | None) -> str | None:
    """The id of an object a request created: from a JSON answer's `id` (`name` for types
    addressed by name), or from the `/<collection>/<id>` page a portal form redirects to."""
    if body and (found := answer_field(body, KEY_FIELD.get(object_type, "id"))):
        return found
    if location:
        parts = location.split("?", 1)[0].strip("/").split("/")
        if len(parts) >= 2 and collection(parts[-2]) == object_type:
            return parts[-1]
    return None


def describe(
    method: str,
    template: str | None,
    params: Mapping[str, str],
    *,
    actor: int | None = None,
    body: bytes | None = None,
    location: str | None = None,
) -> Described:
    """Name the action of a `method` request to the route `template` with `params`.

    `actor` is the caller's user id (what `me` and `/account` stand for); `body` and
    `location` are the answer's JSON body and `Location` header, where a created object's
    id is found. A request that matched no route is `unknown`.
    """
    if template is None:
        return Described(UNKNOWN)
    nouns, verb = _walk(template, params, actor)
    verb = verb or _default_verb(method, nouns)
    noun = str(nouns[-1][0]) if nouns else "auth"
    action = f"{noun}.{verb}"
    if verb == "create" and (new := created_id(noun, body=body, location=location)):
        return Described(action, OBJECT_TYPE.get(noun, noun), new[:MAX_ID_CHARS])
    for kind, bound in reversed(nouns):
        if bound is not None and kind is not None:
            return Described(action, OBJECT_TYPE.get(kind, kind), bound[:MAX_ID_CHARS])
    return Described(action)
