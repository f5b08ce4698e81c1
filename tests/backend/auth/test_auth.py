"""Accounts: password login, personal API tokens (shown once, hashed, revocable, expiring),
the first admin from settings, cookie sessions with CSRF protection."""

from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from backend.auth.models import ApiToken
from backend.auth.security import digest
from backend.core.db import get_sessionmaker, utcnow
from tests.conftest import PASSWORD, add_account


def _login(client: TestClient, email: str, password: str = PASSWORD, **extra: object):
    return client.post(
        "/api/v1/auth/login",
        headers={"Authorization": ""},
        json={"email": email, "password": password, **extra},
    )


def test_login_gives_a_token_shown_once_and_stored_hashed(client: TestClient) -> None:
    account = add_account("ada@example.org")
    response = _login(client, "ADA@example.org", token_name="laptop")
    assert response.status_code == 201, response.text
    body = response.json()
    token = body["token"]
    assert token.startswith("pt_") and body["prefix"] == token[:9]
    assert body["user"]["email"] == "ada@example.org" and body["user"]["role"] == "member"
    me = client.get("/api/v1/users/me", headers={"Authorization": f"Bearer {token}"})
    assert me.json()["id"] == account.id
    listed = client.get("/api/v1/users/me/tokens", headers={"Authorization": f"Bearer {token}"})
    assert "token" not in listed.json()[0] and listed.json()[0]["name"] == "laptop"
    with get_sessionmaker()() as session:
        stored = session.scalars(select(ApiToken.token_hash)).all()
    assert digest(token) in stored and token not in stored


def test_wrong_password_and_unknown_email_get_the_same_401(client: TestClient) -> None:
    add_account("ada@example.org")
    wrong = _login(client, "ada@example.org", "not the password")
    unknown = _login(client, "nobody@example.org")
    for response in (wrong, unknown):
        assert response.status_code == 401
        assert response.json()["error"] == {
            "code": "unauthorized",
            "field": "password",
            "message": "wrong email or password",
        }
        assert response.headers["www-authenticate"] == "Bearer"


def test_disabled_account_cannot_log_in_and_its_tokens_stop(client: TestClient) -> None:
    account = add_account("ada@example.org")
    client.patch(f"/api/v1/users/{account.id}", json={"is_active": False}).raise_for_status()
    assert _login(client, "ada@example.org").status_code == 403
    refused = client.get("/api/v1/users/me", headers=account.headers)
    assert refused.status_code == 401 and "disabled" in refused.json()["error"]["message"]


def test_revoked_token_is_refused_at_once(client: TestClient) -> None:
    account = add_account("ada@example.org")
    created = client.post(
        "/api/v1/users/me/tokens",
        headers=account.headers,
        json={"name": "ci", "expires_in_days": 30},
    ).json()
    as_ci = {"Authorization": f"Bearer {created['token']}"}
    assert client.get("/api/v1/projects", headers=as_ci).status_code == 200
    revoked = client.delete(f"/api/v1/users/me/tokens/{created['id']}", headers=account.headers)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    refused = client.get("/api/v1/projects", headers=as_ci)
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "API token 'ci' was revoked"
    other = add_account("bob@example.org")
    stolen = client.delete(f"/api/v1/users/me/tokens/{created['id']}", headers=other.headers)
    assert stolen.status_code == 404


def test_expired_token_is_refused(client: TestClient) -> None:
    account = add_account("ada@example.org")
    with get_sessionmaker()() as session:
        token = session.scalar(select(ApiToken).where(ApiToken.user_id == account.id))
        token.expires_at = utcnow() - timedelta(seconds=1)
        session.commit()
    refused = client.get("/api/v1/projects", headers=account.headers)
    assert refused.status_code == 401 and "expired" in refused.json()["error"]["message"]
    garbage = client.get("/api/v1/projects", headers={"Authorization": "Bearer pt_nonsense"})
    assert garbage.json()["error"]["message"] == "invalid API token"


