"""Password hashing's parameters: RFC 9106's low-memory argon2id profile by default, the
settings' otherwise, and a login with a hash of other parameters stores a new one."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from backend.auth import security
from backend.auth.models import User
from backend.core import config, db
from tests.conftest import ADMIN_EMAIL, PASSWORD


@pytest.fixture
def hash_settings(
    monkeypatch: pytest.MonkeyPatch, service_env: Path
) -> Iterator[pytest.MonkeyPatch]:
    """The environment, with the settings read again after the test's changes."""
    yield monkeypatch
    monkeypatch.undo()
    config.get_settings.cache_clear()


def test_the_default_is_rfc_9106s_low_memory_profile(hash_settings: pytest.MonkeyPatch) -> None:
    hash_settings.delenv("POLYTRAIN_PASSWORD_HASH_TIME_COST")
    hash_settings.delenv("POLYTRAIN_PASSWORD_HASH_MEMORY_KIB")
    config.get_settings.cache_clear()
    stored = security.hash_password("correct horse")
    assert stored.startswith("$argon2id$v=19$m=65536,t=3,p=4$"), stored
    assert security.verify_password(stored, "correct horse")
    assert not security.verify_password(stored, "wrong horse")
    assert not security.verify_password(None, "correct horse")


def test_settings_choose_the_parameters_and_old_hashes_still_verify(
    hash_settings: pytest.MonkeyPatch,
) -> None:
    hash_settings.setenv("POLYTRAIN_PASSWORD_HASH_TIME_COST", "2")
    hash_settings.setenv("POLYTRAIN_PASSWORD_HASH_MEMORY_KIB", "1024")
    config.get_settings.cache_clear()
    old = security.hash_password("correct horse")
    assert "$m=1024,t=2,p=4$" in old
    hash_settings.setenv("POLYTRAIN_PASSWORD_HASH_TIME_COST", "3")
    config.get_settings.cache_clear()
    assert security.verify_password(old, "correct horse")  # the hash names its parameters
    assert security.needs_rehash(old)
    assert not security.needs_rehash(security.hash_password("correct horse"))


def test_a_login_stores_the_hash_again_with_the_current_parameters(
    hash_settings: pytest.MonkeyPatch, client: TestClient
) -> None:
    def stored() -> str | None:
        with db.get_sessionmaker()() as session:
            return session.scalar(select(User.password_hash).where(User.email == ADMIN_EMAIL))

    before = stored()
    assert before is not None and "$m=32,t=1,p=4$" in before  # the tests' parameters
    hash_settings.setenv("POLYTRAIN_PASSWORD_HASH_MEMORY_KIB", "64")
    config.get_settings.cache_clear()
    answer = client.post("/api/v1/auth/login", json={"email": ADMIN_EMAIL, "password": PASSWORD})
    assert answer.status_code == 201, answer.text  # a new API token
    after = stored()
    assert after is not None and "$m=64,t=1,p=4$" in after
    assert security.verify_password(after, PASSWORD)


@pytest.mark.parametrize(
    ("name", "value"),
    [("POLYTRAIN_PASSWORD_HASH_TIME_COST", "0"), ("POLYTRAIN_PASSWORD_HASH_MEMORY_KIB", "16")],
)
def test_parameters_below_argon2s_least_are_refused_naming_the_setting(
    hash_settings: pytest.MonkeyPatch, name: str, value: str
) -> None:
    hash_settings.setenv(name, value)
    with pytest.raises(ValueError, match=name.removeprefix("POLYTRAIN_").lower()):
        config.Settings()  # type: ignore[call-arg]
