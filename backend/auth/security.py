"""Password hashing (argon2id, via argon2-cffi) and random tokens stored as SHA-256 digests."""

import hashlib
import hmac
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

TOKEN_PREFIX = "pt_"
_hasher = PasswordHasher()  # argon2id, RFC 9106 low-memory profile: t=3, m=64 MiB, p=4
# Verified when an email is unknown, so that a wrong email costs as much as a wrong password.
_DUMMY_HASH = _hasher.hash("polytrain-no-such-user")


def hash_password(password: str) -> str:
    """The argon2id hash of `password` (salt and parameters included in the string)."""
    return _hasher.hash(password)


def verify_password(password_hash: str | None, password: str) -> bool:
    """Whether `password` matches `password_hash`; None (no such user) never matches."""
    try:
        return _hasher.verify(password_hash or _DUMMY_HASH, password) and bool(password_hash)
    except (VerificationError, InvalidHashError):
        return False


def needs_rehash(password_hash: str) -> bool:
    """Whether the hash was made with weaker parameters than the current ones."""
    return _hasher.check_needs_rehash(password_hash)


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