def test_logout_revokes_the_calling_token(client: TestClient) -> None:
    token = _login(client, (add_account("ada@example.org")).email).json()["token"]
    headers = {"Authorization": f"Bearer {token}"}
    assert client.post("/api/v1/auth/logout", headers=headers).status_code == 204
    assert client.get("/api/v1/users/me", headers=headers).status_code == 401


def test_admin_creates_users_and_cannot_lock_themself_out(client: TestClient) -> None:
    created = client.post(
        "/api/v1/users", json={"email": "new@example.org", "password": "long enough pw"}
    )
    assert created.status_code == 201 and created.json()["role"] == "member"
    assert _login(client, "new@example.org", "long enough pw").status_code == 201
    again = client.post(
        "/api/v1/users", json={"email": "NEW@example.org", "password": "long enough pw"}
    )
    assert again.status_code == 409 and again.json()["error"]["field"] == "email"
    short = client.post("/api/v1/users", json={"email": "x@example.org", "password": "short"})
    assert short.status_code == 422 and short.json()["error"]["field"] == "password"
    me = client.account.id  # type: ignore[attr-defined]
    demote = client.patch(f"/api/v1/users/{me}", json={"role": "member"})
    assert demote.status_code == 409


def test_password_change_checks_the_current_one(client: TestClient) -> None:
    account = add_account("ada@example.org")
    wrong = client.post(
        "/api/v1/users/me/password",
        headers=account.headers,
        json={"current_password": "nope", "new_password": "a new password"},
    )
    assert wrong.status_code == 401
    done = client.post(
        "/api/v1/users/me/password",
        headers=account.headers,
        json={"current_password": PASSWORD, "new_password": "a new password"},
    )
    assert done.status_code == 204
    assert _login(client, account.email, "a new password").status_code == 201


def test_first_admin_comes_from_the_settings(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from backend.core import config
    from backend.main import create_app

    monkeypatch.setenv("POLYTRAIN_ADMIN_EMAIL", "root@example.org")
    monkeypatch.setenv("POLYTRAIN_ADMIN_PASSWORD", "bootstrap-secret")
    config.get_settings.cache_clear()
    with TestClient(create_app(run_scheduler=False)) as fresh:
        body = _login(fresh, "root@example.org", "bootstrap-secret").json()
        assert body["user"]["role"] == "admin"
    with TestClient(create_app(run_scheduler=False)) as again:  # a restart creates no second
        users = again.get("/api/v1/users", headers={"Authorization": f"Bearer {body['token']}"})
        assert [u["email"] for u in users.json()] == ["root@example.org"]


def test_portal_session_may_call_the_api_with_its_csrf_token(client: TestClient) -> None:
    """The portal's scripts use the session cookie; a change then needs X-CSRF-Token."""
    account = client.account  # type: ignore[attr-defined]
    del client.headers["Authorization"]
    assert client.get("/api/v1/projects").status_code == 200
    refused = client.post("/api/v1/projects", json={"name": "p"})
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]["message"]
    created = client.post(
        "/api/v1/projects", json={"name": "p"}, headers={"X-CSRF-Token": account.csrf}
    )
    assert created.status_code == 201


# --- sign-in abuse: rate limits, bounded hashing, credentials ended by a password change ---


def _app_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> TestClient:
    """A fresh app (not started) with these POLYTRAIN_* settings."""
    from backend.core import config
    from backend.main import create_app

    for key, value in env.items():
        monkeypatch.setenv(f"POLYTRAIN_{key.upper()}", value)
    config.get_settings.cache_clear()
    return TestClient(create_app(run_scheduler=False))


