"""Logging in and out of the portal, CSRF on its forms, the account and users pages."""

import re

from fastapi.testclient import TestClient

from backend.auth.dependencies import SESSION_COOKIE
from tests.backend.web.dom import parse
from tests.conftest import PASSWORD, add_account, login_as, with_csrf


def _anonymous(client: TestClient) -> TestClient:
    return TestClient(client.app, follow_redirects=False)


def _login_form(browser: TestClient, next_url: str = "/") -> dict:
    page = parse(browser.get(f"/login?next={next_url}").text)
    return {
        "csrf_token": page.find("input", name="csrf_token").attrs["value"],
        "next": page.find("input", name="next").attrs["value"],
    }


def test_pages_send_a_logged_out_browser_to_log_in(client: TestClient) -> None:
    browser = _anonymous(client)
    response = browser.get("/projects/7?tab=code")
    assert response.status_code == 303
    assert response.headers["location"] == "/login?next=%2Fprojects%2F7%3Ftab%3Dcode"


def test_login_starts_a_session_and_returns_to_the_page(client: TestClient) -> None:
    add_account("ada@example.org")
    browser = _anonymous(client)
    form = _login_form(browser, "/projects")
    response = browser.post(
        "/login", data={**form, "email": "ada@example.org", "password": PASSWORD}
    )
    assert response.status_code == 303 and response.headers["location"] == "/projects"
    cookie = response.headers["set-cookie"]
    assert SESSION_COOKIE in cookie and "HttpOnly" in cookie and "SameSite=lax" in cookie
    page = parse(browser.get("/projects").text)
    assert page.by_id("account-link").text() == "ada@example.org"


def test_wrong_password_is_shown_on_the_form_with_401(client: TestClient) -> None:
    add_account("ada@example.org")
    browser = _anonymous(client)
    response = browser.post(
        "/login", data={**_login_form(browser), "email": "ada@example.org", "password": "wrong"}
    )
    assert response.status_code == 401
    page = parse(response.text)
    assert page.find(data_field="password").text() == "wrong email or password"
    assert page.by_id("login-email").attrs["value"] == "ada@example.org"
    assert SESSION_COOKIE not in response.headers.get("set-cookie", "")


def test_login_refuses_missing_fields_and_a_forged_form(client: TestClient) -> None:
    browser = _anonymous(client)
    missing = browser.post("/login", data={**_login_form(browser), "email": "", "password": ""})
    assert missing.status_code == 422
    assert {n.attrs["data-field"] for n in parse(missing.text).find_all(class_="field-error")} == {
        "email",
        "password",
    }
    forged = _anonymous(client).post(
        "/login", data={"email": "a@b", "password": "x", "csrf_token": "guess"}
    )
    assert forged.status_code == 403


def test_login_never_redirects_to_another_site(client: TestClient) -> None:
    add_account("ada@example.org")
    browser = _anonymous(client)
    form = _login_form(browser, "//evil.example/")
    response = browser.post(
        "/login", data={**form, "email": "ada@example.org", "password": PASSWORD}
    )
    assert response.headers["location"] == "/"


def test_a_form_without_the_csrf_token_is_refused(client: TestClient) -> None:
    response = client.post("/projects", data={"name": "mnist"})
    assert response.status_code == 403
    assert "CSRF" in parse(response.text).by_id("error-message").text()
    assert client.get("/api/v1/projects").json() == []
    wrong = client.post("/projects", data={"name": "mnist", "csrf_token": "x" * 43})
    assert wrong.status_code == 403


def test_logout_ends_the_session(client: TestClient) -> None:
    cookie = client.cookies.get(SESSION_COOKIE)
    response = client.post("/logout", data=with_csrf(client, {}), follow_redirects=False)
    assert response.headers["location"] == "/login"
    browser = _anonymous(client)
    browser.cookies.set(SESSION_COOKIE, cookie)
    assert browser.get("/").status_code == 303


def test_account_page_shows_a_new_token_once_and_revokes_it(client: TestClient) -> None:
    created = client.post(
        "/account/tokens", data=with_csrf(client, {"name": "laptop", "expires_in_days": "30"})
    )
    assert created.status_code == 201
    secret = parse(created.text).by_id("new-token-value").text()
    assert re.fullmatch(r"pt_[\w-]{43}", secret)
    again = client.get("/account").text
    assert secret not in again and "laptop" in again
    headers = {"Authorization": f"Bearer {secret}"}
    assert client.get("/api/v1/users/me", headers=headers).status_code == 200
    row = [r for r in parse(again).by_id("token-table").find_all("tr") if "laptop" in r.text()][0]
    client.post(f"/account/tokens/{row.attrs['data-token-id']}/revoke", data=with_csrf(client, {}))
    assert client.get("/api/v1/users/me", headers=headers).status_code == 401


def test_token_form_errors_are_inline(client: TestClient) -> None:
    response = client.post(
        "/account/tokens", data=with_csrf(client, {"name": "", "expires_in_days": "x"})
    )
    assert response.status_code == 422
    assert parse(response.text).find(data_field="expires_in_days")


def test_users_page_is_for_admins(client: TestClient) -> None:
    page = parse(client.get("/admin/users").text)
    assert page.find("tr", data_user="admin@example.org")
    created = client.post(
        "/admin/users",
        data=with_csrf(
            client,
            {
                "email": "grace@example.org",
                "name": "Grace",
                "password": "long enough",
                "role": "member",
            },
        ),
        follow_redirects=False,
    )
    assert created.status_code == 303
    duplicate = client.post(
        "/admin/users",
        data=with_csrf(client, {"email": "grace@example.org", "password": "long enough"}),
    )
    assert duplicate.status_code == 409 and parse(duplicate.text).find(data_field="email")
    member = login_as(_anonymous(client), add_account("bob@example.org"))
    assert member.get("/admin/users").status_code == 403
    refused = member.post(
        "/admin/users",
        data=with_csrf(member, {"email": "x@example.org", "password": "long enough"}),
    )
    assert refused.status_code == 403


def test_password_form_says_what_is_wrong(client: TestClient) -> None:
    account = add_account("ada@example.org")
    browser = login_as(TestClient(client.app), account)
    wrong = browser.post(
        "/account/password",
        data=with_csrf(
            browser,
            {
                "current_password": "nope",
                "new_password": "a new password",
                "confirm_password": "a new password",
            },
        ),
    )
    assert wrong.status_code == 401
    assert parse(wrong.text).find(data_field="current_password")
    differ = browser.post(
        "/account/password",
        data=with_csrf(
            browser,
            {
                "current_password": PASSWORD,
                "new_password": "a new password",
                "confirm_password": "another one",
            },
        ),
    )
    assert differ.status_code == 422 and parse(differ.text).find(data_field="confirm_password")
    done = browser.post(
        "/account/password",
        data=with_csrf(
            browser,
            {
                "current_password": PASSWORD,
                "new_password": "a new password",
                "confirm_password": "a new password",
            },
        ),
        follow_redirects=False,
    )
    assert done.status_code == 303
