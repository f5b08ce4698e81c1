"""The audit log page: admins only, linked from their navigation, filters that keep their
values, pages of 50 events."""

from fastapi.testclient import TestClient

from tests.backend.web.dom import parse
from tests.conftest import PASSWORD, add_account, login_as, with_csrf


def _member(client: TestClient) -> TestClient:
    return login_as(TestClient(client.app), add_account("bob@example.org"))


def test_only_admins_see_the_page_and_its_link(client: TestClient) -> None:
    admin_nav = parse(client.get("/").text).find("nav")
    assert admin_nav.find("a", href="/admin/audit").text() == "Audit"
    bob = _member(client)
    assert not parse(bob.get("/").text).find("nav").find_all("a", href="/admin/audit")
    refused = bob.get("/admin/audit")
    assert refused.status_code == 403 and "only admins" in refused.text


def test_the_page_lists_portal_and_api_writes_newest_first(client: TestClient) -> None:
    bob = _member(client)
    client.post("/projects", data=with_csrf(client, {"name": "audited"}))
    bob.post("/api/v1/resource-groups", json={"name": "x", "device_type": "cpu", "capacity": 1})
    page = parse(client.get("/admin/audit").text)
    rows = page.by_id("audit-table").find("tbody").find_all("tr")
    assert [(r.attrs["data-action"], r.attrs["data-outcome"]) for r in rows[:2]] == [
        ("resource_group.create", "refused"),
        ("project.create", "ok"),
    ]
    assert "bob@example.org" in rows[0].text() and "API token" in rows[0].text()
    assert "admin@example.org" in rows[1].text() and "portal session" in rows[1].text()
    assert rows[1].find("a").attrs["href"].startswith("/projects/")


def test_filters_keep_their_values(client: TestClient) -> None:
    bob = _member(client)
    bob.post("/api/v1/resource-groups", json={"name": "x", "device_type": "cpu", "capacity": 1})
    client.post("/api/v1/projects", json={"name": "fine"})
    query = {
        "outcome": "refused",
        "actor_user_id": str(bob.account.id),  # type: ignore
        "action": "resource_group.*",
        "since": "2020-01-01T00:00:00",
    }
    answer = client.get("/admin/audit", params=query)
    page = parse(answer.text)
    assert [
        r.attrs["data-action"] for r in page.by_id("audit-table").find("tbody").find_all("tr")
    ] == ["resource_group.create"]
    form = page.by_id("audit-filter")
    assert form.by_id("audit-outcome").find("option", selected="").attrs["value"] == "refused"
    assert form.by_id("audit-actor").find("option", selected="").text() == "bob@example.org"
    assert form.by_id("audit-action").attrs["value"] == "resource_group.*"
    assert form.by_id("audit-since").attrs["value"] == "2020-01-01T00:00:00"


def test_a_bad_filter_is_named_and_kept(client: TestClient) -> None:
    answer = client.get(
        "/admin/audit",
        params={"status_code": "abc", "since": "2026-02-01T00:00", "until": "2026-01-01T00:00"},
    )
    assert answer.status_code == 422
    page = parse(answer.text)
    assert page.find(data_field="status_code")
    assert "after since" in page.find(data_field="until").text()
    assert page.by_id("audit-status").attrs["value"] == "abc"
    assert page.by_id("audit-status").attrs["aria-invalid"] == "true"


def test_pages_of_fifty_keep_the_filters(client: TestClient) -> None:
    for n in range(52):
        client.post("/api/v1/projects", json={"name": f"p{n}"})
    first = parse(client.get("/admin/audit", params={"action": "project.create"}).text)
    assert len(first.by_id("audit-table").find("tbody").find_all("tr")) == 50
    assert first.by_id("audit-total").text() == "52"
    older = first.by_id("audit-older").attrs["href"]
    assert "action=project.create" in older and "offset=50" in older
    second = parse(client.get("/admin/audit" + older).text)
    rows = second.by_id("audit-table").find("tbody").find_all("tr")
    assert len(rows) == 2 and not second.find_all(id="audit-older")
    assert second.by_id("audit-newer")


def test_portal_logins_and_logouts_are_listed(client: TestClient) -> None:
    """A login names the account that logged in; a wrong password has no actor."""
    ada = add_account("ada@example.org")
    browser = TestClient(client.app, follow_redirects=False)

    def login(password: str) -> int:
        page = parse(browser.get("/login").text)
        token = page.find("input", name="csrf_token").attrs["value"]
        return browser.post(
            "/login",
            data={"csrf_token": token, "next": "/", "email": ada.email, "password": password},
        ).status_code

    assert (login("not the password"), login(PASSWORD)) == (401, 303)
    csrf = parse(browser.get("/").text).find("meta", name="csrf-token").attrs["content"]
    assert browser.post("/logout", data={"csrf_token": csrf}).status_code == 303
    rows = (
        parse(client.get("/admin/audit", params={"action": "auth.*"}).text)
        .by_id("audit-table")
        .find("tbody")
        .find_all("tr")
    )
    assert [
        (r.attrs["data-action"], r.attrs["data-outcome"], ada.email in r.text()) for r in rows
    ] == [("auth.logout", "ok", True), ("auth.login", "ok", True), ("auth.login", "refused", False)]
