"""Password hashing (argon2id, via argon2-cffi) and random tokens stored as SHA-256 digests."""

import hashlib
import hmac
import secrets
from functools import lru_cache

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from backend.core import config

TOKEN_PREFIX = "pt_"
LANES = 4  # argon2id parallelism, as RFC 9106's profiles


@lru_cache(maxsize=4)
def _hasher_for(time_cost: int, memory_kib: int) -> tuple[PasswordHasher, str]:
    """argon2id with these parameters, and the hash verified when an email is unknown (so
    that a wrong email costs as much as a wrong password)."""
    hasher = PasswordHasher(time_cost=time_cost, memory_cost=memory_kib, parallelism=LANES)
    return hasher, hasher.hash("polytrain-no-such-user")


def _hasher() -> tuple[PasswordHasher, str]:
    """The hasher of the settings' `password_hash_time_cost` and `password_hash_memory_kib`
    (default: RFC 9106's low-memory profile, t=3, m=64 MiB, p=4)."""
    settings = config.get_settings()
    return _hasher_for(settings.password_hash_time_cost, settings.password_hash_memory_kib)


def hash_password(password: str) -> str:
    """The argon2id hash of `password` (salt and parameters included in the string)."""
    return _hasher()[0].hash(password)


def verify_password(password_hash: str | None, password: str) -> bool:
    """Whether `password` matches `password_hash` (with the parameters the hash names); None
    (no such user) never matches."""
    hasher, dummy = _hasher()
    try:
        return hasher.verify(password_hash or dummy, password) and bool(password_hash)
    except (VerificationError, InvalidHashError):
        return False


def needs_rehash(password_hash: str) -> bool:
    """Whether the hash was made with other parameters than the current ones."""
    return _hasher()[0].check_needs_rehash(password_hash)


def new_api_token() -> str:
    """A fresh personal API token: `pt_` and 256 random bits, URL-safe."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_secret() -> str:
    """256 random bits, URL-safe: session cookies and CSRF tokens."""
    return secrets.token_urlsafe(32)


def digest(token: str) -> str:
    """SHA-256 hex digest of a token: what the database stores and looks up."""
    return hashlib.sha256(token.encode()).hexdigest()


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two secrets."""
    return hmac.compare_digest(a.encode(), b.encode())
