"""WarmPool.acquire: a ready interpreter, else one already warming up, else a cold one."""

import threading
from pathlib import Path
from typing import Any

import pytest

from worker.agent import processes
from worker.agent.processes import WarmPool


class FakeStdout:
    """The interpreter's stdout: `@@warm ready` once `ready` is set ('' if it failed)."""

    def __init__(self, ready: threading.Event, line: str) -> None:
        self.ready, self.line = ready, line

    def readline(self) -> str:
        self.ready.wait(10)
        return self.line


class FakePopen:
    def __init__(self, ready: threading.Event, line: str) -> None:
        self.stdout, self.killed = FakeStdout(ready, line), False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def kill(self) -> None:
        self.killed = True

    def wait(self) -> int:
        return -9


class FakeSlot:
    def __init__(self, warm: bool, ready: threading.Event, line: str) -> None:
        self.warm, self.popen = warm, FakePopen(ready, line)
        self.rank_dir = Path("/nonexistent/polytrain-test-rank")


class Started:
    """Every slot `start_slot` made; warm ones print `line` once `ready` is set."""

    def __init__(self) -> None:
        self.slots: list[FakeSlot] = []
        self.ready = threading.Event()
        self.line = "@@warm ready\n"

    def __call__(self, sandbox: Any, *, warm: bool = False) -> FakeSlot:
        slot = FakeSlot(warm, self.ready, self.line)
        self.slots.append(slot)
        return slot

    def first(self) -> FakeSlot:
        """The pool's first interpreter, once its refill thread has started it."""
        while not self.slots:
            threading.Event().wait(0.01)
        return self.slots[0]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Started:
    fake = Started()
    monkeypatch.setattr(processes, "start_slot", fake)
    monkeypatch.setattr(processes, "WARMING_WAIT_S", 5.0)
    monkeypatch.setattr(processes, "REFILL_RETRY_S", 60.0)
    return fake


def _acquire_soon(pool: WarmPool, ready: threading.Event) -> Any:
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(pool.acquire()))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive(), "acquire did not wait for the warming interpreter"
    ready.set()
    thread.join(5)
    return got[0]


def test_acquire_waits_for_a_warming_interpreter_instead_of_starting_a_cold_one(
    started: Started,
) -> None:
    pool = WarmPool(1, sandbox=None)  # type: ignore[arg-type]
    try:
        warming = started.first()
        slot = _acquire_soon(pool, started.ready)
        assert slot is warming and slot.warm
        assert all(s.warm for s in started.slots), "a cold interpreter was started beside it"
    finally:
        pool.close()


def test_acquire_starts_cold_when_the_warming_interpreter_fails(
    started: Started,
) -> None:
    started.line = ""  # the interpreter ends before it is ready (e.g. its import failed)
    pool = WarmPool(1, sandbox=None)  # type: ignore[arg-type]
    try:
        failing = started.first()
        slot = _acquire_soon(pool, started.ready)
        assert not slot.warm and failing.popen.killed
    finally:
        pool.close()
