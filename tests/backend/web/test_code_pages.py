"""The code version page: who uploaded it and when, an archive's files, and a file's source
shown read-only, escaped and highlighted; linked from the project page."""

from fastapi.testclient import TestClient
from sqlalchemy import update

from backend.core import db
from backend.projects.models import CodeVersion
from backend.web.code_pages import highlighted_lines
from tests.backend.conftest import World
from tests.backend.projects.test_code_uploads import _zip as zip_of
from tests.backend.web.dom import Node, parse
from tests.conftest import login_as, with_csrf

XSS = "<script>alert(1)</script>"
MODULE = f'''"""Trains nothing: {XSS}"""
GREETING = "{XSS}"


def build_model():  # </pre><script>alert(2)</script>
    return None


def build_datasets(): ...
def build_optimizer(params): ...
def loss_fn(output, target): ...
'''.encode()


def _upload(client: TestClient, name: str, content: bytes) -> dict:
    project = client.post("/api/v1/projects", json={"name": "viewer"}).json()
    response = client.post(
        f"/api/v1/projects/{project['id']}/code-versions/upload", files={"file": (name, content)}
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def _page_url(version: dict) -> str:
    return f"/projects/{version['project_id']}/code/{version['id']}"


def _raw(node: Node) -> str:
    """The text inside, as it is (`Node.text` collapses whitespace)."""
    return "".join(c if isinstance(c, str) else _raw(c) for c in node.children)


def _source(page: Node) -> str:
    """The shown source as text: each line's text, without the CSS line numbers."""
    return "\n".join(_raw(line) for line in page.by_id("code-source").find_all(class_="line"))


def test_a_module_is_shown_escaped_highlighted_with_its_uploader(client: TestClient) -> None:
    version = _upload(client, "train.py", MODULE)
    response = client.get(_page_url(version))
    assert response.status_code == 200, response.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in response.text
    assert XSS not in response.text and "<script>alert(2)" not in response.text
    page = parse(response.text)
    assert not [s for s in page.find_all("script") if "alert" in s.text()]
    assert page.by_id("code-uploader").text() == client.account.email  # type: ignore[attr-defined]
    created = version["created_at"][:19].replace("T", " ")
    assert page.by_id("code-uploaded-at").text() == created
    assert page.by_id("code-path").text() == "train.py"
    lines = page.by_id("code-source").find_all(class_="line")
    assert len(lines) == MODULE.decode().count("\n")
    assert [n.attrs["id"] for n in lines[:2]] == ["L1", "L2"]
    assert _source(page) == MODULE.decode().removesuffix("\n")
    assert XSS in _raw(lines[0]) and _raw(lines[1]) == f'GREETING = "{XSS}"'
    assert page.by_id("code-source").find("span", class_="k").text() == "def"  # highlighted
    assert "code-files" not in response.text  # a module has no file list
    assert page.by_id("code-raw").attrs["href"] == (
        f"/api/v1/projects/{version['project_id']}/code-versions/{version['id']}/files/train.py"
    )


def test_an_archive_lists_its_files_and_shows_the_chosen_one(client: TestClient) -> None:
    members = {
        "job/train.py": MODULE,
        "job/lib/util.py": b"def util():\n    return '<b>'\n",
        "job/notes & more.txt": b"a & b < c\n",
        "job/weights.bin": b"\x00\x01\x02",
    }
    version = _upload(client, "job.zip", zip_of(members))
    page = parse(client.get(_page_url(version)).text)
    listed = [li.attrs["data-path"] for li in page.by_id("code-files").find_all("li")]
    assert listed == ["lib/util.py", "notes & more.txt", "train.py", "weights.bin"]
    current = page.by_id("code-files").find("a", aria_current="page")
    assert current.text() == "train.py"  # the entrypoint by default
    assert page.by_id("code-path").text() == "train.py"

    util = parse(client.get(_page_url(version), params={"file": "lib/util.py"}).text)
    assert _source(util) == "def util():\n    return '<b>'"
    notes_href = util.by_id("code-files").find_all("a")[1].attrs["href"]
    assert notes_href.endswith("?file=notes%20%26%20more.txt")
    notes = parse(client.get(notes_href).text)
    assert _source(notes) == "a & b < c"

    binary = client.get(_page_url(version), params={"file": "weights.bin"})
    assert binary.status_code == 200
    assert "binary file" in parse(binary.text).by_id("code-notice").text()

    missing = client.get(_page_url(version), params={"file": "nope.py"})
    assert missing.status_code == 404 and "has no file 'nope.py'" in parse(missing.text).text()
    unsafe = client.get(_page_url(version), params={"file": "../train.py"})
    assert unsafe.status_code == 422


def test_the_project_page_links_each_version_to_its_page(client: TestClient) -> None:
    version = _upload(client, "train.py", MODULE)
    page = parse(client.get(f"/projects/{version['project_id']}").text)
    link = page.by_id(f"version-link-{version['version']}")
    assert link.attrs["href"] == _page_url(version)
    assert client.get(link.attrs["href"]).status_code == 200


def test_portal_uploads_and_examples_record_the_uploader(client: TestClient) -> None:
    project = client.post("/api/v1/projects", json={"name": "portal"}).json()
    base = f"/projects/{project['id']}/code-versions"
    uploaded = client.post(
        f"{base}/upload",
        data=with_csrf(client, {}),
        files={"file": ("train.py", MODULE)},
        follow_redirects=False,
    )
    assert uploaded.status_code == 303, uploaded.text
    added = client.post(
        base, data=with_csrf(client, {"example": "tiny_regression"}), follow_redirects=False
    )
    assert added.status_code == 303, added.text
    versions = client.get(f"/api/v1/projects/{project['id']}/code-versions").json()
    me = client.account  # type: ignore[attr-defined]
    assert [v["uploaded_by_id"] for v in versions] == [me.id, me.id]
    page = parse(client.get(_page_url(versions[0])).text)
    assert page.by_id("code-uploader").text() == me.email
    assert page.by_id("code-path").text() == "tiny_regression.py"


def test_an_unrecorded_uploader_says_so(client: TestClient) -> None:
    version = _upload(client, "train.py", MODULE)
    with db.get_sessionmaker()() as session:
        session.execute(update(CodeVersion).values(uploaded_by_id=None))
        session.commit()
    page = parse(client.get(_page_url(version)).text)
    assert page.by_id("code-uploader").text() == "not recorded"


def test_only_those_who_see_the_project_see_the_page(world: World) -> None:
    url = _page_url(world.version)
    viewer = login_as(world.anonymous, world.stranger)
    assert viewer.get(url).status_code == 404
    login_as(viewer, world.member)
    page = viewer.get(url)
    assert page.status_code == 200
    assert parse(page.text).by_id("code-uploader").text() == world.owner.email


def test_highlighted_lines_keep_the_text_line_by_line() -> None:
    text = "x = 1\n\n\ndef f():\r\n    return '<a>'  # done"
    lines = highlighted_lines("m.py", text)
    assert ["".join(part for _, part in line) for line in lines] == [
        "x = 1",
        "",
        "",
        "def f():",
        "    return '<a>'  # done",
    ]
    assert ("k", "def") in lines[3]
    assert highlighted_lines("notes.unknown-kind", "a\nb\n") == [[("", "a")], [("", "b")]]
    assert highlighted_lines("empty.py", "") == []
