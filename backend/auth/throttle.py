"""Sign-in abuse controls: login rate limits (the `limits` library) and a bound on the
argon2 hashes that run at once.

A password hash costs 64 MiB and tens of milliseconds of a core on purpose; without a
bound, a burst of logins would run one per threadpool thread and starve every other
request of CPU and memory. Logins therefore verify passwords through a `HashGate`: at
most `hash_concurrency` hashes run, at most `hash_queue` logins wait (each at most
`hash_wait_s` seconds, on the event loop, holding no thread); any other login is
answered 503 with `Retry-After` at once. Before that, `LoginLimiter` counts every
attempt per account (email) and per client address in a moving window and answers
429 with `Retry-After` past the configured rates.
"""

import asyncio
import math
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from limits import RateLimitItem, parse
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from backend.core.config import Settings
from backend.core.errors import Busy, TooManyRequests

T = TypeVar("T")


def client_address(request: Request) -> str:
    """The caller's address (a trusted proxy's client when `forwarded_allow_ips` is set)."""
    return request.client.host if request.client else "unknown"


class LoginLimiter:
    """Moving-window limits on login attempts, per account and per client address.

    Counters live in memory (one API process) unless `rate_limit_storage_url` names a
    shared storage such as `redis://host:6379/1` (several API processes).
    """

    def __init__(self, settings: Settings) -> None:
        uri = settings.rate_limit_storage_url or "memory://"
        self._in_memory = uri.startswith("memory://")
        self._limiter = MovingWindowRateLimiter(storage_from_string(uri))
        self._per_account: RateLimitItem = parse(settings.login_rate_per_account)
        self._per_address: RateLimitItem = parse(settings.login_rate_per_address)

    async def check(self, *, email: str, address: str) -> None:
        """`hit` from the event loop: a shared storage's network calls go to the threadpool.

        Raises:
            TooManyRequests: as `hit`.
        """
        if self._in_memory:
            self.hit(email=email, address=address)
        else:
            await run_in_threadpool(lambda: self.hit(email=email, address=address))

    def hit(self, *, email: str, address: str) -> None:
        """Count one login attempt.

        Raises:
            TooManyRequests: this address or this account tried too often lately
                (`Retry-After`: seconds until the window lets one more in).
        """
        checks = (
            (self._per_address, "address", address, None),
            (self._per_account, "account", email.strip().lower(), "email"),
        )
        for item, kind, key, field in checks:
            if not self._limiter.hit(item, "login", kind, key):
                reset = self._limiter.get_window_stats(item, "login", kind, key).reset_time
                wait = math.ceil(max(1.0, reset - time.time()))
                raise TooManyRequests(
                    f"too many login attempts for this {kind}; try again in {wait} s",
                    retry_after_s=wait,
                    field=field,
                )


class HashGate:
    """Runs password hashing with at most `slots` at once and a bounded, timed wait.

    One gate per app. Its counters are touched only on the event loop; the hash itself
    runs in the threadpool, so the loop stays free while it runs.
    """

    def __init__(self, *, slots: int, queue: int, wait_s: float) -> None:
        self.slots, self.queue, self.wait_s = slots, queue, wait_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free = asyncio.Semaphore(slots)
        self._admitted = 0  # hashing or waiting for a slot

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (tests start one per client)
            self._loop, self._free, self._admitted = loop, asyncio.Semaphore(self.slots), 0
        return self._free

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in the threadpool once a hash slot is free.

        Raises:
            Busy: every slot is taken and `queue` logins already wait, or no slot
                came free within `wait_s` seconds.
        """
        free = self._semaphore()
        if self._admitted >= self.slots + self.queue:
            raise Busy("too many logins at once; try again in a second")
        self._admitted += 1
        try:
            try:
                async with asyncio.timeout(self.wait_s):
                    await free.acquire()
            except TimeoutError as exc:
                raise Busy("too many logins at once; try again in a second") from exc
            try:
                return await run_in_threadpool(fn, *args)
            finally:
                free.release()
        finally:
            self._admitted -= 1
