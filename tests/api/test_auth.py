"""Accounts: password login, personal API tokens (shown once, hashed, revocable, expiring),
the first admin from settings, cookie sessions with CSRF protection."""

from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import select

from backend.auth.models import ApiToken
from backend.auth.security import digest
from backend.core.db import get_sessionmaker, utcnow
from tests.conftest import PASSWORD, add_account


def _login(client: TestClient, email: str, password: str = PASSWORD, **extra: object):
    return client.post("/api/v1/auth/login", headers={"Authorization": ""},
                       json={"email": email, "password": password, **extra})


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
        assert response.json()["error"] == {"code": "unauthorized", "field": "password",
                                             "message": "wrong email or password"}
        assert response.headers["www-authenticate"] == "Bearer"


def test_disabled_account_cannot_log_in_and_its_tokens_stop(client: TestClient) -> None:
    account = add_account("ada@example.org")
    client.patch(f"/api/v1/users/{account.id}", json={"is_active": False}).raise_for_status()
    assert _login(client, "ada@example.org").status_code == 403
    refused = client.get("/api/v1/users/me", headers=account.headers)
    assert refused.status_code == 401 and "disabled" in refused.json()["error"]["message"]


def test_revoked_token_is_refused_at_once(client: TestClient) -> None:
    account = add_account("ada@example.org")
    created = client.post("/api/v1/users/me/tokens", headers=account.headers,
                          json={"name": "ci", "expires_in_days": 30}).json()
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
    created = client.post("/api/v1/users", json={"email": "new@example.org",
                                                  "password": "long enough pw"})
    assert created.status_code == 201 and created.json()["role"] == "member"
    assert _login(client, "new@example.org", "long enough pw").status_code == 201
    again = client.post("/api/v1/users", json={"email": "NEW@example.org",
                                                "password": "long enough pw"})
    assert again.status_code == 409 and again.json()["error"]["field"] == "email"
    short = client.post("/api/v1/users", json={"email": "x@example.org", "password": "short"})
    assert short.status_code == 422 and short.json()["error"]["field"] == "password"
    me = client.account.id  # type: ignore[attr-defined]
    demote = client.patch(f"/api/v1/users/{me}", json={"role": "member"})
    assert demote.status_code == 409


def test_password_change_checks_the_current_one(client: TestClient) -> None:
    account = add_account("ada@example.org")
    wrong = client.post("/api/v1/users/me/password", headers=account.headers,
                        json={"current_password": "nope", "new_password": "a new password"})
    assert wrong.status_code == 401
    done = client.post("/api/v1/users/me/password", headers=account.headers,
                       json={"current_password": PASSWORD, "new_password": "a new password"})
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
    created = client.post("/api/v1/projects", json={"name": "p"},
                          headers={"X-CSRF-Token": account.csrf})
    assert created.status_code == 201