def test_logins_from_one_address_are_rate_limited(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with _app_with(monkeypatch, login_rate_per_address="3/minute") as app:
        add_account("ada@example.org")
        answers = [
            _login(app, f"user{i}@example.org", "wrong password").status_code for i in range(3)
        ]
        assert answers == [401, 401, 401]
        limited = _login(app, "ada@example.org")  # even the right password, from this address
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "too_many_requests"
        assert 1 <= int(limited.headers["retry-after"]) <= 60


def test_logins_to_one_account_are_rate_limited_whatever_the_address(  # type: ignore[no-untyped-def]
    service_env, monkeypatch
) -> None:
    with _app_with(monkeypatch, login_rate_per_account="2/minute", forwarded_allow_ips="*") as app:
        add_account("ada@example.org")

        def attempt(address: str, email: str = "ADA@example.org", password: str = "guess 1"):
            return app.post(
                "/api/v1/auth/login",
                json={"email": email, "password": password},
                headers={"X-Forwarded-For": address, "Authorization": ""},
            )

        assert [attempt(f"10.0.0.{i}").status_code for i in (1, 2)] == [401, 401]
        limited = attempt("10.0.0.3", password=PASSWORD)
        assert limited.status_code == 429 and limited.json()["error"]["field"] == "email"
        assert "retry-after" in limited.headers
        assert attempt("10.0.0.4", email="bob@example.org").status_code == 401  # others go on


def test_guessing_the_current_password_is_rate_limited_like_a_login(  # type: ignore[no-untyped-def]
    service_env, monkeypatch
) -> None:
    """A stolen token cannot guess the current password without limit: a password change
    counts against the account's login limit (and hashes through the same bounded gate)."""
    with _app_with(monkeypatch, login_rate_per_account="2/minute") as app:
        account = add_account("ada@example.org")

        def change(current: str):
            return app.post(
                "/api/v1/users/me/password",
                headers=account.headers,
                json={"current_password": current, "new_password": "new pass 1234"},
            )

        assert [change(f"guess {i}").status_code for i in (1, 2)] == [401, 401]
        limited = change(PASSWORD)
        assert limited.status_code == 429 and "retry-after" in limited.headers
        assert _login(app, "ada@example.org").status_code == 429  # the same account budget


def test_portal_login_is_rate_limited_too(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tests.backend.web.dom import parse

    with _app_with(monkeypatch, login_rate_per_account="1/minute") as app:
        add_account("ada@example.org")
        statuses = []
        for _ in range(2):
            page = parse(app.get("/login").text)
            csrf = page.find("input", name="csrf_token").attrs["value"]
            answer = app.post(
                "/login",
                follow_redirects=False,
                data={"email": "ada@example.org", "password": PASSWORD, "csrf_token": csrf},
            )
            statuses.append(answer.status_code)
        assert statuses == [303, 429]
        assert "too many login attempts" in answer.text and "retry-after" in answer.headers


def test_the_hash_gate_bounds_concurrent_hashes_and_refuses_past_its_queue() -> None:
    """Two slots, one waiter: of five logins at once, two hash, one waits and runs, two
    are refused at once with Busy; never more than two hashes run together."""
    import asyncio
    import threading

    from backend.auth.throttle import HashGate
    from backend.core.errors import Busy

    gate = HashGate(slots=2, queue=1, wait_s=30)
    running, peak, lock = 0, 0, threading.Lock()
    release = threading.Event()

    def fake_hash() -> str:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(10)
        with lock:
            running -= 1
        return "hashed"

    async def burst() -> list[object]:
        calls = [asyncio.ensure_future(gate.run(fake_hash)) for _ in range(5)]
        for _ in range(1000):  # until two hashes run and the two refused calls are done
            await asyncio.sleep(0.01)
            if sum(c.done() for c in calls) == 2 and running == 2:
                break
        release.set()
        return list(await asyncio.gather(*calls, return_exceptions=True))

    results = asyncio.run(burst())
    assert results.count("hashed") == 3
    assert sum(isinstance(r, Busy) for r in results) == 2
    assert peak == 2


def test_a_full_hash_gate_answers_503_with_retry_after(service_env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from backend.core.errors import Busy

    with _app_with(monkeypatch) as app:
        add_account("ada@example.org")

        async def busy(*_: object) -> None:
            raise Busy("too many logins at once; try again in a second")

        monkeypatch.setattr(app.app.state.hash_gate, "run", busy)  # type: ignore[attr-defined]
        answer = _login(app, "ada@example.org")
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "busy"


def test_password_change_ends_every_other_session_and_token(client: TestClient) -> None:
    account = add_account("ada@example.org")
    other = _login(client, account.email).json()["token"]
    changed = client.post(
        "/api/v1/users/me/password",
        headers=account.headers,
        json={"current_password": PASSWORD, "new_password": "a new password"},
    )
    assert changed.status_code == 204
    assert client.get("/api/v1/users/me", headers=account.headers).status_code == 200  # kept
    refused = client.get("/api/v1/users/me", headers={"Authorization": f"Bearer {other}"})
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    browser = TestClient(client.app)
    browser.cookies.set("polytrain_session", account.cookie)
    assert browser.get("/account", follow_redirects=False).status_code == 303  # to /login


def test_portal_password_change_keeps_this_browser_only(client: TestClient) -> None:
    from tests.conftest import login_as, with_csrf

    account = add_account("ada@example.org")
    browser = login_as(TestClient(client.app), account)
    done = browser.post(
        "/account/password",
        follow_redirects=False,
        data=with_csrf(
            browser,
            {
                "current_password": PASSWORD,
                "new_password": "a new password",
                "confirm_password": "a new password",
            },
        ),
    )
    assert done.status_code == 303
    assert browser.get("/account", follow_redirects=False).status_code == 200
    assert client.get("/api/v1/users/me", headers=account.headers).status_code == 401


def test_admin_password_reset_ends_the_users_sessions_and_tokens(client: TestClient) -> None:
    account = add_account("ada@example.org")
    reset = client.patch(f"/api/v1/users/{account.id}", json={"password": "reset by admin"})
    assert reset.status_code == 200
    assert client.get("/api/v1/users/me", headers=account.headers).status_code == 401
    browser = TestClient(client.app)
    browser.cookies.set("polytrain_session", account.cookie)
    assert browser.get("/account", follow_redirects=False).status_code == 303
    assert client.get("/api/v1/users/me").status_code == 200  # the admin's own token goes on
    assert _login(client, account.email, "reset by admin").status_code == 201


def test_tokens_without_an_expiry_get_the_default(client: TestClient) -> None:
    account = add_account("ada@example.org")
    created = client.post("/api/v1/users/me/tokens", headers=account.headers, json={"name": "ci"})
    assert created.status_code == 201
    expires = datetime.fromisoformat(created.json()["expires_at"]).replace(tzinfo=None)
    assert abs(expires - (utcnow() + timedelta(days=90))) < timedelta(minutes=5)
    null = client.post(
        "/api/v1/users/me/tokens",
        headers=account.headers,
        json={"name": "ci", "expires_in_days": None},
    ).json()
    assert null["expires_at"] is not None


def test_token_cap_refuses_new_tokens_and_login_rotates_the_oldest(  # type: ignore[no-untyped-def]
    service_env, monkeypatch
) -> None:
    with _app_with(monkeypatch, token_cap_per_user="3") as app:
        account = add_account("ada@example.org")  # holds one token already
        for name in ("a", "b"):
            app.post(
                "/api/v1/users/me/tokens", headers=account.headers, json={"name": name}
            ).raise_for_status()
        refused = app.post("/api/v1/users/me/tokens", headers=account.headers, json={"name": "c"})
        assert refused.status_code == 409 and refused.json()["error"]["field"] == "name"
        assert "revoke one" in refused.json()["error"]["message"]
        fresh = _login(app, account.email)
        assert fresh.status_code == 201
        # the login revoked the oldest live token (the account's first) to stay at the cap
        assert app.get("/api/v1/users/me", headers=account.headers).status_code == 401
        live = [
            t
            for t in app.get(
                "/api/v1/users/me/tokens",
                headers={"Authorization": f"Bearer {fresh.json()['token']}"},
            ).json()
            if not t["revoked_at"]
        ]
        assert sorted(t["name"] for t in live) == ["a", "b", "cli"]
